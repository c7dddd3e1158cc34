"""The HTTP side of a replay server: health, Prometheus metrics, buffer stats and a status page."""

from __future__ import annotations

import ipaddress
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.middleware.trustedhost import TrustedHostMiddleware

from service.buffers.episodic import EpisodicBuffer
from service.errors import NotFound
from service.registry import BufferRegistry
from service.tokens import token_matches

STATUS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>replayd</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
:root{--fg:#1d2433;--muted:#6b7385;--line:#e3e6ec;--accent:#2f855a;--bg:#f6f7f9}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg);
  margin:0;padding:2rem}
main{max-width:1100px;margin:0 auto}
header{display:flex;align-items:baseline;gap:1rem;margin-bottom:1rem}
h1{font-size:1.5rem;margin:0}h1 span{color:var(--muted);font-weight:400;font-size:1rem}
#status{margin-left:auto;color:var(--muted)}#status.error{color:#c53030}
table{width:100%;border-collapse:collapse;background:#fff;border:1px solid var(--line);border-radius:8px;
  overflow:hidden}
th,td{padding:.6rem .9rem;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th{background:#fafbfc;color:var(--muted);font-weight:600;font-size:.8rem;text-transform:uppercase;letter-spacing:.03em}
th:first-child,td:first-child,th:nth-child(2),td:nth-child(2){text-align:left}
tbody tr:last-child td{border-bottom:none}
td.name{font-weight:600}.kind{color:var(--muted)}.num{font-variant-numeric:tabular-nums}
.bar{display:inline-block;vertical-align:middle;background:#edf0f3;width:140px;height:10px;border-radius:5px;
  overflow:hidden;margin-right:.5rem}.fill{background:var(--accent);height:100%}
#empty{color:var(--muted);padding:1rem 0}
</style>
</head><body><main>
<header><h1>replayd <span id="instance"></span></h1><div id="status">loading</div></header>
<table><thead><tr><th>buffer</th><th>kind</th><th>fill</th><th>stored steps</th><th>capacity</th><th>episodes</th>
<th>inserts/s</th><th>samples/s</th></tr></thead><tbody id="rows"></tbody></table>
<p id="empty" hidden>No buffers yet.</p>
<script>
// With a server token, open the page as /#token=...: the fragment never leaves the browser.
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const headers = token ? {Authorization: "Bearer " + token} : {};
const last = {};
const number = n => Number(n).toLocaleString("en-US");
function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}
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
  const bar = cell("", "num");
  bar.innerHTML = `<span class="bar"><span class="fill" style="display:block;width:${fill}%"></span></span>`;
  bar.append(fill + "%");
  tr.append(cell(b.name, "name"), cell(b.kind, "kind"), bar, cell(number(b.stored_steps), "num stored"),
            cell(number(b.capacity_steps), "num"), cell(number(b.episodes), "num"), cell(ins, "num"),
            cell(smp, "num"));
  return tr;
}
async function refresh() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("api/buffers", {headers});
    if (!response.ok) throw new Error(response.status === 401 ? "unauthorized: open /#token=<token>"
                                                              : "HTTP " + response.status);
    const data = await response.json();
    document.getElementById("instance").textContent = data.instance;
    const now = Date.now() / 1000;
    document.getElementById("rows").replaceChildren(...data.buffers.map(b => row(b, now)));
    document.getElementById("empty").hidden = data.buffers.length > 0;
    status.className = "";
    status.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    status.className = "error";
    status.textContent = error.message;
  }
}
refresh(); setInterval(refresh, 1000);
</script></main></body></html>"""


def buffer_stats(registry: BufferRegistry) -> list[dict]:
    stats = []
    for name, buffer in registry.all():
        try:
            if isinstance(buffer, EpisodicBuffer):
                with buffer.live():
                    capacity, stored = buffer.capacity, buffer.stored_steps
                    counters, episodes = {**buffer.counters, **buffer.component_counters()}, buffer.episodes
                    sampleable, rate_limiter = buffer.sampleable_steps, buffer.limiter.to_config()
                    frames = buffer.frame_stats()
            else:
                info = buffer.info()
                capacity = info["num_steps"] * info["num_envs"]
                stored, counters, episodes = capacity - info["missing_steps"], info["counters"], 0
                sampleable, rate_limiter, frames = None, None, {}
        except NotFound:
            continue  # deleted while the stats were being read
        stats.append({
            "name": name,
            "kind": buffer.kind if isinstance(buffer, EpisodicBuffer) else "rollout",
            "capacity_steps": capacity,
            "stored_steps": stored,
            "fill": stored / capacity,
            "sampleable_steps": sampleable,
            "episodes": episodes,
            "rate_limiter": rate_limiter,
            "inserted_steps": int(counters.get("inserted_rows", counters.get("pushed_steps", 0))),
            "sampled_items": int(counters.get("sampled_items", counters.get("served_samples", 0))),
            "counters": {k: float(v) for k, v in counters.items()},
            "frames": frames,  # per compressed field: stored_bytes, arena_bytes, compression_ratio
        })
    return stats


class BufferCollector:
    """Prometheus collector reading the buffers on each scrape (no state of its own). Sizes are gauges,
    monotonic counts counters (`_total`); `replayd_buffer_counter` carries every raw buffer counter."""

    def __init__(self, registry: BufferRegistry, rejected: dict[str, int]) -> None:
        self.registry = registry
        self.rejected = rejected

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, text: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"replayd_{name}", text, labels=["buffer", *labels])

        def counter(name: str, text: str, *labels: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"replayd_{name}", text, labels=["buffer", *labels])

        stored = gauge("buffer_stored_steps", "Steps stored")
        capacity = gauge("buffer_capacity_steps", "Capacity in steps")
        sampleable = gauge("buffer_sampleable_steps", "Steps a sample may draw (episodic buffers)")
        episodes = gauge("buffer_episodes", "Complete episodes stored; open ones are not counted (episodic buffers)")
        inserted = counter("buffer_inserted_steps", "Steps inserted (rows; pushed steps for rollout buffers)")
        inserted_episodes = counter("buffer_inserted_episodes", "Episodes completed by inserts (episodic buffers)")
        sampled = counter("buffer_sampled_items", "Items sampled (batch rows; minibatch rows for rollout buffers)")
        sampled_batches = counter("buffer_sampled_batches", "Batches sampled (episodic buffers)")
        waits = counter("rate_limiter_waits", "Calls the rate limiter held back, once their wait ended", "side")
        wait_seconds = counter("rate_limiter_wait_seconds", "Seconds calls spent held back by the rate limiter",
                               "side")
        waiting = gauge("rate_limiter_waiting", "Calls the rate limiter holds back right now", "side")
        raw = gauge("buffer_counter", "Buffer counters (inserts, samples, evictions, ...)", "counter")
        frame_bytes = gauge("buffer_frames_stored_bytes", "Bytes of a compressed field's stored frames", "field")
        frame_ratio = gauge("buffer_frames_compression_ratio",
                            "Raw over stored bytes of a compressed field's stored frames (0: none stored)", "field")
        for stat in buffer_stats(self.registry):
            name, counts = stat["name"], stat["counters"]
            stored.add_metric([name], stat["stored_steps"])
            capacity.add_metric([name], stat["capacity_steps"])
            inserted.add_metric([name], stat["inserted_steps"])
            for counter_name, value in counts.items():
                raw.add_metric([name, counter_name], value)
            sampled.add_metric([name], stat["sampled_items"])
            for field, figures in stat["frames"].items():
                frame_bytes.add_metric([name, field], figures["stored_bytes"])
                frame_ratio.add_metric([name, field], figures["compression_ratio"])
            if stat["kind"] == "rollout":
                continue
            sampleable.add_metric([name], stat["sampleable_steps"])
            episodes.add_metric([name], stat["episodes"])
            inserted_episodes.add_metric([name], counts.get("inserted_episodes", 0))
            sampled_batches.add_metric([name], counts.get("sampled_batches", 0))
            for side in ("insert", "sample"):
                waits.add_metric([name, side], counts.get(f"rate_limiter.{side}_waits", 0))
                wait_seconds.add_metric([name, side], counts.get(f"rate_limiter.{side}_wait_seconds", 0))
                waiting.add_metric([name, side], counts.get(f"rate_limiter.{side}_waiting", 0))
        rejected = CounterMetricFamily("replayd_rejected_calls", "Calls rejected with a client error", labels=["rpc"])
        for rpc, count in dict(self.rejected).items():
            rejected.add_metric([rpc], count)
        yield from (stored, capacity, sampleable, episodes, inserted, inserted_episodes, sampled, sampled_batches,
                    waits, wait_seconds, waiting, raw, frame_bytes, frame_ratio, rejected)


def loopback_hosts(host: str) -> list[str] | None:
    """The Host headers a server bound to loopback `host` answers (None: any, for a server bound elsewhere).
    A web page's script may not read another origin's responses, but through DNS rebinding its own name
    comes to point at 127.0.0.1; the Host header still carries that name, so refusing it keeps a page
    from reading /metrics and /api/buffers of a loopback server without a token."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return None
    if not loopback:
        return None
    literal = f"[{host}]" if ":" in host else host  # the Host header brackets IPv6 literals
    return sorted({"localhost", "127.0.0.1", "[::1]", literal})


