"""The HTTP side of a replay server: health, Prometheus metrics, buffer stats and a status page with charts."""

from __future__ import annotations

import ipaddress
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.middleware.trustedhost import TrustedHostMiddleware

from replayd.server.http.history import History
from replayd.server.http.stats import buffer_detail, buffer_stats
from replayd.server.registry import BufferRegistry
from replayd.server.tokens import token_matches
from replayd.wire.errors import NotFound

STATIC = Path(__file__).parent / "static"  # the status page, its script and style, and uPlot (vendor/)


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
        stored_bytes = gauge("buffer_stored_bytes", "Bytes of the steps stored (rows x row bytes; rollout cells x cell "
                             "bytes)")
        policy_version = gauge("rollout_policy_version", "The policy version a rollout buffer collects for")
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
            stored_bytes.add_metric([name], stat["stored_bytes"])
            capacity.add_metric([name], stat["capacity_steps"])
            inserted.add_metric([name], stat["inserted_steps"])
            for counter_name, value in counts.items():
                raw.add_metric([name, counter_name], value)
            sampled.add_metric([name], stat["sampled_items"])
            for field, figures in stat["frames"].items():
                frame_bytes.add_metric([name, field], figures["stored_bytes"])
                frame_ratio.add_metric([name, field], figures["compression_ratio"])
            if stat["kind"] == "rollout":
                policy_version.add_metric([name], stat["policy_version"])
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
        yield from (stored, stored_bytes, policy_version, capacity, sampleable, episodes, inserted, inserted_episodes,
                    sampled, sampled_batches, waits, wait_seconds, waiting, raw, frame_bytes, frame_ratio, rejected)


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
               serving: Callable[[], bool] = lambda: True, histograms: Iterable[Collector] = ()) -> FastAPI:
    """With `token`, every route that reveals server state needs `Authorization: Bearer <token>`. Open:
    /healthz (container health checks carry no credentials) and the status page's static files (its HTML, script,
    style and charting library), whose script reads the token from the URL fragment (`/#token=...`, never sent to
    the server) for its calls, or asks for it. With `allowed_hosts` (loopback_hosts), a request whose Host header
    names another host gets 400. `serving()`: whether the gRPC side takes calls; /readyz answers 503 while it does
    not (stopping). `histograms`: the per-RPC latency histograms the charts' quantiles come from; the charts'
    history is sampled while the app runs (its lifespan)."""
    history = History(registry, histograms)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        history.start()
        try:
            yield
        finally:
            history.stop()

    app = FastAPI(title="replayd", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
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

    @app.get("/api/buffers/{name}", dependencies=guarded)
    def buffer(name: str) -> JSONResponse:
        try:
            return JSONResponse(buffer_detail(name, registry.get(name)))
        except NotFound as exc:
            raise HTTPException(404, str(exc)) from None

    @app.get("/api/history", dependencies=guarded)
    def charts() -> JSONResponse:
        return JSONResponse(history.snapshot())

    @app.get("/")
    def status_page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
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
