"""A replayd gRPC server: one registry of buffers behind one port."""

from __future__ import annotations

import logging
import secrets
import time
from concurrent import futures

import grpc
from prometheus_client import CollectorRegistry

from service.grpc_server.servicer import ReplayServicer
from service.registry import BufferRegistry
from service.wire import replay_pb2_grpc as pb_grpc

log = logging.getLogger("replayd")

DEFAULT_MAX_MESSAGE_BYTES = 512 * 2**20


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC's default 4 MB message limit is far below an Atari batch; both sides raise it alike."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class ReplayServer:
    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        instance: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_workers: int = 32,
        http_address: str | None = None,
    ) -> None:
        self.instance = instance or secrets.token_hex(4)
        self.registry = BufferRegistry(self.instance)
        self.servicer = ReplayServicer(self.registry, max_message_bytes)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="replayd"),
            options=channel_options(max_message_bytes),
        )
        pb_grpc.add_ReplayServicer_to_server(self.servicer, self._server)
        host = address.rsplit(":", 1)[0]
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        self.address = f"{host}:{self.port}"
        self.metrics = CollectorRegistry()
        self.http = None
        if http_address is not None:
            from service.http.app import HttpServer, create_app

            http_host, http_port = http_address.rsplit(":", 1)
            self.http = HttpServer(create_app(self.registry, self.servicer.rejected, self.metrics), http_host,
                                   int(http_port))

    def start(self, timeout: float = 30.0) -> ReplayServer:
        self._server.start()
        log.info("replayd instance %s serving on %s", self.instance, self.address)
        if self.http is not None:
            self.http.start()
            deadline = time.monotonic() + timeout
            while not self.http.started:
                if time.monotonic() > deadline:
                    raise TimeoutError("the HTTP side did not start")
                time.sleep(0.01)
            log.info("HTTP side (health, metrics, status page) on port %d", self.http.port)
        return self

    def wait(self) -> None:
        self._server.wait_for_termination()

    def stop(self, grace: float = 1.0) -> None:
        """Stops serving, then unlinks every buffer's shared memory."""
        self._server.stop(grace).wait()
        if self.http is not None:
            self.http.stop()
        self.registry.close()

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
