"""The HTTP side of a replay server: health, Prometheus metrics, buffer stats and a status page."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from service.buffers.episodic import EpisodicBuffer
from service.registry import BufferRegistry

STATUS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>replayd</title>
<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}
td,th{padding:4px 10px;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}.bar{background:#eee;width:160px;height:12px}.fill{background:#4a8;height:12px}</style>
</head><body><h1>replayd <span id="instance"></span></h1>
<table><thead><tr><th>buffer</th><th>kind</th><th>fill</th><th>stored steps</th><th>episodes</th>
<th>inserts/s</th><th>samples/s</th></tr></thead><tbody id="rows"></tbody></table>
<p id="updated"></p>
<script>
let last = {};
async function refresh() {
  const response = await fetch("api/buffers");
  const data = await response.json();
  document.getElementById("instance").textContent = data.instance;
  const now = Date.now() / 1000;
  const rows = data.buffers.map(b => {
    const prev = last[b.name];
    const dt = prev ? now - prev.t : 0;
    const ins = prev && dt > 0 ? ((b.inserted_steps - prev.ins) / dt).toFixed(0) : "-";
    const smp = prev && dt > 0 ? ((b.sampled_items - prev.smp) / dt).toFixed(0) : "-";
    last[b.name] = {t: now, ins: b.inserted_steps, smp: b.sampled_items};
    const fill = (100 * b.fill).toFixed(1);
    return `<tr data-buffer="${b.name}"><td>${b.name}</td><td>${b.kind}</td>` +
      `<td><div class="bar"><div class="fill" style="width:${fill}%"></div></div>${fill}%</td>` +
      `<td>${b.stored_steps}</td><td>${b.episodes}</td><td>${ins}</td><td>${smp}</td></tr>`;
  });
  document.getElementById("rows").innerHTML = rows.join("");
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}
refresh(); setInterval(refresh, 1000);
</script></body></html>"""


def buffer_stats(registry: BufferRegistry) -> list[dict]:
    stats = []
    for name, buffer in registry.all():
        if isinstance(buffer, EpisodicBuffer):
            capacity, stored = buffer.capacity, buffer.stored_steps
            counters, episodes = buffer.counters, buffer.episodes
        else:
            info = buffer.info()
            capacity = info["num_steps"] * info["num_envs"]
            stored, counters, episodes = capacity - info["missing_steps"], info["counters"], 0
        stats.append({
            "name": name,
            "kind": buffer.kind if isinstance(buffer, EpisodicBuffer) else "rollout",
            "capacity_steps": capacity,
            "stored_steps": stored,
            "fill": stored / capacity,
            "episodes": episodes,
            "inserted_steps": int(counters.get("inserted_rows", counters.get("pushed_steps", 0))),
            "sampled_items": int(counters.get("sampled_items", 0)),
            "counters": {k: float(v) for k, v in counters.items()},
        })
    return stats


class BufferCollector:
    """Prometheus collector reading the buffers on each scrape (no state of its own)."""

    def __init__(self, registry: BufferRegistry, rejected: dict[str, int]) -> None:
        self.registry = registry
        self.rejected = rejected

    def collect(self) -> Iterator[Metric]:
        stored = GaugeMetricFamily("replayd_buffer_stored_steps", "Steps stored", labels=["buffer"])
        capacity = GaugeMetricFamily("replayd_buffer_capacity_steps", "Capacity in steps", labels=["buffer"])
        counters = GaugeMetricFamily("replayd_buffer_counter", "Buffer counters (inserts, samples, evictions, ...)",
                                     labels=["buffer", "counter"])
        for stat in buffer_stats(self.registry):
            stored.add_metric([stat["name"]], stat["stored_steps"])
            capacity.add_metric([stat["name"]], stat["capacity_steps"])
            for counter, value in stat["counters"].items():
                counters.add_metric([stat["name"], counter], value)
        rejected = GaugeMetricFamily("replayd_rejected_calls", "Calls rejected with a client error", labels=["rpc"])
        for rpc, count in dict(self.rejected).items():
            rejected.add_metric([rpc], count)
        yield from (stored, capacity, counters, rejected)


def create_app(registry: BufferRegistry, rejected: dict[str, int], metrics: CollectorRegistry) -> FastAPI:
    app = FastAPI(title="replayd", docs_url=None, redoc_url=None)
    metrics.register(BufferCollector(registry, rejected))

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> dict:
        return {"status": "ready", "buffers": len(registry.all())}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/buffers")
    def buffers() -> JSONResponse:
        return JSONResponse({"instance": registry.instance, "buffers": buffer_stats(registry)})

    @app.get("/", response_class=HTMLResponse)
    def status_page() -> str:
        return STATUS_PAGE

    return app


class HttpServer:
    """uvicorn in a background thread, stopped with the gRPC server."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="replayd-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._server.started

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
