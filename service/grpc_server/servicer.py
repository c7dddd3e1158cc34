"""The gRPC servicer: decodes requests, calls the buffers, maps errors to status codes."""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry

from replayd.server import checkpoint
from replayd.server.buffers.episodic import EpisodicBuffer
from replayd.server.buffers.reader import RingReader, check_importance_beta
from replayd.server.buffers.rollout import RolloutBuffer
from replayd.server.buffers.stacking import Shipped
from replayd.server.grpc_server import convert
from replayd.server.grpc_server.in_place import InPlaceMessages
from replayd.server.grpc_server.metrics import RpcMetrics, buffer_of, request_bytes, response_bytes
from replayd.server.modes.base import BatchMode
from replayd.server.registry import BufferRegistry
from replayd.server.weights import WeightStore
from replayd.server.worker_seats import WorkerSeats
from replayd.wire import codec, errors
from replayd.wire import replay_pb2 as pb
from replayd.wire import replay_pb2_grpc as pb_grpc
from replayd.wire.frame_fields import CompressedFrames
from replayd.wire.frames import InsertFrame, sample_response, sample_response_bytes

log = logging.getLogger("replayd")

# Far above any learner's batch; keeps a hostile batch_size from allocating before the size check.
MAX_BATCH_SIZE = 2**24
KEY_ITEM_BYTES = 8 + 8  # include_keys: key (int64) and episode_id (uint64) per item
# Sampling streams of side-effect-free buffers sample and encode this many batches ahead of gRPC (see _Ahead).
SAMPLE_AHEAD = 1
# Status messages travel as trailing metadata, which clients cap at 8-16 KiB; messages quote request
# values (names, shapes), so a long one would turn the status into a transport error.
MAX_STATUS_MESSAGE = 1024

STATUS = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    codec.CodecError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
}


@dataclass(frozen=True)
class MalformedRequest:
    """What a request deserializer returns for bytes it cannot parse: gRPC would answer INTERNAL for a
    deserializer that raises, and malformed input is the client's error."""

    error: str


def lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except (DecodeError, codec.CodecError) as exc:
            return MalformedRequest(f"malformed request message: {exc or type(exc).__name__}")

    return deserialize


def _message(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= MAX_STATUS_MESSAGE else f"{text[:MAX_STATUS_MESSAGE]}... ({len(text)} characters)"


def _status_of(exc: Exception) -> grpc.StatusCode:
    for kind, code in STATUS.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _sent_bytes(response: object) -> int:
    """Payload bytes of a response; batches go out as serialized SampleResponse messages (their frames count)."""
    if isinstance(response, bytes):
        return sample_response(response).nbytes
    return response_bytes(response)


def rpc(method: Callable) -> Callable:
    """Turns replayd errors into gRPC statuses; anything else is INTERNAL and logged with its trace.
    With the servicer's `rpc_metrics`, observes the call's latency and payload bytes (failed calls too)."""

    @functools.wraps(method)
    def wrapper(self: ReplayServicer, request, context: grpc.ServicerContext):
        metrics: RpcMetrics | None = getattr(self, "rpc_metrics", None)
        if metrics is None:
            return _unary(self, method, request, context)
        start = time.perf_counter()
        buffers: list[str] = []
        if isinstance(request, Iterator):  # Insert: a stream of frames, each naming its buffer
            request = _counted_frames(metrics, method.__name__, request, buffers)
        else:
            buffers.append(buffer_of(request))
        response = None
        try:
            response = _unary(self, method, request, context)
            return response
        finally:
            label = metrics.label(buffers[0] if buffers else "")
            metrics.observe_latency(method.__name__, label, time.perf_counter() - start)
            metrics.add_bytes(method.__name__, label, request_bytes(request), _sent_bytes(response))

    return wrapper


def _abort(self: ReplayServicer, method: Callable, exc: Exception, context: grpc.ServicerContext) -> None:
    """Ends the call: replayd errors with their status code, anything else as INTERNAL (logged with its trace)."""
    if isinstance(exc, grpc.RpcError) and not context.is_active():
        # The client cancelled, or its deadline passed, while the handler read the call's request stream.
        exc = errors.Cancelled(f"{method.__name__}: the call ended while its requests were being read")
    if isinstance(exc, errors.ReplayError | codec.CodecError):
        if not isinstance(exc, errors.Cancelled):  # the client ended the call: nothing was rejected
            self.counters_rejected(method.__name__, exc)
        if isinstance(exc, errors.Unavailable) and exc.retry_after_ms is not None:
            context.set_trailing_metadata(((errors.RETRY_AFTER_METADATA, str(exc.retry_after_ms)),))
        context.abort(_status_of(exc), _message(exc))
    log.exception("%s failed", method.__name__)
    context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__}: {type(exc).__name__}: {exc}")


