"""Sample workers: extra processes that serve Sample and SampleStream from the server's shared memory.

One Python process samples on one core at a time (the GIL); K workers attach to the same segments and
sample on K more, while inserts stay with the single writer. Each worker is a small gRPC server on its
own port exposing only the sampling RPCs; clients learn the ports from the buffer's description. A
worker that dies is started again on the same port by the server's monitor thread.

Buffers sampled with side effects (a remover counting draws, a rate limiter) are not offered to workers.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np

from replayd.server.buffers.reader import RingReader
from replayd.server.buffers.ring import shm_name
from replayd.server.buffers.stacking import Shipped
from replayd.server.grpc_server.auth import TokenAuthInterceptor
from replayd.server.grpc_server.in_place import InPlaceMessages
from replayd.server.grpc_server.servicer import (
    SAMPLE_AHEAD,
    lenient,
    rpc,
    sample_message,
    sample_mode,
    ships_frames,
    stream_rpc,
    wait_seconds,
)
from replayd.server.modes.base import BatchMode
from replayd.server.schema import check_buffer_name
from replayd.server.worker_seats import WorkerSeats
from replayd.wire import errors
from replayd.wire import replay_pb2 as pb
from replayd.wire.channel import channel_options

log = logging.getLogger("replayd.sample_worker")

WORKER_THREADS = 16  # gRPC threads of one sample-worker process
_WAIT_POLL_SECONDS = (0.001, 0.1)  # a worker cannot wait on the writer's condition: it polls, backing off
_PARENT_POLL_SECONDS = 0.5  # how often a worker checks that its server lives and drops deleted buffers


class SampleWorkerServicer:
    """Sample/SampleStream over rings attached by name (re-attached when a buffer is recreated)."""

    def __init__(self, instance: str, max_message_bytes: int) -> None:
        self.instance = instance
        self.max_message_bytes = max_message_bytes
        # Open streams and waiting samples may hold 3/4 of the worker threads (see WorkerSeats).
        self.worker_seats = WorkerSeats.for_workers(WORKER_THREADS)
        self.rejected: dict[str, int] = {}
        self._rings: dict[str, tuple[int, RingReader]] = {}
        self._retired: list[weakref.ref[RingReader]] = []  # dropped rings that calls may still hold
        self._lock = threading.Lock()

    def counters_rejected(self, method: str, exc: Exception) -> None:
        self.rejected[method] = self.rejected.get(method, 0) + 1

    def ring(self, buffer: str) -> RingReader:
        # Checked as the server checks it: "b.data" would open a buffer's data segment as its header.
        header = shm_name(self.instance, check_buffer_name(buffer))
        try:
            inode = os.stat(f"/dev/shm/{header}").st_ino
        except (FileNotFoundError, ValueError):
            self.forget_deleted()
            raise errors.NotFound(f"buffer {buffer!r} does not exist") from None
        with self._lock:
            cached = self._rings.get(buffer)
            if cached is not None and cached[0] == inode:
                return cached[1]
            # A buffer deleted (and maybe created again): calls still holding the old ring stop at their next
            # batch (current); it is unmapped once none holds it (closing it here would unmap it under them).
            if cached is not None:
                self._retired.append(weakref.ref(cached[1]))
                del self._rings[buffer]
            try:
                ring = RingReader.attach(header)
            except FileNotFoundError:  # deleted between the stat above and the attach
                raise errors.NotFound(f"buffer {buffer!r} does not exist") from None
            except errors.InvalidArgument:  # not an episodic buffer
                raise
            except ValueError as exc:  # being created: its header segment is there, its JSON not written yet
                raise errors.NotFound(f"buffer {buffer!r} does not exist (yet): {exc}") from None
            except errors.FailedPrecondition as exc:
                # Created again as a buffer only its server samples (a remover, a rate limiter): a client that
                # an older description routed here asks the server where to sample on UNAVAILABLE, at once.
                raise errors.Unavailable(f"{exc}; sample it through the server", retry_after_ms=0) from None
            self._rings[buffer] = (inode, ring)
            return ring

    def forget_deleted(self) -> None:
        """Drops the rings of buffers deleted (or created again) since they were attached: each is unmapped
        once the calls still holding it are done. Run now and then: a deleted buffer that nobody asks for
        again would otherwise stay mapped (its memory and file descriptors held) for the worker's life."""
        with self._lock:
            cached = list(self._rings.items())
        for buffer, (inode, ring) in cached:
            try:
                now = os.stat(f"/dev/shm/{shm_name(self.instance, buffer)}").st_ino
            except FileNotFoundError:
                now = None
            if now != inode:
                with self._lock:
                    if self._rings.get(buffer, (None, None))[1] is ring:
                        del self._rings[buffer]
                        self._retired.append(weakref.ref(ring))
        # A call that ended (a cancelled stream's generator, say) can leave its ring in a reference cycle,
        # which an idle worker's garbage collector may not reach for a long time: collect while any lives.
        with self._lock:
            self._retired = [ref for ref in self._retired if ref() is not None]
            collect = bool(self._retired)
        if collect:
            gc.collect()

    def current(self, buffer: str, ring: RingReader) -> None:
        """NotFound once `buffer` was deleted (or deleted and created again) since `ring` was attached."""
        if self.ring(buffer) is not ring:
            raise errors.NotFound(f"buffer {buffer!r} was deleted or created again while this call sampled it")

    def _message(self, ring: RingReader, request: pb.SampleRequest, rng: np.random.Generator,
                 deadline: float | None, context: grpc.ServicerContext, stream: InPlaceMessages | None = None) -> bytes:
        """A sampled batch's message; a stream's (`stream`) may be gathered straight into it."""
        self.current(request.buffer, ring)
        mode = sample_mode(request, ring, self.max_message_bytes)
        if deadline is not None and not ring.drawable():
            with self.worker_seats.wait_seat(f"sample of buffer {ring.name!r} (waiting for data)"):
                delay = _WAIT_POLL_SECONDS[0]
                while not ring.drawable():
                    self.current(request.buffer, ring)
                    if not context.is_active():  # cancelled: give the worker (and its seat) back now
                        raise errors.Cancelled(f"sample of buffer {ring.name!r}: the call ended while it waited")
                    if time.monotonic() >= deadline:
                        raise errors.DeadlineExceeded(
                            f"buffer {ring.name!r} got no step to draw before the deadline "
                            f"(sampleable_steps={ring.ring.sampleable_steps})")
                    time.sleep(delay)
                    delay = min(delay * 2, _WAIT_POLL_SECONDS[1])
        def sample(mode: BatchMode, shipped: list[Shipped] | None = None) -> dict[str, np.ndarray]:
            return ring.sample_shared(request.batch_size, mode, rng, request.include_keys, request.importance_beta,
                                      shipped)[0]

        if ships_frames(request):  # small batches of indices, and frames of varying size: never in place
            shipped: list[Shipped] = []
            return sample_message(sample(mode, shipped), self.max_message_bytes, shipped)
        return sample_message(sample(mode), self.max_message_bytes) if stream is None else stream.next(sample)

    @staticmethod
    def _deadline(request: pb.SampleRequest, context: grpc.ServicerContext) -> float | None:
        seconds = wait_seconds(request, context)
        return None if seconds is None else time.monotonic() + seconds

    @staticmethod
    def _rng(request: pb.SampleRequest) -> np.random.Generator:
        return np.random.default_rng(request.seed if request.HasField("seed") else None)

    @rpc
    def Sample(self, request: pb.SampleRequest, context: grpc.ServicerContext) -> bytes:
        return self._message(self.ring(request.buffer), request, self._rng(request), self._deadline(request, context),
                             context)

    @stream_rpc(ahead=lambda servicer, request: SAMPLE_AHEAD)  # workers serve side-effect-free buffers only
    def SampleStream(self, request: pb.SampleStreamRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        if request.num_batches < 0:
            raise errors.InvalidArgument(f"sample_stream: num_batches expected >= 0, got {request.num_batches}")
        inner = request.request
        ring, rng = self.ring(inner.buffer), self._rng(inner)
        stream = InPlaceMessages(sample_mode(inner, ring, self.max_message_bytes),
                                 lambda batch: sample_message(batch, self.max_message_bytes))
        sent = 0
        while request.num_batches == 0 or sent < request.num_batches:  # see ReplayServicer.SampleStream
            yield self._message(ring, inner, rng, self._deadline(inner, context), context, stream)
            sent += 1


def serve_worker(instance: str, address: str, max_message_bytes: int, token: str | None,
                 ports: mp.Queue | None, server_pid: int) -> None:
    """A worker process's main: serve until terminated or until `server_pid` (its parent) is gone; report the
    bound port on `ports`."""
    # Ctrl-C reaches the whole process group: the server stops its workers (SIGTERM) once its calls are done.
    # A worker ended by the SIGINT printed a KeyboardInterrupt traceback, and the monitor started it again.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    servicer = SampleWorkerServicer(instance, max_message_bytes)
    handlers = {
        # Both return serialized SampleResponse messages (servicer.sample_message).
        "Sample": grpc.unary_unary_rpc_method_handler(
            servicer.Sample, request_deserializer=lenient(pb.SampleRequest.FromString)),
        "SampleStream": grpc.unary_stream_rpc_method_handler(
            servicer.SampleStream, request_deserializer=lenient(pb.SampleStreamRequest.FromString)),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKER_THREADS, thread_name_prefix="replayd-sampler"),
                         options=[*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)],
                         interceptors=[TokenAuthInterceptor(token)] if token else None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("replayd.v1.Replay", handlers),))
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # the port is taken: the server reports it (SampleWorkers._spawn)
        log.error("sample worker: could not serve on %s: %s", address, exc)
        raise SystemExit(1) from None
    server.start()
    if ports is not None:
        ports.put(port)
    # A server killed with SIGKILL cannot stop its workers: each notices it was orphaned and exits, so
    # none keeps serving (and holding shared memory) beside the restarted server.
    while server.wait_for_termination(timeout=_PARENT_POLL_SECONDS):  # True: timed out, still serving
        servicer.forget_deleted()
        if os.getppid() != server_pid:
            log.warning("sample worker on port %d: the server process is gone; exiting", port)
            server.stop(grace=0).wait()
            return