def create_app(registry: BufferRegistry, rejected: dict[str, int], metrics: CollectorRegistry,
               token: str | None = None, allowed_hosts: list[str] | None = None,
               serving: Callable[[], bool] = lambda: True) -> FastAPI:
    """With `token`, every route that reveals server state needs `Authorization: Bearer <token>`. Open:
    /healthz (container health checks carry no credentials) and the status page's static HTML, whose
    script reads the token from the URL fragment (`/#token=...`, never sent to the server) for its calls.
    With `allowed_hosts` (loopback_hosts), a request whose Host header names another host gets 400.
    `serving()`: whether the gRPC side takes calls; /readyz answers 503 while it does not (stopping)."""
    app = FastAPI(title="replayd", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)
    metrics.register(BufferCollector(registry, rejected))

    def authorized(request: Request) -> None:
        if token and not token_matches(request.headers.get("authorization"), token):
            raise HTTPException(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})

    guarded = [Depends(authorized)]

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", dependencies=guarded)
    def readyz() -> JSONResponse:
        if not serving():
            return JSONResponse({"status": "not serving"}, status_code=503)
        return JSONResponse({"status": "ready", "buffers": len(registry.all())})

    @app.get("/metrics", dependencies=guarded)
    def prometheus() -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/buffers", dependencies=guarded)
    def buffers() -> JSONResponse:
        return JSONResponse({"instance": registry.instance, "buffers": buffer_stats(registry)})

    @app.get("/", response_class=HTMLResponse)
    def status_page() -> str:
        return STATUS_PAGE

    return app