def _unary(self: ReplayServicer, method: Callable, request, context: grpc.ServicerContext):
    try:
        if isinstance(request, MalformedRequest):
            raise errors.InvalidArgument(request.error)
        return method(self, request, context)
    except Exception as exc:
        _abort(self, method, exc, context)


def _counted_frames(metrics: RpcMetrics, method: str, frames: Iterator, buffers: list[str]) -> Iterator:
    """Passes the frames through, counting each one's payload under its buffer; `buffers` gets the first's."""
    for frame in frames:
        if not isinstance(frame, MalformedRequest):
            if not buffers:
                buffers.append(buffer_of(frame))
            metrics.add_received(method, frame)
        yield frame


_END = object()


class _Ahead:
    """Iterates `messages` on a thread of its own, at most `depth` messages ahead of the consumer.

    gRPC's synchronous server hands a streamed message to the transport and waits until it is written
    before it asks for the next one; produced on that thread, each batch would be sampled and encoded
    while nothing is sent. Here the next batch is produced while the previous one is being sent (numpy's
    gathers, the join into the message and gRPC's socket writes release the GIL). Messages and the
    producer's exception (re-raised here, after the messages before it) arrive in order; the generator
    is advanced and closed on the producer thread only. `observe(seconds, message)` times each message's
    production."""

    def __init__(self, messages: Iterator, depth: int, observe: Callable[[float, Any], None] | None,
                 seats: WorkerSeats) -> None:
        self._messages, self._depth, self._observe = messages, depth, observe
        self._seats = seats  # the stream's seat covers its producer's waits
        self._ready: collections.deque = collections.deque()
        self._condition = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._produce, name="replayd-ahead", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        with self._seats.lend():
            self._produce_messages()

    def _produce_messages(self) -> None:
        failure: BaseException | None = None
        try:
            while True:
                with self._condition:
                    while len(self._ready) >= self._depth and not self._closed:
                        self._condition.wait()
                    if self._closed:
                        return
                start = time.perf_counter()
                try:
                    message = next(self._messages)
                except StopIteration:
                    return
                if self._observe is not None:
                    self._observe(time.perf_counter() - start, message)
                with self._condition:
                    self._ready.append(message)
                    self._condition.notify_all()
        except BaseException as exc:  # handed to the consumer, raised there
            failure = exc
        finally:
            self._messages.close()
            with self._condition:
                if failure is not None:
                    self._ready.append(failure)
                self._ready.append(_END)
                self._condition.notify_all()

    def __iter__(self) -> _Ahead:
        return self

    def __next__(self):
        with self._condition:
            while not self._ready:
                self._condition.wait()
            item = self._ready[0]
            if item is _END:
                raise StopIteration
            self._ready.popleft()
            self._condition.notify_all()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stops the producer after the message it is producing (if any); does not wait for it."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()


def _timed(messages: Iterator, observe: Callable[[float, Any], None] | None) -> Iterator:
    produce = time.perf_counter()
    for message in messages:
        if observe is not None:
            observe(time.perf_counter() - produce, message)
        yield message
        produce = time.perf_counter()