class SampleWorkers:
    """Starts K worker processes, restarts any that dies (on its port), stops them with the server."""

    def __init__(self, count: int, instance: str, host: str, max_message_bytes: int, token: str | None) -> None:
        if count < 0:
            raise ValueError(f"sample workers: expected >= 0, got {count}")
        self.count, self.instance, self.host = count, instance, host
        self.max_message_bytes, self.token = max_message_bytes, token
        self._context = mp.get_context("spawn")
        self._processes: list[mp.process.BaseProcess] = []
        self.ports: list[int] = []
        self.endpoints: list[str] = []  # shared with the servicer, filled in by start()
        self.restarts = 0
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="replayd-sample-workers", daemon=True)

    def _spawn(self, port: int, timeout: float = 60.0) -> tuple[mp.process.BaseProcess, int]:
        """A worker serving on `port` (0: a free one) and the port it bound. OSError when it exits before it
        serves (its port taken, say: it logged why), TimeoutError (and it is killed) when it never reports."""
        ports = self._context.Queue()
        address = f"{self.host}:{port}"
        process = self._context.Process(
            target=serve_worker,
            args=(self.instance, address, self.max_message_bytes, self.token, ports, os.getpid()),
            daemon=True, name="replayd-sample-worker",
        )
        process.start()
        give_up = time.monotonic() + timeout
        while True:
            try:
                return process, ports.get(timeout=0.05)
            except queue.Empty:
                pass
            if not process.is_alive():
                raise OSError(f"a sample worker could not serve on {address} (port in use? see the log above): it "
                              f"exited with code {process.exitcode}")
            if time.monotonic() > give_up:
                process.kill()
                process.join()
                raise TimeoutError(f"a sample worker did not start serving on {address} within {timeout:g} s")

    def start(self) -> None:
        for _ in range(self.count):
            process, port = self._spawn(0)
            self._processes.append(process)
            self.ports.append(port)
            self.endpoints.append(f"{self.host}:{port}")
        if self.count:
            self._monitor.start()

    def _watch(self) -> None:
        retry_at = [0.0] * len(self._processes)  # a worker that could not be started again: when to try next
        backoff = [0.5] * len(self._processes)
        while not self._stop.wait(0.5):
            for index, process in enumerate(self._processes):
                if process.is_alive() or self._stop.is_set() or time.monotonic() < retry_at[index]:
                    continue
                if not retry_at[index]:
                    log.warning("sample worker on port %d exited (%s); starting it again",
                                self.ports[index], process.exitcode)
                try:
                    self._processes[index], _ = self._spawn(self.ports[index])
                except (OSError, TimeoutError) as exc:  # its port taken meanwhile: try again later, keep watching
                    retry_at[index] = time.monotonic() + backoff[index]
                    backoff[index] = min(backoff[index] * 2, 10.0)
                    log.error("%s; trying again in %.1f s", exc, retry_at[index] - time.monotonic())
                    continue
                retry_at[index], backoff[index] = 0.0, 0.5
                self.restarts += 1

    def stop(self) -> None:
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join()  # a restart under way lands in _processes before they are terminated
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            process.join(timeout=10)