class HttpServer:
    """uvicorn in a background thread, stopped with the gRPC server. With `tls_cert` and `tls_key` (PEM, those
    of the gRPC port) it speaks HTTPS only: the token a client sends must not cross the network in the clear
    on this port either."""

    def __init__(self, app: FastAPI, host: str, port: int, tls_cert: bytes | None = None,
                 tls_key: bytes | None = None) -> None:
        self.host, self.requested_port = host, port
        if tls_cert is None:
            config = uvicorn.Config(app, host=host, port=port, log_level="warning")
        else:
            # ssl loads a certificate and key only from files: private ones (mkdtemp makes the folder 0700),
            # removed once the TLS context is made.
            with tempfile.TemporaryDirectory(prefix="replayd-tls-") as pem_dir:
                cert_path, key_path = Path(pem_dir, "cert.pem"), Path(pem_dir, "key.pem")
                cert_path.write_bytes(tls_cert)
                key_path.write_bytes(tls_key)
                config = uvicorn.Config(app, host=host, port=port, log_level="warning", ssl_certfile=str(cert_path),
                                        ssl_keyfile=str(key_path))
                config.load()
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="replayd-http", daemon=True)

    def _run(self) -> None:
        try:
            self._server.run()
        except SystemExit:  # uvicorn exits when it cannot bind (it logged why); start() reports it
            pass

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._server.started

    @property
    def running(self) -> bool:
        """False once the thread ended (uvicorn logs why, e.g. a port in use, and returns)."""
        return self._thread.is_alive()

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