def stream_rpc(method: Callable | None = None, *, ahead: Callable[[Any, Any], int] | None = None) -> Callable:
    """`rpc` for server-streaming calls. Metrics: each message's production time (not the time spent handing
    it to gRPC), its bytes, and the whole stream's latency. `ahead(servicer, request)`: how many messages
    may be produced ahead of gRPC on a thread of the stream's own (_Ahead); 0 or no `ahead`: each is
    produced when gRPC asks for it."""
    if method is None:
        return functools.partial(stream_rpc, ahead=ahead)

    @functools.wraps(method)
    def wrapper(self: ReplayServicer, request, context: grpc.ServicerContext):
        metrics: RpcMetrics | None = getattr(self, "rpc_metrics", None)
        start = time.perf_counter()
        messages = produced = None
        try:
            if isinstance(request, MalformedRequest):
                raise errors.InvalidArgument(request.error)
            observe = None
            if metrics is not None:
                label = metrics.label(buffer_of(request))

                def observe(seconds: float, message: object) -> None:
                    metrics.observe_message(method.__name__, label, seconds, _sent_bytes(message))

            seats = self.worker_seats  # a stream holds its seat while it is open
            with seats.stream_seat(f"{method.__name__} on buffer {buffer_of(request)!r}"):
                depth = ahead(self, request) if ahead is not None else 0
                produced = method(self, request, context)
                messages = _Ahead(produced, depth, observe, seats) if depth > 0 else _timed(produced, observe)
                yield from messages
        except Exception as exc:
            _abort(self, method, exc, context)
        finally:
            # A cancelled stream stops its producer now, as `yield from` would: an _Ahead closes the method's
            # generator on its own thread (it may be running there); otherwise it is closed here.
            if isinstance(messages, _Ahead):
                messages.close()
            elif produced is not None:
                produced.close()
            if metrics is not None:
                label = metrics.label(buffer_of(request))
                metrics.observe_latency(method.__name__, label, time.perf_counter() - start)

    return wrapper


