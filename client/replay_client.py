"""ReplayClient: one server's buffers over gRPC, batches as numpy dicts.

Only the wire contract (proto + codec) is shared with the server; no torch is imported here.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import random
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
import numpy as np

from replayd.client.batch_stream import BatchStream, decode_sample
from replayd.client.retries import cut_short_by_deadline, server_retry_after
from replayd.wire import codec
from replayd.wire import components as options
from replayd.wire import replay_pb2 as pb
from replayd.wire import replay_pb2_grpc as pb_grpc
from replayd.wire.channel import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from replayd.wire.components import (
    Fifo,
    MinSize,
    ModeOptions,
    RateLimiterOptions,
    RemoverOptions,
    SamplerOptions,
    Transitions,
    Uniform,
)
from replayd.wire.frame_fields import CompressedFrames, Frames, compress, concatenate
from replayd.wire.frames import InsertFrame, SampledMessage, sample_response, sample_response_batch, serialize_insert

# field -> (numpy dtype, row shape), or (dtype, frame shape, Frames(...)) for a stacked or compressed observation field
Schema = Mapping[str, tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], Frames]]
T = TypeVar("T")


def new_episode_id() -> int:
    return secrets.randbits(63)


def _give_up(timeout: float | None) -> float | None:
    """The monotonic time a call given `timeout` seconds must end by (None: no deadline)."""
    return None if timeout is None else time.monotonic() + timeout


def _left(give_up: float | None) -> float | None:
    """Seconds left until `give_up` (None: no deadline), 0 once it has passed."""
    return None if give_up is None else max(give_up - time.monotonic(), 0.0)


def is_int(value: Any) -> bool:
    """An integer (Python or numpy) that is not a bool: True would pass as 1."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _refuse_none(**options: Any) -> None:
    """Refuses options given as None: protobuf takes a field set to None as "not set", and the server would
    silently use the field's default instead."""
    for name, value in options.items():
        if value is None:
            raise ValueError(f"{name}: expected a value, got None")


def _names_its_spans(frame: InsertFrame | pb.InsertRequest) -> bool:
    """Whether an insert request names every span by its offset, so that a retry of it is stored once."""
    request = frame.request if isinstance(frame, InsertFrame) else frame
    return len(request.span_offsets) == len(request.span_rows)


