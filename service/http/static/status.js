// The status page: a table of the buffers, a row of charts per buffer (the server's last ten minutes, from
// api/history) and a detail view of one buffer (api/buffers/<name>), refreshed every second. With a server
// token the page is opened as /#token=...: the fragment never leaves the browser; without one it asks for it.
"use strict";

const SERIES_COLORS = ["#2f855a", "#3182ce", "#dd6b20", "#805ad5"];
const last = {};  // the previous counters of each buffer, for the table's rates
const charts = {};  // buffer -> {throughput, ratio, latency, bytes}: uPlot instances (read by scripts and tests)
window.replaydCharts = charts;
let prioritiesChart = null;
window.replaydPriorities = () => prioritiesChart;

function state() {
  const params = new URLSearchParams(location.hash.slice(1));
  return {token: params.get("token"), buffer: params.get("buffer")};
}

function pageLink(buffer) {
  const params = new URLSearchParams();
  const {token} = state();
  if (token) params.set("token", token);
  if (buffer) params.set("buffer", buffer);
  return "#" + params.toString();
}

class Unauthorized extends Error {}

async function api(path) {
  const {token} = state();
  const response = await fetch(path, {headers: token ? {Authorization: "Bearer " + token} : {}});
  if (response.status === 401) throw new Unauthorized("sign in: this server needs its token");
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

const number = n => Number(n).toLocaleString("en-US");

function bytes(n) {
  if (n == null) return "";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return (i ? n.toFixed(1) : String(Math.round(n))) + " " + units[i];
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

// ---------------------------------------------------------------- the table

function row(b, now) {
  const prev = last[b.name];
  const dt = prev ? now - prev.t : 0;
  // A counter lower than before restarted (the buffer was deleted and created again): no rate this time.
  const rate = (value, before) => prev && dt > 0 && value >= before ? number(Math.round((value - before) / dt))
                                                                    : "-";
  const ins = rate(b.inserted_steps, prev?.ins);
  const smp = rate(b.sampled_items, prev?.smp);
  last[b.name] = {t: now, ins: b.inserted_steps, smp: b.sampled_items};
  const fill = (100 * b.fill).toFixed(1);
  const tr = document.createElement("tr");
  tr.dataset.buffer = b.name;  // names are user input: set as text, never as HTML
  const name = cell("", "name");
  const link = document.createElement("a");
  link.href = pageLink(b.name);
  link.textContent = b.name;
  name.append(link);
  const bar = cell("", "num");
  bar.innerHTML = `<span class="bar"><span class="fill" style="display:block;width:${fill}%"></span></span>`;
  bar.append(fill + "%");
  tr.append(name, cell(b.kind, "kind"), bar, cell(number(b.stored_steps), "num stored"),
            cell(number(b.capacity_steps), "num"), cell(number(b.episodes), "num"), cell(ins, "num"),
            cell(smp, "num"));
  return tr;
}

// ---------------------------------------------------------------- the charts

function chartOptions(title, labels, width, extra = {}) {
  const series = [{}, ...labels.map((label, i) => ({label, stroke: SERIES_COLORS[i], width: 1.5, spanGaps: false}))];
  return {title, width, height: 170, series, legend: {live: false}, cursor: {show: false},
          scales: {x: {time: true}}, ...extra};
}

const axisValues = format => [{}, {values: (u, ticks) => ticks.map(format), size: 70}];

function bufferCharts(name) {
  const section = document.createElement("section");
  section.className = "buffer-charts";
  section.dataset.charts = name;
  const heading = document.createElement("h2");
  heading.textContent = name;
  const rowOfCharts = document.createElement("div");  // one row per buffer (a sharded view: one per shard)
  rowOfCharts.className = "chart-row";
  section.append(heading, rowOfCharts);
  document.getElementById("charts").append(section);
  const width = Math.max(280, Math.floor((rowOfCharts.clientWidth - 16) / 2));
  const empty = n => Array.from({length: n + 1}, () => []);
  const ms = v => v == null ? "" : (v < 1 ? v.toPrecision(2) : number(v.toFixed(0))) + " ms";
  charts[name] = {
    section,
    throughput: new uPlot(chartOptions("per second", ["inserted steps", "sampled items"], width,
                                       {axes: axisValues(v => number(v))}), empty(2), rowOfCharts),
    ratio: new uPlot(chartOptions("replay ratio (sampled items per inserted step, last 10 s)", ["replay ratio"],
                                  width), empty(1), rowOfCharts),
    latency: new uPlot(chartOptions("latency", ["insert p50", "insert p99", "sample p50", "sample p99"], width,
                                    {axes: axisValues(ms), scales: {x: {time: true}, y: {distr: 3}}}),
                       empty(4), rowOfCharts),
    bytes: new uPlot(chartOptions("stored bytes", ["stored"], width, {axes: axisValues(bytes)}), empty(1),
                     rowOfCharts),
  };
  return charts[name];
}

function updateCharts(history) {
  for (const name of Object.keys(charts)) {
    if (!(name in history.buffers)) {
      for (const chart of ["throughput", "ratio", "latency", "bytes"]) charts[name][chart].destroy();
      charts[name].section.remove();
      delete charts[name];
    }
  }
  for (const [name, h] of Object.entries(history.buffers)) {
    const chart = charts[name] || bufferCharts(name);
    const ms = column => column.map(v => v == null ? null : 1000 * v);
    chart.throughput.setData([h.t, h.inserts_per_s, h.samples_per_s]);
    chart.ratio.setData([h.t, h.replay_ratio]);
    chart.latency.setData([h.t, ms(h.insert_p50), ms(h.insert_p99), ms(h.sample_p50), ms(h.sample_p99)]);
    chart.bytes.setData([h.t, h.stored_bytes]);
  }
}

// ---------------------------------------------------------------- the detail view

function component(options) {  // {"kind": "prioritized", "alpha": 0.6} -> "prioritized (alpha 0.6)"
  const params = Object.entries(options).filter(([key]) => key !== "kind").map(([key, value]) => `${key} ${value}`);
  return params.length ? `${options.kind} (${params.join(", ")})` : options.kind;
}

function keyValues(table, pairs) {
  table.replaceChildren(...pairs.map(([key, value]) => {
    const tr = document.createElement("tr");
    tr.append(cell(key), cell(value, "num"));
    return tr;
  }));
}

function tableRows(tbody, rows) {
  tbody.replaceChildren(...rows.map(values => {
    const tr = document.createElement("tr");
    tr.append(...values.map(v => cell(v)));
    return tr;
  }));
}

function configPairs(d) {
  const c = d.config;
  const pairs = [["capacity", number(c.capacity_steps) + " steps"]];
  if (d.kind === "rollout") {
    return pairs.concat([["steps x envs", `${c.num_steps} x ${c.num_envs}`], ["gamma", c.gamma],
                         ["GAE lambda", c.gae_lambda]]);
  }
  return pairs.concat([["sampler", component(c.sampler)], ["remover", component(c.remover)],
                       ["rate limiter", component(c.rate_limiter)], ["reward field", c.reward_field ?? "none"]]);
}

function showPriorities(p) {
  document.getElementById("priorities-note").textContent =
    `${number(p.steps)} steps with a ${p.of} > 0` + (p.steps ? `, from ${p.edges[0].toPrecision(3)} to `
    + `${p.edges[p.edges.length - 1].toPrecision(3)} (log-spaced bins)` : "");
  const centers = p.counts.map((_, i) => Math.sqrt(p.edges[i] * p.edges[i + 1]));
  if (!prioritiesChart) {
    const target = document.getElementById("priorities");
    prioritiesChart = new uPlot({
      width: Math.max(280, target.clientWidth), height: 160, legend: {show: false}, cursor: {show: false},
      scales: {x: {time: false, distr: 3}},
      series: [{}, {label: "steps", fill: "#2f855a88", stroke: SERIES_COLORS[0],
                    paths: uPlot.paths.bars({size: [0.9]}), points: {show: false}}],
    }, [[], []], target);
  }
  prioritiesChart.setData([centers, p.counts]);
}

// "observation", with its frames' stacking and compression when it has them
function fieldRole(f) {
  if (!f.observation) return "";
  const frames = [f.stack > 1 ? "stack " + f.stack : "", f.compression ? f.compression : ""].filter(Boolean);
  return frames.length ? "observation (" + frames.join(", ") + ")" : "observation";
}

function showDetail(d) {
  document.getElementById("detail-name").textContent = d.name;
  document.getElementById("detail-kind").textContent = d.kind;
  document.getElementById("detail-close").href = pageLink(null);
  keyValues(document.getElementById("config"), configPairs(d));
  tableRows(document.querySelector("#fields tbody"), d.config.fields.map(
    f => [f.name, f.dtype, "(" + f.shape.join(", ") + ")", fieldRole(f)]));
  document.getElementById("limiter-box").hidden = !d.rate_limiter;
  if (d.rate_limiter) {
    tableRows(document.querySelector("#limiter tbody"), ["insert", "sample"].map(side => {
      const s = d.rate_limiter[side];
      return [side, number(s.waiting), number(s.waits), s.wait_seconds.toFixed(2) + " s"];
    }));
  }
  document.getElementById("rollout-box").hidden = !d.rollout;
  if (d.rollout) {
    const r = d.rollout;
    keyValues(document.getElementById("rollout"), [
      ["policy version", r.policy_version], ["filled cells", `${number(r.filled_cells)} / ${number(r.cells)}`],
      ["complete", r.rollout_complete ? "yes" : "no"], ["stale pushes refused", number(r.stale_pushes)]]);
  }
  document.getElementById("priorities-box").hidden = !d.priorities;
  if (d.priorities) showPriorities(d.priorities);
}

function hideDetail() {
  document.getElementById("detail").hidden = true;
  if (prioritiesChart) { prioritiesChart.destroy(); prioritiesChart = null; }
}

// ---------------------------------------------------------------- refresh and sign-in

function showSignIn(refused) {
  document.getElementById("dashboard").hidden = true;
  document.getElementById("signin").hidden = false;
  document.getElementById("refused").hidden = !refused;
}

async function refresh() {
  const status = document.getElementById("status");
  const {token, buffer} = state();
  try {
    // A detail view of a buffer that is gone says so and leaves the rest of the page as it is.
    const details = buffer ? api("api/buffers/" + encodeURIComponent(buffer)).catch(error => {
      if (error instanceof Unauthorized) throw error;
      return {missing: `buffer ${buffer}: ${error.message}`};
    }) : null;
    const [data, history, detail] = await Promise.all([api("api/buffers"), api("api/history"), details]);
    document.getElementById("signin").hidden = true;
    document.getElementById("dashboard").hidden = false;
    document.getElementById("instance").textContent = data.instance;
    const now = Date.now() / 1000;
    document.getElementById("rows").replaceChildren(...data.buffers.map(b => row(b, now)));
    document.getElementById("empty").hidden = data.buffers.length > 0;
    updateCharts(history);
    if (detail && !detail.missing) {
      document.getElementById("detail").hidden = false;
      showDetail(detail);
    } else {
      hideDetail();
    }
    status.className = detail?.missing ? "error" : "";
    status.textContent = detail?.missing ?? "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    if (error instanceof Unauthorized) showSignIn(Boolean(token));
    status.className = "error";
    status.textContent = error.message;
  }
}

document.getElementById("signin").addEventListener("submit", event => {
  event.preventDefault();
  const params = new URLSearchParams(location.hash.slice(1));
  params.set("token", document.getElementById("token").value);
  location.hash = params.toString();  // hashchange refreshes
});
window.addEventListener("hashchange", refresh);
refresh();
setInterval(refresh, 1000);