class CallEnd:
    """An event set when the RPC ends (its client cancelled it, or it finished), which also wakes the
    buffers the call waits on: a cancelled call must not keep its worker (and seat) until its deadline."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.event = threading.Event()
        self._buffers: list[EpisodicBuffer] = []
        self._lock = threading.Lock()
        if not context.add_callback(self._end):  # the call has ended already
            self.event.set()

    def on(self, buffer: EpisodicBuffer) -> threading.Event:
        """The event, for a wait on `buffer`."""
        with self._lock:
            if buffer not in self._buffers:
                self._buffers.append(buffer)
        return self.event

    def _end(self) -> None:
        self.event.set()
        with self._lock:
            buffers = list(self._buffers)
        for buffer in buffers:
            buffer.wake_waiters()


def time_remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds left before the call's deadline; None if it has none (gRPC then reports a huge number)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > threading.TIMEOUT_MAX else max(0.0, remaining)


# A waiting sample gives up this long before the call's deadline (a quarter of the time left at most), so that
# its DEADLINE_EXCEEDED, which says what it waited for, reaches the client before the client's own bare one:
# a margin of 50 ms can lose that race on a loaded machine, where the process stalls that long.
_REPLY_MARGIN_SECONDS = 0.2


def wait_seconds(request: pb.SampleRequest, context: grpc.ServicerContext) -> float | None:
    """How long a sample may wait for data: None unless the request asks to wait (up to its deadline)."""
    if not request.wait:
        return None
    remaining = time_remaining(context)
    if remaining is None:
        raise errors.InvalidArgument("sample: wait=true needs a call deadline (timeout)")
    return remaining - min(_REPLY_MARGIN_SECONDS, remaining / 4)


DECOMPRESS = ("server", "client")  # where a sample's compressed frames are decompressed ("": the server)


def ships_frames(request: pb.SampleRequest) -> bool:
    """Whether the request asks for compressed frames shipped to the client (checked by sample_mode)."""
    return request.decompress == "client"


def sample_mode(request: pb.SampleRequest, reader: RingReader, max_message_bytes: int) -> BatchMode:
    """The request's batch mode, once the request is checked: a batch that could not be sent is refused
    before it is drawn (a draw counts: removers, rate limiters, the buffer's counters). Modes hold no
    state: one serves a whole stream."""
    if not 1 <= request.batch_size <= MAX_BATCH_SIZE:
        raise errors.InvalidArgument(f"sample: batch_size expected 1..{MAX_BATCH_SIZE}, got {request.batch_size}")
    if request.decompress not in ("", *DECOMPRESS):
        raise errors.InvalidArgument(f"sample.decompress: expected 'server' or 'client', got {request.decompress!r}")
    check_importance_beta(request.importance_beta)
    mode = convert.mode_from_request(request)
    ring = reader.ring
    mode.check(ring)
    item_bytes = (mode.item_bytes(ring) + reader.sampler.extra_item_bytes
                  + (KEY_ITEM_BYTES if request.include_keys else 0))
    # A batch holds at most each observation field thrice (obs, next, bootstrap), the step fields, two flags,
    # two targets, keys and ids, and the sampler's columns.
    needed = request.batch_size * item_bytes + codec.framing_bytes(3 * len(ring.fields) + 8)
    if needed > max_message_bytes:
        raise errors.ResourceExhausted(
            f"sample: batch_size={request.batch_size} needs up to {needed} bytes ({item_bytes} per item), over "
            f"the server's max_message_bytes={max_message_bytes}; lower batch_size or raise --max-message-mb"
        )
    return mode


def _decode(payload: bytes | memoryview, field: str) -> dict[str, np.ndarray]:
    """codec.decode, its errors naming the request field that held the payload."""
    try:
        return codec.decode(payload)
    except codec.CodecError as exc:
        raise codec.CodecError(f"{field}: {exc}") from exc


def _insert_columns(frame: InsertFrame) -> dict[str, np.ndarray | CompressedFrames]:
    """An insert's Arrow columns and compressed frames by field (the buffer checks them against its schema)."""
    columns: dict[str, np.ndarray | CompressedFrames] = dict(_decode(frame.steps, "insert.steps"))
    for name, frames in frame.compressed().items():
        if name in columns:
            raise errors.InvalidArgument(f"insert: field {name!r} is sent twice: as a column of insert.steps and as "
                                         "compressed frames")
        columns[name] = frames
    return columns


def sample_message(batch: dict[str, np.ndarray], max_message_bytes: int, shipped: list[Shipped] | None = None
                   ) -> bytes:
    """A batch as a serialized SampleResponse, what the sampling RPCs send (their response serializer is
    the identity): the columns are copied once, from the sampler's arrays into the message, and so are the
    compressed frames it ships (decompress="client")."""
    parts = codec.encode_parts(batch)
    frames = tuple((pb.CompressedFrames(field=s.field.name, spec=convert.fields_to_proto((s.field,))[0],
                                        columns=s.columns), s.frames) for s in shipped or ())
    size = codec.encoded_size(parts) + sum(s.frames.nbytes for s in shipped or ())
    if size > max_message_bytes:
        raise errors.ResourceExhausted(
            f"sample: the batch encodes to {size} bytes, over the server's max_message_bytes="
            f"{max_message_bytes}; lower batch_size or raise --max-message-mb"
        )
    return sample_response_bytes(parts, frames)


# One plain directory name (no "/", not "." or ".."): a client names a place under --checkpoint-dir, no other.
_CHECKPOINT_SUBDIRECTORY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def checkpoint_directory(root: str | None, subdirectory: str) -> str:
    """Where a Checkpoint RPC writes: the server's --checkpoint-dir, or the subdirectory of it the request
    names. A client must not make the server write anywhere else (a path of its choosing would be written,
    and a LATEST file there replaced, with the server's rights)."""
    if not root:
        raise errors.FailedPrecondition("checkpoint: the server has no --checkpoint-dir, the only place the "
                                        "Checkpoint RPC writes to; start it with one")
    if not subdirectory:
        return root
    if not _CHECKPOINT_SUBDIRECTORY.fullmatch(subdirectory):
        raise errors.InvalidArgument(f"checkpoint.directory: expected empty or the name of a subdirectory of the "
                                     f"server's --checkpoint-dir (letters, digits, '_', '.', '-', up to 64, "
                                     f"not starting with '.' or '-'), got {subdirectory!r}")
    return os.path.join(root, subdirectory)


class ReplayServicer(pb_grpc.ReplayServicer):
    def __init__(self, registry: BufferRegistry, max_message_bytes: int, max_buffer_bytes: int | None = None,
                 checkpoint_dir: str | None = None, metrics: CollectorRegistry | None = None) -> None:
        """`metrics`: the registry RPC latencies and payload bytes are reported in (None: not measured)."""
        self.registry = registry
        self.worker_seats = registry.worker_seats  # open streams and blocked calls, across all buffers
        self.rpc_metrics = RpcMetrics(metrics, registry.__contains__) if metrics is not None else None
        self.checkpoint_dir = checkpoint_dir  # where Checkpoint writes when the request names no directory
        self.weights = WeightStore()
        self.max_message_bytes = max_message_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self.rejected: dict[str, int] = {}
        self._rejected_lock = threading.Lock()  # handlers run on many threads: += is a read and a write
        self.sample_endpoints: list[str] = []  # sample worker addresses, set by the server
        self._describes = 0

    def _info(self, name: str, buffer: EpisodicBuffer | RolloutBuffer) -> pb.BufferInfo:
        info = convert.buffer_info(name, buffer)
        if isinstance(buffer, EpisodicBuffer) and buffer.shared_sampling and self.sample_endpoints:
            # Rotated per call, so that clients spread their streams over the workers.
            self._describes += 1
            shift = self._describes % len(self.sample_endpoints)
            info.sample_endpoints.extend(self.sample_endpoints[shift:] + self.sample_endpoints[:shift])
        return info

    def counters_rejected(self, method: str, exc: Exception) -> None:
        with self._rejected_lock:
            self.rejected[method] = self.rejected.get(method, 0) + 1
        log.info("%s rejected: %s", method, exc)

    # ---------------------------------------------------------------- buffers
    @rpc
    def CreateBuffer(self, request: pb.CreateBufferRequest, context) -> pb.BufferInfo:
        kind = request.WhichOneof("kind")
        if kind not in ("episodic", "rollout"):
            raise errors.InvalidArgument(f"create: kind must be episodic or rollout, got {kind}")
        self.registry.reserve_check(request.name)
        if kind == "rollout":
            rollout = RolloutBuffer.create(request.name, self.registry.instance,
                                           convert.rollout_config_from_proto(request.rollout),
                                           max_bytes=self.max_buffer_bytes)
            self.registry.add(request.name, rollout)
            log.info("created rollout buffer %r: %.1f MiB of shared memory", request.name,
                     rollout.shared.nbytes / 2**20)
            return self._info(request.name, rollout)
        config = request.episodic
        sampler, remover, limiter = convert.components_from_config(config)
        buffer = EpisodicBuffer(
            request.name,
            self.registry.instance,
            convert.fields_from_proto(config.fields),
            config.capacity_steps,
            reward_field=config.reward_field or None,
            sampler=sampler,
            remover=remover,
            limiter=limiter,
            max_bytes=self.max_buffer_bytes,
            goal_fields=convert.goal_fields_from_proto(config),
            capacity_bytes=config.capacity_bytes,
        )
        self.registry.add(buffer.name, buffer)
        log.info("created buffer %r: %d steps, %.1f MiB of shared memory (%s)", buffer.name, buffer.capacity,
                 buffer.storage.nbytes / 2**20, buffer.storage.header_name)
        return self._info(buffer.name, buffer)

    @rpc
    def DeleteBuffer(self, request: pb.DeleteBufferRequest, context) -> pb.DeleteBufferResponse:
        self.registry.delete(request.name)
        if self.rpc_metrics is not None:
            self.rpc_metrics.forget(request.name)
        return pb.DeleteBufferResponse()

    @rpc
    def ListBuffers(self, request: pb.ListBuffersRequest, context) -> pb.ListBuffersResponse:
        infos = []
        for name, buffer in self.registry.all():
            try:
                infos.append(self._info(name, buffer))
            except errors.NotFound:  # deleted after the list was taken: no longer a buffer to list
                continue
        return pb.ListBuffersResponse(buffers=infos)

    @rpc
    def DescribeBuffer(self, request: pb.DescribeBufferRequest, context) -> pb.BufferInfo:
        return self._info(request.name, self.registry.get(request.name))

    # ---------------------------------------------------------------- episodic
    @rpc
    def Insert(self, frames: Iterator[InsertFrame], context) -> pb.InsertResponse:
        requests = spans = rows = completed = duplicates = 0
        call_end = CallEnd(context)  # a rate limiter may hold an insert back: a cancelled call stops waiting
        for frame in frames:
            if isinstance(frame, MalformedRequest):
                stored = f"; the {requests} before it were stored" if requests else ""
                raise errors.InvalidArgument(f"{frame.error} (request {requests} of the stream{stored})")
            request = frame.request
            try:
                buffer = self.registry.episodic(request.buffer)
                columns = _insert_columns(frame)
                spans_of_request = convert.spans_from_request(request)
                result = buffer.insert_result(columns, spans_of_request, timeout=time_remaining(context),
                                              ended=call_end.on(buffer))
            except (errors.ReplayError, codec.CodecError) as exc:
                if requests:
                    exc.args = (f"{exc.args[0]} (request {requests} of the stream; the {requests} before it "
                                "were stored)",)
                raise
            requests += 1
            spans += len(spans_of_request.rows)
            rows += int(spans_of_request.rows.sum())
            completed += result.completed
            duplicates += result.duplicate_spans
        return pb.InsertResponse(requests=requests, spans=spans, rows=rows, episodes_completed=completed,
                                 duplicate_spans=duplicates)

    def _sample_message(self, buffer: EpisodicBuffer, request: pb.SampleRequest, mode: BatchMode,
                        rng: np.random.Generator | None, wait_seconds: float | None,
                        ended: threading.Event | None) -> bytes:
        shipped: list[Shipped] | None = [] if ships_frames(request) else None
        batch = buffer.sample(request.batch_size, mode, rng, request.include_keys, wait_seconds,
                              importance_beta=request.importance_beta, ended=ended, shipped=shipped)
        return sample_message(batch, self.max_message_bytes, shipped)

    @rpc
    def Sample(self, request: pb.SampleRequest, context) -> bytes:
        buffer = self.registry.episodic(request.buffer)
        rng = np.random.default_rng(request.seed) if request.HasField("seed") else None
        ended = CallEnd(context).on(buffer) if request.wait else None
        return self._sample_message(buffer, request, sample_mode(request, buffer.reader, self.max_message_bytes), rng,
                                    wait_seconds(request, context), ended)

    @rpc
    def UpdatePriorities(self, request: pb.UpdatePrioritiesRequest, context) -> pb.UpdatePrioritiesResponse:
        buffer = self.registry.episodic(request.buffer)
        applied, ignored = buffer.update_priorities(np.array(request.keys, dtype=np.int64),
                                                    np.array(request.priorities, dtype=np.float64))
        return pb.UpdatePrioritiesResponse(applied=applied, ignored_stale=ignored)

    def _sample_ahead(self, request: pb.SampleStreamRequest) -> int:
        """Batches a stream samples ahead of gRPC: SAMPLE_AHEAD where sampling changes nothing (no remover
        counting draws, no rate limiter), else none: a batch sampled ahead and never sent (the stream was
        cancelled) must not have counted."""
        try:
            buffer = self.registry.episodic(request.request.buffer)
        except errors.ReplayError:
            return 0  # the stream fails with the error
        return SAMPLE_AHEAD if buffer.shared_sampling else 0

    @stream_rpc(ahead=_sample_ahead)
    def SampleStream(self, request: pb.SampleStreamRequest, context) -> Iterator[bytes]:
        inner = request.request
        if request.num_batches < 0:
            raise errors.InvalidArgument(f"sample_stream: num_batches expected >= 0 (0 = until cancelled), "
                                         f"got {request.num_batches}")
        buffer = self.registry.episodic(inner.buffer)
        mode = sample_mode(inner, buffer.reader, self.max_message_bytes)
        # One generator for the whole stream: seeded streams are reproducible batch after batch.
        rng = np.random.default_rng(inner.seed) if inner.HasField("seed") else None
        ended = CallEnd(context).on(buffer) if inner.wait else None  # a cancelled stream stops waiting
        sent = 0
        # No context.is_active() here: gRPC asks for a batch only while the call is active, a stream sampling
        # ahead is stopped by stream_rpc, and is_active() waits for the call's lock, which gRPC holds while it
        # hands the previous batch to the transport (it would serialize sampling ahead with sending).
        messages = InPlaceMessages(mode, lambda batch: sample_message(batch, self.max_message_bytes))
        while request.num_batches == 0 or sent < request.num_batches:
            if ships_frames(inner):  # small batches of indices, and frames of varying size: no layout to learn
                yield self._sample_message(buffer, inner, mode, rng, wait_seconds(inner, context), ended)
            else:
                yield messages.next(lambda mode: buffer.sample(
                    inner.batch_size, mode, rng, inner.include_keys, wait_seconds(inner, context),
                    importance_beta=inner.importance_beta, ended=ended))
            sent += 1

    # ---------------------------------------------------------------- rollout
    @rpc
    def PushRollout(self, request: pb.PushRolloutRequest, context) -> pb.PushRolloutResponse:
        buffer = self.registry.rollout(request.buffer)
        columns = _decode(request.steps, "push_rollout.steps")
        rows = len(next(iter(columns.values()))) if columns else 0
        envs, slots = request.num_envs, buffer.config.num_envs
        if envs < 1 or rows % envs:
            raise errors.InvalidArgument(f"push_rollout: num_envs={envs} must be >= 1 and divide the {rows} rows")
        if envs > slots:  # checked before the reshape, which a huge num_envs over 0 rows would make fail
            raise errors.InvalidArgument(f"num_envs: expected <= {slots} (the buffer's env slots), got {envs}")
        steps = rows // envs
        cells = {name: array.reshape(steps, envs, *array.shape[1:]) for name, array in columns.items()}
        bootstrap = None
        if request.bootstrap:
            bootstrap_columns = _decode(request.bootstrap, "push_rollout.bootstrap")
            if set(bootstrap_columns) != {"value"}:
                raise errors.InvalidArgument(
                    f"push_rollout: bootstrap must hold exactly one column 'value', got {sorted(bootstrap_columns)}"
                )
            bootstrap = bootstrap_columns["value"]
        result = buffer.push(request.policy_version, request.env_start, request.step_start, cells, bootstrap)
        return pb.PushRolloutResponse(missing_steps=result["missing_steps"],
                                      rollout_complete=result["rollout_complete"])

    @stream_rpc
    def RolloutMinibatches(self, request: pb.RolloutMinibatchesRequest, context) -> Iterator[bytes]:
        buffer = self.registry.rollout(request.buffer)
        config = buffer.config
        # The columns and advantage and return; refused before GAE runs and a minibatch is cut (and counted).
        needed = request.minibatch_size * buffer.sample_bytes + codec.framing_bytes(len(config.columns) + 2)
        if 1 <= request.minibatch_size <= config.num_steps * config.num_envs and needed > self.max_message_bytes:
            raise errors.ResourceExhausted(
                f"rollout_minibatches: minibatch_size={request.minibatch_size} needs up to {needed} bytes "
                f"({buffer.sample_bytes} per sample), over the server's max_message_bytes={self.max_message_bytes}; "
                "lower minibatch_size or raise --max-message-mb"
            )
        minibatches = buffer.minibatches(
            request.minibatch_size, request.epochs or 1, request.normalize_advantages, request.drop_last,
            request.seed if request.HasField("seed") else None,
        )
        for batch in minibatches:
            if not context.is_active():
                return
            yield sample_response_bytes(codec.encode_parts(batch))

    @rpc
    def FinishRollout(self, request: pb.FinishRolloutRequest, context) -> pb.BufferInfo:
        buffer = self.registry.rollout(request.buffer)
        buffer.finish_rollout(request.next_version)
        return self._info(request.buffer, buffer)

    # ---------------------------------------------------------------- weights
    @rpc
    def PublishWeights(self, request: pb.PublishWeightsRequest, context) -> pb.PublishWeightsResponse:
        accepted, version = self.weights.publish(request.name, request.version, request.safetensors, request.final)
        return pb.PublishWeightsResponse(accepted=accepted, version=version)

    @rpc
    def FetchWeights(self, request: pb.FetchWeightsRequest, context) -> pb.FetchWeightsResponse:
        stored = self.weights.fetch(request.name, request.newer_than)
        return pb.FetchWeightsResponse(version=stored.version, safetensors=stored.payload, final=stored.final)

    # ---------------------------------------------------------------- checkpoints
    @rpc
    def Checkpoint(self, request: pb.CheckpointRequest, context) -> pb.CheckpointResponse:
        directory = checkpoint_directory(self.checkpoint_dir, request.directory)
        try:
            manifest = checkpoint.write_checkpoint(self.registry, directory)
        except OSError as exc:
            raise errors.FailedPrecondition(f"checkpoint: cannot write under {directory!r}: {exc}") from exc
        buffers = [entry["name"] for entry in json.loads(manifest.read_text())["buffers"]]
        return pb.CheckpointResponse(path=str(manifest), buffers=buffers)