def _int64_keys(keys: Sequence[int] | np.ndarray) -> np.ndarray:
    """`keys` as int64, refusing what a cast would change: a float key would update a truncated step and a
    uint64 above 2**63 - 1 would wrap to a negative one."""
    if isinstance(keys, list | tuple):  # element by element: np.asarray would make True 1 among ints
        for index, key in enumerate(keys):
            if not is_int(key):
                raise ValueError(f"keys: expected integers, got {key!r} at index {index}")
    array = np.asarray(keys)
    if array.ndim != 1:
        raise ValueError(f"keys: expected a 1-D sequence, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, np.int64)
    int64_max = np.iinfo(np.int64).max
    if array.dtype == object:  # Python ints beyond 64 bits, or a mix of types
        for index, key in enumerate(array):
            if not is_int(key):
                raise ValueError(f"keys: expected integers, got {key!r} at index {index}")
        outside = [not 0 <= key <= int64_max for key in array]
    elif array.dtype.kind in "iu":
        outside = (array < 0) | (array > int64_max)
    else:
        raise ValueError(f"keys: expected integers, got dtype {array.dtype} (first key {array[0].item()!r})")
    if np.any(outside):
        index = int(np.argmax(outside))
        raise ValueError(f"keys: expected integers in 0..{int64_max} (int64 positions), got {int(array[index])} "
                         f"at index {index}")
    return array.astype(np.int64)


def _float32_bootstrap(bootstrap_value: np.ndarray) -> np.ndarray:
    """`bootstrap_value` as float32, refusing a value the cast would change into another: a finite one beyond
    float32's range (inf, which the server would report instead of the value sent) or a nonzero one below
    its smallest subnormal (0)."""
    with np.errstate(over="ignore", under="ignore"):  # what the cast lost is refused below, by name
        cast = np.asarray(bootstrap_value, dtype=np.float32)
    sent = np.asarray(bootstrap_value)
    if sent.dtype.kind in "iuf":
        with np.errstate(invalid="ignore"):
            lost = (np.isfinite(sent) & ~np.isfinite(cast)) | ((sent != 0) & (cast == 0))
        if lost.any():
            env = int(np.argmax(lost.reshape(-1)))
            raise ValueError(f"bootstrap_value: expected values float32 can hold, got {sent.reshape(-1)[env].item()!r} "
                             f"at env {env} of the part (float32 makes it {float(cast.reshape(-1)[env])})")
    return cast


def _info_to_dict(info: pb.BufferInfo) -> dict[str, Any]:
    which = info.WhichOneof("config")
    config = getattr(info, which)
    # A rollout buffer holds (num_steps, num_envs) cells.
    capacity = config.capacity_steps if which == "episodic" else config.num_steps * config.num_envs
    return {
        "name": info.name,
        "kind": info.kind,
        "bytes": info.bytes,
        "shm_name": info.shm_name,
        "host": info.host,
        "stored_steps": info.stored_steps,
        "sampleable_steps": info.sampleable_steps,
        "episodes": info.episodes,
        "counters": dict(info.counters),
        "capacity_steps": capacity,
        "capacity_bytes": config.capacity_bytes if which == "episodic" else 0,
        "fields": {f.name: (f.dtype, tuple(f.shape), f.observation) for f in config.fields},
        # the stacked observation fields' options (FieldSpec's absent stack is 1)
        "frames": {f.name: Frames(f.stack, f.stack_axis, f.compression or None,
                                  f.compression_level if f.HasField("compression_level") else None)
                   for f in config.fields if f.stack > 1 or f.compression},
        "policy_version": info.policy_version,
        "missing_steps": info.missing_steps,
        "rollout_complete": info.rollout_complete,
        "sample_endpoints": list(info.sample_endpoints),
    } | (_episodic_components(config) if which == "episodic" else
         {"num_steps": config.num_steps, "num_envs": config.num_envs, "gamma": config.gamma,
          "gae_lambda": config.gae_lambda, "sampling_changes_state": False})


def _episodic_components(config: pb.EpisodicConfig) -> dict[str, Any]:
    """A description's sampler, remover and rate limiter as typed options."""
    sampler = options.from_proto("sampler", config.sampler, Uniform())
    remover = options.from_proto("remover", config.remover, Fifo())
    rate_limiter = options.from_proto("rate_limiter", config.rate_limiter, MinSize())
    # A sample that counts draws (max_times_sampled) or moves a limiter's balance is no idempotent call.
    goals = (config.achieved_goal_field, config.desired_goal_field)
    return {"sampler": sampler, "remover": remover, "rate_limiter": rate_limiter,
            "goal_fields": None if goals == ("", "") else goals,
            "sampling_changes_state": options.sampling_changes_state(remover, rate_limiter)}


def _field_spec(name: str, entry: tuple, observation: bool) -> pb.FieldSpec:
    """A schema entry, (dtype, shape) or (dtype, shape, Frames(...)), as its wire message."""
    if not isinstance(entry, tuple | list) or len(entry) not in (2, 3):
        raise ValueError(f"schema[{name!r}]: expected (dtype, shape) or (dtype, shape, Frames(...)), got {entry!r}")
    frames = entry[2] if len(entry) == 3 else Frames()
    _expect(f"schema[{name!r}][2]", frames, Frames, "Frames(stack=..., compression=...)")
    return pb.FieldSpec(name=name, dtype=np.dtype(entry[0]).name, shape=list(entry[1]), observation=observation,
                        stack=frames.stack, stack_axis=frames.stack_axis, compression=frames.compression or "",
                        compression_level=frames.compression_level)


def _expect(role: str, value: Any, kind: type, examples: str) -> None:
    """Refuses an option of the wrong role (a string, a dict, another role's options) by name."""
    if not isinstance(value, kind):
        raise ValueError(f"{role}: expected {examples}, got {value!r}")


@dataclass
class Span:
    """Rows of one episode in ring layout (every field has the same rows; step fields of a final row are
    padding; a compressed field's rows are its frames, compressed: compress_columns). `begins`: the first row
    is the episode's first observation; `ends`: the last row is its final observation. `offset`: the row index
    of the first row within its episode (0 when it begins; for a later chunk, the rows sent before it): with
    `episode_id` it names the span, so the server stores a retried span once."""

    columns: Mapping[str, np.ndarray | CompressedFrames]
    episode_id: int
    begins: bool = True
    ends: bool = True
    terminated: bool = False
    offset: int = 0

    @property
    def rows(self) -> int:
        return len(next(iter(self.columns.values())))


@dataclass(frozen=True)
class FetchedWeights:
    """A FetchWeights answer: `version` and `safetensors` of the stored weights when newer than asked for
    (else 0 and b""); `final` whether the stored version was published as its publisher's last (a learner
    that finished), newer or not: no newer one will come."""

    version: int
    safetensors: bytes
    final: bool


def compress_columns(columns: Mapping[str, np.ndarray], frames: Mapping[str, Frames]
                     ) -> dict[str, np.ndarray | CompressedFrames]:
    """The columns with each compressed field's rows (frames) compressed one by one, as inserts send them."""
    return {name: compress(frames[name].compression, frames[name].compression_level, column)
            if name in frames and frames[name].compression else column for name, column in columns.items()}


def spans_request(buffer: str, spans: Sequence[Span]) -> InsertFrame:
    joined = {name: [s.columns[name] for s in spans] for name in spans[0].columns}
    columns = {name: parts[0] if len(parts) == 1 else np.concatenate(parts)
               for name, parts in joined.items() if not isinstance(parts[0], CompressedFrames)}
    frames = tuple((name, concatenate(parts)) for name, parts in joined.items()
                   if isinstance(parts[0], CompressedFrames))
    request = pb.InsertRequest(
        buffer=buffer,
        episode_ids=[s.episode_id for s in spans],
        span_rows=[s.rows for s in spans],
        begins=[s.begins for s in spans],
        ends=[s.ends for s in spans],
        terminated=[s.terminated for s in spans],
        span_offsets=[s.offset for s in spans],
    )
    # The frame holds the payload as parts over the columns: gRPC's serializer joins them, one copy.
    return InsertFrame(request, codec.encode_parts(columns), frames)


# Requests above this are split (see split_spans): messages of a few MB keep both ends' copies in reused
# heap memory and pipeline over the stream; a whole Atari episode (28-56 MB) in one message measured 2-4x slower.
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
# gRPC reconnects after 1 s, then up to 120 s apart: a client opened before its server listens (or
# across a server restart) would wait seconds for a server that is up. 0.1 s, at most 1 s apart, instead.
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
              ("grpc.max_reconnect_backoff_ms", 1000)]


def _piece(span: Span, lo: int, hi: int, rows: int) -> Span:
    return Span({n: c[lo:hi] for n, c in span.columns.items()}, span.episode_id, span.begins and lo == 0,
                span.ends and hi == rows, span.terminated and hi == rows, span.offset + lo)


