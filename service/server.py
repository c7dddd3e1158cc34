"""A replayd gRPC server: one registry of buffers behind one port."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent import futures

import grpc
from prometheus_client import CollectorRegistry

from replayd.server.checkpoint import check_writable, has_checkpoint, restore_checkpoint, write_checkpoint
from replayd.server.grpc_server.auth import TokenAuthInterceptor
from replayd.server.grpc_server.sample_workers import SampleWorkers
from replayd.server.grpc_server.servicer import ReplayServicer, lenient
from replayd.server.recovery import recover_instance
from replayd.server.registry import BufferRegistry
from replayd.server.schema import check_instance_name
from replayd.server.storage.instance_lock import InstanceLock
from replayd.server.worker_seats import WorkerSeats
from replayd.wire import replay_pb2 as pb
from replayd.wire.channel import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from replayd.wire.frames import InsertFrame

log = logging.getLogger("replayd")



def _method_handlers(servicer: ReplayServicer) -> grpc.GenericRpcHandler:
    """The Replay service's handlers. Inserts and batches skip protobuf's copies of their Arrow payload
    (proto/frames.py): Insert gets InsertFrames, and the sampling RPCs return serialized
    SampleResponse messages, framed by hand as they are encoded (so their serializer is the identity)."""
    unary = grpc.unary_unary_rpc_method_handler

    def plain(method, request: type, response: type, kind=unary) -> grpc.RpcMethodHandler:
        return kind(method, request_deserializer=lenient(request.FromString),
                    response_serializer=response.SerializeToString)

    handlers = {
        "CreateBuffer": plain(servicer.CreateBuffer, pb.CreateBufferRequest, pb.BufferInfo),
        "DeleteBuffer": plain(servicer.DeleteBuffer, pb.DeleteBufferRequest, pb.DeleteBufferResponse),
        "ListBuffers": plain(servicer.ListBuffers, pb.ListBuffersRequest, pb.ListBuffersResponse),
        "DescribeBuffer": plain(servicer.DescribeBuffer, pb.DescribeBufferRequest, pb.BufferInfo),
        "Insert": grpc.stream_unary_rpc_method_handler(
            servicer.Insert, request_deserializer=lenient(InsertFrame.parse),
            response_serializer=pb.InsertResponse.SerializeToString),
        "Sample": unary(servicer.Sample, request_deserializer=lenient(pb.SampleRequest.FromString)),
        "SampleStream": grpc.unary_stream_rpc_method_handler(
            servicer.SampleStream, request_deserializer=lenient(pb.SampleStreamRequest.FromString)),
        "UpdatePriorities": plain(servicer.UpdatePriorities, pb.UpdatePrioritiesRequest, pb.UpdatePrioritiesResponse),
        "PushRollout": plain(servicer.PushRollout, pb.PushRolloutRequest, pb.PushRolloutResponse),
        "RolloutMinibatches": grpc.unary_stream_rpc_method_handler(
            servicer.RolloutMinibatches, request_deserializer=lenient(pb.RolloutMinibatchesRequest.FromString)),
        "FinishRollout": plain(servicer.FinishRollout, pb.FinishRolloutRequest, pb.BufferInfo),
        "PublishWeights": plain(servicer.PublishWeights, pb.PublishWeightsRequest, pb.PublishWeightsResponse),
        "FetchWeights": plain(servicer.FetchWeights, pb.FetchWeightsRequest, pb.FetchWeightsResponse),
        "Checkpoint": plain(servicer.Checkpoint, pb.CheckpointRequest, pb.CheckpointResponse),
    }
    return grpc.method_handlers_generic_handler("replayd.v1.Replay", handlers)


class ReplayServer:
    """`token`: every gRPC call and HTTP request (but /healthz) must carry `authorization: Bearer <token>`.
    `tls_cert`/`tls_key`: PEM certificate chain and private key; the gRPC and HTTP ports then speak TLS only.
    `max_buffer_bytes`: shared memory one buffer may take (None: whatever /dev/shm has free).
    `checkpoint_dir`: where the Checkpoint RPC writes by default, and with `checkpoint_every` (seconds) where a
    background thread writes a checkpoint periodically (keeping the newest `checkpoint_keep`).
    `restore_from`: a checkpoint (or a directory of them: its LATEST) restored by start() before serving."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        instance: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_workers: int = 64,
        http_address: str | None = None,
        token: str | None = None,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        max_buffer_bytes: int | None = None,
        sample_workers: int = 0,
        checkpoint_dir: str | None = None,
        checkpoint_every: float | None = None,
        checkpoint_keep: int | None = 3,
        restore_from: str | None = None,
        recover: bool = False,
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key: expected both or neither")
        if sample_workers and tls_cert is not None:
            raise ValueError("sample workers serve plain gRPC; run them without TLS (or put TLS in a proxy)")
        # Written so that NaN fails it (it checkpointed back to back); the checkpoint thread's wait takes at most
        # TIMEOUT_MAX seconds (inf ended the thread with an OverflowError).
        if checkpoint_every is not None and (checkpoint_dir is None
                                             or not 0 < checkpoint_every <= threading.TIMEOUT_MAX):
            raise ValueError(f"checkpoint_every: expected seconds > 0 (at most {threading.TIMEOUT_MAX:.0f}) and a "
                             f"checkpoint_dir, got {checkpoint_every!r} and checkpoint_dir={checkpoint_dir!r}")
        if checkpoint_dir is not None:
            check_writable(checkpoint_dir)
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.checkpoint_keep = checkpoint_keep
        self.restore_from = restore_from
        self.recover = recover
        self._recovered: list[str] = []  # buffers reattached by recover_instance
        self.max_buffer_bytes = max_buffer_bytes
        self._stop_checkpoints = threading.Event()
        self._serving = threading.Event()  # the gRPC side takes calls (/readyz)
        self._checkpoint_thread: threading.Thread | None = None
        self.instance = check_instance_name(instance or secrets.token_hex(4))
        self._instance_lock = InstanceLock(self.instance)  # segments named after it are this server's
        try:
            # Open streams and calls blocked on a rate limiter or waiting for data each have a share of the
            # workers; the rest stay free for the short calls (samples that release waiting inserts).
            self.registry = BufferRegistry(self.instance, WorkerSeats.for_workers(max_workers))
            self.metrics = CollectorRegistry()  # this server's Prometheus metrics, served by the HTTP side
            self.servicer = ReplayServicer(self.registry, max_message_bytes, max_buffer_bytes, checkpoint_dir,
                                           metrics=self.metrics)
            self._workers = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="replayd")
            self._server = grpc.server(
                self._workers,
                # gRPC sets SO_REUSEPORT on Linux: a second server would share a port in use, and its calls.
                options=[*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)],
                interceptors=[TokenAuthInterceptor(token)] if token else None,
            )
            self._server.add_generic_rpc_handlers((_method_handlers(self.servicer),))
            host = address.rsplit(":", 1)[0]
            try:
                if tls_cert is not None:
                    credentials = grpc.ssl_server_credentials([(tls_key, tls_cert)])
                    self.port = self._server.add_secure_port(address, credentials)
                else:
                    self.port = self._server.add_insecure_port(address)
            except RuntimeError as exc:
                raise OSError(f"could not serve gRPC on {address} (port in use, or a bad TLS certificate or key?): "
                              f"{exc}") from None
            self.address = f"{host}:{self.port}"
            self.sample_workers = SampleWorkers(sample_workers, self.instance, host, max_message_bytes, token)
            self.servicer.sample_endpoints = self.sample_workers.endpoints
            self.http = None
            if http_address is not None:
                from replayd.server.http.app import HttpServer, create_app, loopback_hosts

                http_host, http_port = http_address.rsplit(":", 1)
                http_host = http_host.strip("[]")  # uvicorn takes an IPv6 host without the brackets gRPC needs
                rpc = self.servicer.rpc_metrics
                app = create_app(self.registry, self.servicer.rejected, self.metrics, token,
                                 allowed_hosts=loopback_hosts(http_host), serving=self._serving.is_set,
                                 histograms=(rpc.latency, rpc.message_latency))
                self.http = HttpServer(app, http_host, int(http_port), tls_cert, tls_key)
        except BaseException:
            self._instance_lock.release()
            raise

    def start(self, timeout: float = 30.0) -> ReplayServer:
        """Restores or recovers buffers, then serves. A failure on the way stops everything started and
        unlinks every buffer restored so far before it is raised; recovered buffers stay in shared memory
        (their only copy) for the next --recover."""
        try:
            self._start(timeout)
        except BaseException:
            for name in self._recovered:
                self.registry.detach(name)
            self.stop(grace=0)
            raise
        return self

    def _start(self, timeout: float) -> None:
        # Before serving: no client sees a partly restored registry.
        if self.recover:
            recovery = recover_instance(self.registry)
            self._recovered = recovery.recovered
            source = self.restore_from
            if source is None and self.checkpoint_dir is not None and has_checkpoint(self.checkpoint_dir):
                source = self.checkpoint_dir
            if not recovery.recovered and not recovery.lost:
                # No segment of this instance at all: /dev/shm was emptied (a reboot, a new container), so the
                # whole checkpoint comes back. (With some segments there, a buffer without any was deleted.)
                if source is not None:
                    restore_checkpoint(source, self.registry, max_bytes=self.max_buffer_bytes)
                else:
                    log.warning("--recover: no shared-memory segment of instance %s and no checkpoint to restore",
                                self.instance)
            elif recovery.lost and source is not None:
                # Buffers whose segments failed the checks come back from the latest checkpoint.
                restore_checkpoint(source, self.registry, max_bytes=self.max_buffer_bytes, only=set(recovery.lost))
            elif recovery.lost:  # killed before its first periodic checkpoint: serve what was recovered
                log.warning("buffers %s could not be recovered and no checkpoint holds them: they are lost",
                            sorted(recovery.lost))
        elif self.restore_from is not None:  # all or nothing (restore_checkpoint)
            restore_checkpoint(self.restore_from, self.registry, max_bytes=self.max_buffer_bytes)
        self._server.start()
        self._serving.set()
        log.info("replayd instance %s serving on %s", self.instance, self.address)
        self.sample_workers.start()
        if self.sample_workers.count:
            log.info("sample workers on %s", ", ".join(self.sample_workers.endpoints))
        if self.http is not None:
            self.http.start()
            deadline = time.monotonic() + timeout
            while not self.http.started:
                if not self.http.running:
                    raise OSError(f"the HTTP side could not serve on {self.http.host}:{self.http.requested_port} "
                                  "(port in use? see the log above)")
                if time.monotonic() > deadline:
                    raise TimeoutError("the HTTP side did not start")
                time.sleep(0.01)
            log.info("HTTP side (health, metrics, status page) on port %d", self.http.port)
        if self.checkpoint_every is not None:
            self._checkpoint_thread = threading.Thread(target=self._checkpoint_loop, name="replayd-checkpoints",
                                                       daemon=True)
            self._checkpoint_thread.start()

    def _checkpoint_loop(self) -> None:
        while not self._stop_checkpoints.wait(self.checkpoint_every):
            try:
                write_checkpoint(self.registry, self.checkpoint_dir, keep=self.checkpoint_keep)
            except Exception:
                log.exception("periodic checkpoint under %s failed", self.checkpoint_dir)

    def wait(self) -> None:
        self._server.wait_for_termination()

    def stop(self, grace: float = 1.0) -> None:
        """Stops serving, then unlinks every buffer's shared memory."""
        self._serving.clear()  # gRPC takes no new call from here on: /readyz says so until HTTP stops
        self._server.stop(grace).wait()
        self._workers.shutdown(wait=False)  # gRPC leaves its executor's idle threads running otherwise
        self._stop_checkpoints.set()
        if self._checkpoint_thread is not None:
            self._checkpoint_thread.join()  # a checkpoint in progress finishes before the buffers go
        self.sample_workers.stop()
        if self.http is not None:
            self.http.stop()
        self.registry.close()
        self._instance_lock.release()

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