def request_rows(spans: Sequence[Span], max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> int:
    """Rows of `spans` (all of one buffer's layout) that one request of `max_request_bytes` holds (>= 2)."""
    row_bytes = sum(c.itemsize * math.prod(c.shape[1:]) if isinstance(c, np.ndarray) else -(-c.nbytes // max(len(c), 1))
                    for c in spans[0].columns.values())
    return max(2, max_request_bytes // max(row_bytes, 1))


def split_spans(spans: Sequence[Span], max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> list[list[Span]]:
    """Groups spans, in order, into requests of at most `max_request_bytes` of rows. A span larger than that
    is sent as chunks of its episode (offsets name them, so retries stay exactly-once). A span that begins
    its episode keeps at least half its rows in the first chunk: the server reserves twice a new episode's
    first chunk, so the later chunks land in place (no move of the landed rows, no hole in the ring); that
    first chunk may exceed the limit by up to 2x, never more (an episode beyond 4x the limit then grows its
    room at the head, or moves once)."""
    if not spans:
        return []
    max_rows = request_rows(spans, max_request_bytes)
    requests: list[list[Span]] = []
    current: list[Span] = []
    current_rows = 0
    for span in spans:
        rows = span.rows
        if rows > max_rows:
            if current:
                requests.append(current)
            first = min(-(-rows // 2), 2 * max_rows) if span.begins else 0
            rest = rows - first
            count = -(-rest // max_rows)
            bounds = [0, first] if first else [0]
            bounds += [first + rest * k // count for k in range(1, count + 1)]
            pieces = [_piece(span, lo, hi, rows) for lo, hi in itertools.pairwise(bounds)]
            requests.extend([p] for p in pieces[:-1])
            span, rows = pieces[-1], bounds[-1] - bounds[-2]
            current, current_rows = [], 0
        if current and current_rows + rows > max_rows:
            requests.append(current)
            current, current_rows = [], 0
        current.append(span)
        current_rows += rows
    requests.append(current)
    return requests


def spans_requests(buffer: str, spans: Sequence[Span],
                   max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> list[InsertFrame]:
    """`spans` as insert requests of at most about `max_request_bytes` each (see split_spans)."""
    return [spans_request(buffer, group) for group in split_spans(spans, max_request_bytes)]


def episode_span(episode: Mapping[str, np.ndarray], terminated: bool, observation_fields: Iterable[str],
                 episode_id: int | None = None) -> Span:
    """A whole episode as a span: observation fields have L + 1 rows, step fields L rows (padded here
    with one zero row, the ring's layout)."""
    observation_fields = set(observation_fields)
    arrays = {name: np.asarray(values) for name, values in episode.items()}
    obs_rows = {len(a) for n, a in arrays.items() if n in observation_fields}
    step_rows = {len(a) for n, a in arrays.items() if n not in observation_fields}
    if len(obs_rows) != 1 or (step_rows and step_rows != {next(iter(obs_rows)) - 1}):
        raise ValueError(
            "observation fields need L + 1 rows and step fields L rows, got "
            + ", ".join(f"{n}={len(a)}" for n, a in arrays.items())
        )
    columns = {
        name: array if name in observation_fields
        else np.concatenate([array, np.zeros((1, *array.shape[1:]), dtype=array.dtype)])
        for name, array in arrays.items()
    }
    return Span(columns, episode_id if episode_id is not None else new_episode_id(), True, True, bool(terminated))


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call. Metadata rather than call credentials, which
    gRPC sends over TLS channels only: a token must also work on a plain channel inside a trusted network."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout, tuple(details.metadata or ()) + self._metadata,
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)


class SpanSink(Protocol):
    """Where an EpisodeWriter sends its spans (ReplayClient.span_sink, ShardedReplayClient.span_sink)."""

    def send(self, spans: Sequence[Span]) -> None:
        """Stores the spans (exactly once: retried spans are acknowledged, not stored twice), or raises the
        server's refusal or, when no server can be reached, grpc.RpcError UNAVAILABLE (kept for a retry)."""

    def stranded(self, episode_id: int) -> bool:
        """Whether the open episode `episode_id` cannot go on where its spans went (the writer then goes on with
        a new episode)."""

    def deliver_held(self) -> None:
        """Delivers the spans the sink holds for servers that were down; grpc.RpcError UNAVAILABLE while some of
        those are still down."""


class ServerSink:
    """An EpisodeWriter's spans into one server: a stream of requests of up to the client's max_request_bytes per
    send. An episode always goes on where it began, and nothing is held here: a failed send raises."""

    def __init__(self, client: ReplayClient, buffer: str) -> None:
        self.client = client
        self.buffer = buffer

    def send(self, spans: Sequence[Span]) -> None:
        self.client.insert(spans_requests(self.buffer, spans, self.client.max_request_bytes))

    def stranded(self, episode_id: int) -> bool:
        return False

    def deliver_held(self) -> None:
        return None


@dataclass(frozen=True)
class _SamplingCalls:
    sample: grpc.UnaryUnaryMultiCallable
    stream: grpc.UnaryStreamMultiCallable

    @classmethod
    def on(cls, channel: grpc.Channel) -> _SamplingCalls:
        return cls(
            channel.unary_unary("/replayd.v1.Replay/Sample", request_serializer=pb.SampleRequest.SerializeToString,
                                response_deserializer=sample_response),
            channel.unary_stream("/replayd.v1.Replay/SampleStream",
                                 request_serializer=pb.SampleStreamRequest.SerializeToString,
                                 response_deserializer=sample_response),
        )


class ReplayClient:
    """Client of one replayd server. Thread-safe: gRPC channels may be shared between threads.

    `token`: sent as `authorization: Bearer <token>` on every call; None reads $REPLAYD_TOKEN (so actors and
    learners started by docker compose pick it up), "" sends none. `root_certificates`: PEM CA bundle that
    signed the server's certificate; the channel then uses TLS.
    """

    RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
    # Inserts are retried on these too: the server acknowledges spans it already stored (exactly once).
    INSERT_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    def __init__(self, address: str, timeout: float = 30.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 retries: int = 5, token: str | None = None, root_certificates: bytes | None = None,
                 use_sample_workers: bool = True, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        # A negative or fractional count would never equal the retries done: retried until the deadline.
        if not is_int(retries) or retries < 0:
            raise ValueError(f"retries: expected an integer >= 0, got {retries!r}")
        if not is_int(max_request_bytes) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: expected an integer >= 1, got {max_request_bytes!r}")
        self.address = address
        # Inserts of more are split into several requests. A long episode's first chunk may reach twice the
        # request size (split_spans), which must still fit a message with room for the framing.
        self.max_request_bytes = max(1, min(max_request_bytes, (max_message_bytes - codec.FRAMING_BYTES) // 2))
        self.timeout = timeout
        self.retries = retries
        self._options = channel_options(max_message_bytes) + _RECONNECT
        self._root_certificates = root_certificates
        self._token = os.environ.get("REPLAYD_TOKEN", "") if token is None else token
        self._channel = self._open_channel(address)
        self._stub = pb_grpc.ReplayStub(self._channel)
        # The payload-carrying calls skip protobuf's copies of their Arrow bytes (proto/frames.py).
        self._insert = self._channel.stream_unary(
            "/replayd.v1.Replay/Insert", request_serializer=serialize_insert,
            response_deserializer=pb.InsertResponse.FromString)
        self._server_sampling = _SamplingCalls.on(self._channel)
        self._rollout_minibatches = self._channel.unary_stream(
            "/replayd.v1.Replay/RolloutMinibatches", request_serializer=pb.RolloutMinibatchesRequest.SerializeToString,
            response_deserializer=sample_response_batch)
        self._described: dict[str, dict[str, Any]] = {}  # buffer -> its description, for inserts (fields, frames)
        self._stateful_sampling: dict[str, bool] = {}  # buffer -> sampling_changes_state (describe)
        # Sample workers (`replayd serve --sample-workers K`) found in buffer descriptions: calls go round-robin.
        self.use_sample_workers = use_sample_workers
        self._worker_channels: dict[str, grpc.Channel] = {}
        self._buffer_sampling: dict[str, list[_SamplingCalls]] = {}
        self._round_robin = itertools.count()

    def _open_channel(self, address: str) -> grpc.Channel:
        if self._root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(self._root_certificates)
            channel = grpc.secure_channel(address, credentials, options=self._options)
        else:
            channel = grpc.insecure_channel(address, options=self._options)
        return grpc.intercept_channel(channel, _BearerToken(self._token)) if self._token else channel

    def _sampling(self, buffer: str, timeout: float | None) -> _SamplingCalls:
        """Where the next sampling call for `buffer` goes: a sample worker if the server offers any (learnt
        with a describe bounded by `timeout`, the sampling call's)."""
        if not self.use_sample_workers:
            return self._server_sampling
        calls = self._buffer_sampling.get(buffer)
        if calls is None:
            host = self.address.rsplit(":", 1)[0]
            calls = []
            for endpoint in self.describe(buffer, timeout)["sample_endpoints"]:
                address = f"{host}:{endpoint.rsplit(':', 1)[1]}"  # the server's bind host may be 0.0.0.0
                if address not in self._worker_channels:
                    self._worker_channels[address] = self._open_channel(address)
                calls.append(_SamplingCalls.on(self._worker_channels[address]))
            self._buffer_sampling[buffer] = calls
        if not calls:
            return self._server_sampling
        return calls[next(self._round_robin) % len(calls)]

    def _sampling_within(self, buffer: str, timeout: float | None) -> tuple[_SamplingCalls, float | None]:
        """`_sampling(buffer, timeout)` and the seconds of `timeout` left for the sampling call after it."""
        give_up = _give_up(timeout)
        calls = self._sampling(buffer, timeout)
        return calls, _left(give_up)

    def _deadline(self, timeout: float | None) -> float | None:
        """A call's deadline in seconds: `timeout` as given (0 included), else the client's default (which
        may be None: no deadline)."""
        return self.timeout if timeout is None else timeout

    def _forget_sampling(self, buffer: str) -> None:
        """Drops what is cached about sampling `buffer`: a restarted server's sample workers listen on new
        ports, and a buffer created again under its name may be configured otherwise."""
        self._buffer_sampling.pop(buffer, None)
        self._stateful_sampling.pop(buffer, None)

    def _changes_state_or_unknown(self, buffer: str, timeout: float | None) -> bool:
        try:
            return self._sampling_changes_state(buffer, timeout)
        except grpc.RpcError:
            return True

    def _sampling_changes_state(self, buffer: str, timeout: float | None) -> bool:
        stateful = self._stateful_sampling.get(buffer)
        if stateful is None:
            stateful = self._stateful_sampling[buffer] = self.describe(buffer, timeout)["sampling_changes_state"]
        return stateful

    def close(self) -> None:
        """Closes the channels to the server and its sample workers; open streams end with them."""
        for channel in self._worker_channels.values():
            channel.close()
        self._channel.close()

    def __enter__(self) -> ReplayClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the server accepts connections (raises grpc.FutureTimeoutError otherwise)."""
        self.ready_future().result(timeout=timeout)

    def ready_future(self) -> grpc.Future:
        """A future that resolves once the server accepts connections, connecting until then (gRPC's reconnects:
        0.1 s, then up to 1 s apart); cancel() stops it."""
        return grpc.channel_ready_future(self._channel)

    def span_sink(self, buffer: str) -> ServerSink:
        """Where an EpisodeWriter's spans go: this server (see ServerSink)."""
        return ServerSink(self, buffer)

    def _idempotent(self, call: Callable[..., T], request: Any, timeout: float | None) -> T:
        """Retries UNAVAILABLE with exponential backoff and jitter (safe only for idempotent calls)."""
        return self._with_retries(lambda remaining: call(request, timeout=remaining), self.RETRYABLE,
                                  self._deadline(timeout))

    def _with_retries(self, attempt: Callable[[float | None], T], codes: Collection[grpc.StatusCode],
                      timeout: float | None, deadline_per_attempt: bool = False) -> T:
        """`attempt(seconds)` within `timeout` seconds in all, retries and their pauses included (None: no
        deadline), retried `self.retries` times on `codes` with exponential backoff and jitter.
        `deadline_per_attempt`: each retry gets `timeout` seconds of its own instead (inserts: one a rate
        limiter held past its deadline is sent again).

        A call the server refused before doing anything (busy: see WorkerSeats) is retried whatever
        `codes` says, within the same deadline: waiting for a seat is part of waiting for the call, and
        one refused until its deadline fails with the refusal."""
        delay, tried, refusal = 0.05, 0, None
        give_up = math.inf if timeout is None else time.monotonic() + timeout
        seconds = timeout  # this attempt's deadline
        while True:
            try:
                return attempt(seconds)
            except grpc.RpcError as exc:
                retry_after = server_retry_after(exc)  # None unless the server refused it untouched (busy)
                if retry_after is None:
                    if exc.code() not in codes or tried == self.retries:
                        if cut_short_by_deadline(exc, refusal, give_up):
                            raise refusal from exc
                        raise
                    tried += 1
                else:
                    delay = max(delay, retry_after)
                pause = delay * (1 + random.random())
                if deadline_per_attempt and retry_after is None:
                    time.sleep(pause)
                    give_up = math.inf if timeout is None else time.monotonic() + timeout
                else:
                    time.sleep(min(pause, max(give_up - time.monotonic(), 0.0)))
                    if time.monotonic() >= give_up:
                        if cut_short_by_deadline(exc, refusal, give_up):
                            raise refusal from exc
                        raise
                refusal = exc if retry_after is not None else None
                seconds = None if timeout is None else give_up - time.monotonic()
                delay = min(delay * 2, 2.0)

    # ---------------------------------------------------------------- buffers
    def create_buffer(
        self,
        name: str,
        capacity_steps: int,
        schema: Schema,
        observation_fields: Sequence[str] = ("obs",),
        reward_field: str | None = None,
        sampler: SamplerOptions = Uniform(),
        remover: RemoverOptions = Fifo(),
        rate_limiter: RateLimiterOptions = MinSize(),
        goal_fields: tuple[str, str] | None = None,
        capacity_bytes: int = 0,
    ) -> dict[str, Any]:
        """Creates an episodic buffer. `schema` maps field -> (numpy dtype, per-row shape), or, for an observation
        field stored one frame per row (sampled stacked, or stored compressed), -> (dtype, frame shape,
        Frames(stack=k, stack_axis=..., compression="zstd" | "lz4", compression_level=...)).

        capacity_steps: rows (an episode of L steps takes L + 1); capacity_bytes: the buffer's shared memory
        (0: sized by rows). With both, the compressed fields' frames get what the rows leave of the bytes; with
        bytes alone (capacity_steps=0), the rows are sized from them too.

        reward_field: the per-step reward for n-step returns (None: the field named "reward", if any).
        sampler: Uniform() or Prioritized(alpha=0.6). remover: Fifo() or MaxTimesSampled(k) (a step is retired
        after k draws). rate_limiter: MinSize(n) or SampleToInsertRatio(samples_per_insert, min_size_to_sample,
        error_buffer) (Reverb's limiters). All from `replayd`'s options (proto/components.py).
        goal_fields: (achieved, desired), the observation fields of goal-conditioned episodes that the
        Hindsight mode relabels.
        """
        _refuse_none(capacity_steps=capacity_steps, capacity_bytes=capacity_bytes)
        _expect("sampler", sampler, SamplerOptions, "Uniform() or Prioritized(alpha=...)")
        _expect("remover", remover, RemoverOptions, "Fifo() or MaxTimesSampled(k)")
        _expect("rate_limiter", rate_limiter, RateLimiterOptions, "MinSize(n) or SampleToInsertRatio(...)")
        unknown = set(observation_fields) - set(schema)
        if unknown:
            raise ValueError(f"observation_fields {sorted(unknown)} are not in the schema {sorted(schema)}")
        fields = [_field_spec(name, entry, name in observation_fields) for name, entry in schema.items()]
        achieved, desired = ("", "") if goal_fields is None else goal_fields
        config = pb.EpisodicConfig(fields=fields, capacity_steps=capacity_steps, capacity_bytes=capacity_bytes,
                                   reward_field=reward_field or "",
                                   sampler=sampler.to_proto(), remover=remover.to_proto(),
                                   rate_limiter=rate_limiter.to_proto(), achieved_goal_field=achieved,
                                   desired_goal_field=desired)
        info = _info_to_dict(self._stub.CreateBuffer(pb.CreateBufferRequest(name=name, episodic=config),
                                                     timeout=self.timeout))
        self._described[name] = info
        self._forget_sampling(name)
        self._stateful_sampling[name] = info["sampling_changes_state"]
        return info

    def delete_buffer(self, name: str) -> None:
        """Deletes a buffer and unlinks its shared memory; calls racing the delete get NOT_FOUND."""
        self._forget_sampling(name)
        self._described.pop(name, None)
        self._stub.DeleteBuffer(pb.DeleteBufferRequest(name=name), timeout=self.timeout)

    def list_buffers(self) -> list[dict[str, Any]]:
        """Every buffer of the server, each described as `describe` does."""
        response = self._idempotent(self._stub.ListBuffers, pb.ListBuffersRequest(), None)
        return [_info_to_dict(info) for info in response.buffers]

    def describe(self, name: str, timeout: float | None = None) -> dict[str, Any]:
        """A buffer's configuration and state: kind, bytes, fields (name -> (dtype, shape, is observation)),
        capacity, stored and sampleable steps, episodes, counters, its sampler, remover and rate limiter as
        options (rollout buffers: num_steps, num_envs, gamma, gae_lambda, policy_version, missing_steps), the
        sample workers' endpoints, and whether sampling it changes it."""
        return _info_to_dict(self._idempotent(self._stub.DescribeBuffer, pb.DescribeBufferRequest(name=name),
                                              timeout))

    def observation_fields(self, buffer: str) -> tuple[str, ...]:
        """The buffer's observation fields (L + 1 rows per episode), from its description asked once."""
        return tuple(n for n, (_, _, obs) in self._description(buffer)["fields"].items() if obs)

    def _description(self, buffer: str) -> dict[str, Any]:
        """The buffer's description, asked once (what inserts need: its fields, which are compressed)."""
        if buffer not in self._described:
            self._described[buffer] = self.describe(buffer)
        return self._described[buffer]

    def _episode_span(self, buffer: str, columns: Mapping[str, np.ndarray], terminated: bool,
                      episode_id: int | None) -> Span:
        """A whole episode as a span, its compressed fields' frames checked against the schema and compressed."""
        info = self._description(buffer)
        span = episode_span(columns, terminated, self.observation_fields(buffer), episode_id)
        compressed = {name: frames for name, frames in info["frames"].items() if frames.compression}
        for name in compressed.keys() & span.columns.keys():
            dtype, shape, _ = info["fields"][name]
            column = span.columns[name]
            if column.dtype != np.dtype(dtype) or column.shape[1:] != tuple(shape):
                raise ValueError(f"insert: field {name!r} is compressed ({compressed[name].compression}): expected "
                                 f"frames of {dtype}{list(shape)}, got {column.dtype}{list(column.shape[1:])}")
        span.columns = compress_columns(span.columns, compressed)
        return span

    def create_rollout_buffer(self, name: str, num_steps: int, num_envs: int, schema: Schema,
                              gamma: float = 0.99, gae_lambda: float = 0.95) -> dict[str, Any]:
        """Creates a PPO rollout buffer of (num_steps, num_envs) cells. `schema` maps field -> (dtype, cell
        shape); reward, value, terminated, truncated and final_value are added when not listed."""
        _refuse_none(num_steps=num_steps, num_envs=num_envs, gamma=gamma, gae_lambda=gae_lambda)
        fields = [pb.FieldSpec(name=n, dtype=np.dtype(dtype).name, shape=list(shape)) for n, (dtype, shape) in
                  schema.items()]
        config = pb.RolloutConfig(fields=fields, num_steps=num_steps, num_envs=num_envs, gamma=gamma,
                                  gae_lambda=gae_lambda)
        return _info_to_dict(
            self._stub.CreateBuffer(pb.CreateBufferRequest(name=name, rollout=config), timeout=self.timeout)
        )

    # ---------------------------------------------------------------- rollouts (PPO)
    def push_rollout(self, buffer: str, policy_version: int, env_start: int, step_start: int,
                     bootstrap_value: np.ndarray | None = None, **columns: np.ndarray) -> dict[str, Any]:
        """Writes an actor's (steps, envs) part of the rollout in place. Every column is shaped
        (steps, envs, *cell); `bootstrap_value` (envs,) = V(s_T) is required when the part reaches the
        rollout's last step. A push for an older policy version fails with FAILED_PRECONDITION."""
        _refuse_none(policy_version=policy_version, env_start=env_start, step_start=step_start)
        shapes = {array.shape[:2] for array in columns.values()}
        if len(shapes) != 1:
            raise ValueError(f"push_rollout: every column needs the same (steps, envs), got {sorted(shapes)}")
        steps, envs = shapes.pop()
        flat = {name: np.ascontiguousarray(a).reshape(steps * envs, *a.shape[2:]) for name, a in columns.items()}
        request = pb.PushRolloutRequest(buffer=buffer, policy_version=policy_version, env_start=env_start,
                                        step_start=step_start, steps=codec.encode(flat), num_envs=envs)
        if bootstrap_value is not None:
            request.bootstrap = codec.encode({"value": _float32_bootstrap(bootstrap_value)})
        response = self._stub.PushRollout(request, timeout=self.timeout)
        return {"missing_steps": response.missing_steps, "rollout_complete": response.rollout_complete}

    def rollout_minibatches(self, buffer: str, minibatch_size: int, epochs: int = 1, normalize_advantages: bool = True,
                            drop_last: bool = False, seed: int | None = None,
                            timeout: float | None = None) -> BatchStream:
        """Shuffled minibatches (with `advantage` and `return`) of the complete rollout, `epochs` (>= 1) times.

        `timeout` bounds the whole stream, so it is None (no deadline) unless given: an update phase may
        take longer than any one call."""
        # protobuf takes None as "not set": False for normalize_advantages (True by default here), 0 for sizes.
        _refuse_none(minibatch_size=minibatch_size, normalize_advantages=normalize_advantages, drop_last=drop_last)
        # The wire's 0 means "not set", which the server runs as 1 epoch.
        if not is_int(epochs) or epochs < 1:
            raise ValueError(f"epochs: expected an integer >= 1, got {epochs!r}")
        request = pb.RolloutMinibatchesRequest(buffer=buffer, minibatch_size=minibatch_size, epochs=epochs,
                                               normalize_advantages=normalize_advantages, drop_last=drop_last)
        if seed is not None:
            request.seed = seed
        return BatchStream(lambda remaining: self._rollout_minibatches(request, timeout=remaining), timeout)

    def finish_rollout(self, buffer: str, next_version: int) -> dict[str, Any]:
        """Starts the next rollout under `next_version`; pushes for older versions are rejected from now on."""
        _refuse_none(next_version=next_version)
        request = pb.FinishRolloutRequest(buffer=buffer, next_version=next_version)
        return _info_to_dict(self._stub.FinishRollout(request, timeout=self.timeout))

    # ---------------------------------------------------------------- weights
    def publish_weights(self, name: str, version: int, safetensors: bytes, final: bool = False) -> bool:
        """Publishes a safetensors blob; False when the server already has this or a newer version.
        `final`: this is the last version (the learner finished); actors that fetch it stop."""
        _refuse_none(version=version, final=final)
        request = pb.PublishWeightsRequest(name=name, version=version, safetensors=safetensors, final=final)
        return self._stub.PublishWeights(request, timeout=self.timeout).accepted

    def fetch_weights(self, name: str, newer_than: int = 0) -> FetchedWeights:
        """The stored weights if their version is newer than `newer_than` (else version 0), and whether
        they are final."""
        _refuse_none(newer_than=newer_than)
        request = pb.FetchWeightsRequest(name=name, newer_than=newer_than)
        response = self._idempotent(self._stub.FetchWeights, request, None)
        return FetchedWeights(response.version, response.safetensors, response.final)

    def checkpoint(self, directory: str = "", timeout: float | None = None) -> str:
        """Has the server write every buffer to a new checkpoint in its --checkpoint-dir, or in the subdirectory
        of it named `directory` (one plain name: the server writes nowhere else); returns the checkpoint's
        manifest path (on the server)."""
        response = self._stub.Checkpoint(pb.CheckpointRequest(directory=str(directory)),
                                         timeout=self._deadline(timeout))
        return response.path

    # ---------------------------------------------------------------- inserting
    def insert(self, requests: Iterable[InsertFrame | pb.InsertRequest], timeout: float | None = None,
               retry: bool = True) -> pb.InsertResponse:
        """Streams insert requests; each is stored all-or-nothing, the response acknowledges them all.

        With `retry`, a stream that fails with UNAVAILABLE or DEADLINE_EXCEEDED is sent again whole (up to
        `retries` times, exponential backoff with jitter; `timeout` applies to each attempt): the server
        names spans by (episode_id, offset) and acknowledges those it already stored without storing them
        twice (`duplicate_spans` in the response). The requests are held in a list until the call returns.
        A stream holding a request without `span_offsets` (the server stores such spans as sent) is sent once.
        """
        if retry:
            requests = requests if isinstance(requests, list | tuple) else list(requests)
            retry = all(_names_its_spans(frame) for frame in requests)  # else a retry would store spans twice
        if not retry:
            return self._insert(iter(requests), timeout=self._deadline(timeout))
        return self._with_retries(lambda remaining: self._insert(iter(requests), timeout=remaining),
                                  self.INSERT_RETRYABLE, self._deadline(timeout), deadline_per_attempt=True)

    def insert_episode(self, buffer: str, terminated: bool, episode_id: int | None = None,
                       **columns: np.ndarray) -> int:
        """Inserts one whole episode: observation fields have L + 1 rows, step fields L rows."""
        span = self._episode_span(buffer, columns, terminated, episode_id)
        self._insert_spans(buffer, [span])
        return span.episode_id

    def insert_episodes(self, buffer: str, episodes: Sequence[Mapping[str, np.ndarray]],
                        terminated: Sequence[bool], episode_ids: Sequence[int] | None = None) -> None:
        """Inserts many whole episodes in one stream of requests of at most `max_request_bytes` (a long episode
        as chunks; see split_spans); ids are drawn when not given."""
        if len(episodes) != len(terminated):
            raise ValueError(f"{len(episodes)} episodes but {len(terminated)} terminated flags")
        ids = list(episode_ids) if episode_ids is not None else [None] * len(episodes)
        if len(ids) != len(episodes):
            raise ValueError(f"{len(episodes)} episodes but {len(ids)} episode_ids")
        spans = [self._episode_span(buffer, e, t, i) for e, t, i in zip(episodes, terminated, ids, strict=True)]
        self._insert_spans(buffer, spans)

    def _insert_spans(self, buffer: str, spans: Sequence[Span]) -> None:
        """Whole episodes in requests of at most `max_request_bytes`. The server refuses an episode longer than
        the ring (or whose compressed frames outgrow their arena) request by request, so one sent as chunks is
        checked here first: its earlier chunks would otherwise land, and evict older episodes, before a later
        one is refused."""
        chunked = [span for span in spans if span.rows > request_rows(spans, self.max_request_bytes)]
        if chunked:
            info = self.describe(buffer)
            for span in chunked:
                if span.rows > info["capacity_steps"]:
                    raise ValueError(f"insert: episode {span.episode_id} has {span.rows} rows, more than "
                                     f"capacity_steps={info['capacity_steps']} of buffer {buffer!r}; nothing was sent")
                for name, frames in span.columns.items():
                    arena = info["counters"].get(f"frames.{name}.arena_bytes")
                    if isinstance(frames, CompressedFrames) and arena is not None and frames.nbytes > arena:
                        raise ValueError(f"insert: episode {span.episode_id}'s frames of field {name!r} take "
                                         f"{frames.nbytes} bytes, more than its arena of {int(arena)} bytes in "
                                         f"buffer {buffer!r} (capacity_bytes); nothing was sent")
        self.insert(spans_requests(buffer, spans, self.max_request_bytes))

    # ---------------------------------------------------------------- sampling
    @staticmethod
    def sample_request(buffer: str, batch_size: int, mode: ModeOptions = Transitions(), seed: int | None = None,
                       include_keys: bool = False, wait: bool = False,
                       importance_beta: float = 0.0, decompress: str = "server") -> pb.SampleRequest:
        """`mode`: Transitions(n_step=..., gamma=...), Geometric(discount=...), States(), ... (validated where
        constructed). `decompress`: where compressed fields' frames are decompressed, "server" (the batch
        carries them whole) or "client" (the message carries each frame compressed once, and the client
        decompresses and stacks them as it decodes the batch: fewer bytes on the wire, and the work on the
        learner's side, in a Loader's prefetch thread)."""
        _refuse_none(batch_size=batch_size, importance_beta=importance_beta)
        _expect("mode", mode, ModeOptions, "a batch mode's options (Transitions(), Geometric(discount=...), ...)")
        if decompress not in ("server", "client"):
            raise ValueError(f"decompress: expected 'server' or 'client', got {decompress!r}")
        request = pb.SampleRequest(buffer=buffer, batch_size=batch_size, mode=mode.to_proto(),
                                   include_keys=include_keys, wait=wait, importance_beta=importance_beta,
                                   decompress=decompress)
        if seed is not None:
            request.seed = seed
        return request

    def sample(self, buffer: str, batch_size: int, mode: ModeOptions = Transitions(), *,
               timeout: float | None = None, **request_options: Any) -> dict[str, np.ndarray]:
        """One batch as read-only numpy arrays (views into the received bytes; compressed fields shipped to be
        decompressed here are fresh arrays). `request_options`: seed, include_keys, wait, importance_beta,
        decompress (see sample_request)."""
        request = self.sample_request(buffer, batch_size, mode, **request_options)
        # The first sample of a buffer asks the server about it: within the sample's timeout, which covers
        # that describe, the sample and its retries.
        give_up = _give_up(self._deadline(timeout))
        # A lost response after the server drew would count the draws twice: only side-effect-free
        # sampling is retried.
        codes = [] if self._sampling_changes_state(buffer, _left(give_up)) else list(self.RETRYABLE)

        def attempt(remaining: float | None) -> SampledMessage:
            try:
                calls, left = self._sampling_within(buffer, remaining)
                return calls.sample(request, timeout=left)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._forget_sampling(buffer)  # the retry asks the server where its workers are now
                    # The call may have drawn: retried only if the buffer, maybe created again since by another
                    # client, still samples without side effects (or the server refused it untouched).
                    if (server_retry_after(exc) is None and codes
                            and self._changes_state_or_unknown(buffer, _left(give_up))):
                        codes.clear()
                raise

        return decode_sample(self._with_retries(attempt, codes, _left(give_up)))

    def update_priorities(self, buffer: str, keys: Sequence[int] | np.ndarray,
                          priorities: Sequence[float] | np.ndarray, timeout: float | None = None) -> tuple[int, int]:
        """Sets priorities of sampled keys (batch["key"]); returns (applied, ignored_stale). Keys must be integers
        in 0..2**63 - 1 (Python or numpy ints): a float, bool or out-of-range key is refused, not cast."""
        request = pb.UpdatePrioritiesRequest(buffer=buffer, keys=_int64_keys(keys).tolist(),
                                             priorities=np.asarray(priorities, dtype=np.float64).tolist())
        response = self._stub.UpdatePriorities(request, timeout=self._deadline(timeout))
        return response.applied, response.ignored_stale

    def sample_stream(self, buffer: str, batch_size: int, mode: ModeOptions = Transitions(), num_batches: int = 0, *,
                      timeout: float | None = None, **request_options: Any) -> BatchStream:
        """Batches from one server stream; HTTP/2 flow control keeps several in flight (and, for buffers whose
        sampling counts nothing (no max_times_sampled remover, no rate limiter), the server samples the next
        batch while it sends one). Each batch is decoded without a copy: numpy views of the message.

        `num_batches=0` streams until the stream is closed (which cancels the call; any thread may close it).
        """
        _refuse_none(num_batches=num_batches)
        request = pb.SampleStreamRequest(
            request=self.sample_request(buffer, batch_size, mode, **request_options), num_batches=num_batches
        )

        def open_call(remaining: float | None) -> grpc.Call:
            calls, left = self._sampling_within(buffer, remaining)
            return calls.stream(request, timeout=left)

        return BatchStream(open_call, timeout, on_unavailable=lambda: self._forget_sampling(buffer),
                           decode=decode_sample)
