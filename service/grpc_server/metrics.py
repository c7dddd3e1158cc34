"""Per-RPC Prometheus metrics of one server: latency histograms and payload byte counters.

Registered in the server's own CollectorRegistry (ReplayServer.metrics, no globals) and observed by the
servicer's `rpc`/`stream_rpc` decorators. Labels: `method` and `buffer`, the buffer the request names
(empty for calls that name none, or a buffer that does not exist when the call ends: a client must not be
able to create series at will, and a deleted buffer's series are dropped).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from replayd.wire import replay_pb2 as pb
from replayd.wire.frames import InsertFrame

# 10 µs .. 10 s, about three per decade: a local Sample takes tens of µs, a blocked one up to its deadline.
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
LABELS = ("method", "buffer")


def buffer_of(request: object) -> str:
    """The buffer a request names ('' if none)."""
    if isinstance(request, InsertFrame):
        return request.request.buffer
    if isinstance(request, pb.SampleStreamRequest):
        return request.request.buffer
    if isinstance(request, pb.CreateBufferRequest | pb.DeleteBufferRequest | pb.DescribeBufferRequest):
        return request.name
    return getattr(request, "buffer", "")


def request_bytes(request: object) -> int:
    """Payload bytes of a request: insert steps, rollout steps (+ bootstrap values), published weights."""
    if isinstance(request, InsertFrame):
        return len(request.steps)
    if isinstance(request, pb.PushRolloutRequest):
        return len(request.steps) + len(request.bootstrap)
    if isinstance(request, pb.PublishWeightsRequest):
        return len(request.safetensors)
    return 0


def response_bytes(response: object) -> int:
    """Payload bytes of a response: sampled batches and minibatches (sent as bytes), fetched weights."""
    if isinstance(response, bytes | memoryview):
        return len(response)
    if isinstance(response, pb.FetchWeightsResponse):
        return len(response.safetensors)
    return 0


class RpcMetrics:
    """`known(name)`: whether a buffer of that name exists now (decides the `buffer` label of failed calls)."""

    def __init__(self, registry: CollectorRegistry, known: Callable[[str], bool]) -> None:
        self.known = known
        self.latency = Histogram(
            "replayd_rpc_latency_seconds", "RPC latency: the whole call (for streams, first request to last message)",
            LABELS, registry=registry, buckets=LATENCY_BUCKETS)
        self.message_latency = Histogram(
            "replayd_rpc_stream_message_seconds", "Server-streaming RPCs: time to produce each message",
            LABELS, registry=registry, buckets=LATENCY_BUCKETS)
        self.received = Counter("replayd_rpc_received_bytes", "Payload bytes received (insert and rollout steps, "
                                "published weights)", LABELS, registry=registry)
        self.sent = Counter("replayd_rpc_sent_bytes", "Payload bytes sent (sampled batches, minibatches, fetched "
                            "weights)", LABELS, registry=registry)
        self._children: dict[tuple[Histogram | Counter, str, str], Histogram | Counter] = {}
        # Calls on many threads add children while a DeleteBuffer's forget() walks them: a walk that a new
        # child interrupts raises RuntimeError (the delete then fails INTERNAL and its series stay).
        self._children_lock = threading.Lock()

    def label(self, buffer: str) -> str:
        """The `buffer` label of a call: the name of a buffer that exists when the call is observed, else ''
        (a failed call naming none, a DeleteBuffer done: deleted buffers leave no series behind)."""
        return buffer if buffer and self.known(buffer) else ""

    def _child(self, metric: Histogram | Counter, method: str, buffer: str) -> Histogram | Counter:
        """`metric.labels(method, buffer)`, cached: labels() takes a lock and a few µs on every call."""
        key = (metric, method, buffer)
        child = self._children.get(key)
        if child is None:
            with self._children_lock:
                child = self._children[key] = metric.labels(method, buffer)
        return child

    def forget(self, buffer: str) -> None:
        """Drops a deleted buffer's series: creating and deleting buffers must not grow /metrics without end."""
        with self._children_lock:
            for key in [key for key in self._children if key[2] == buffer]:
                metric, method, _ = key
                metric.remove(method, buffer)
                del self._children[key]

    def observe_latency(self, method: str, buffer: str, seconds: float) -> None:
        self._child(self.latency, method, buffer).observe(seconds)

    def observe_message(self, method: str, buffer: str, seconds: float, size: int) -> None:
        self._child(self.message_latency, method, buffer).observe(seconds)
        if size:
            self._child(self.sent, method, buffer).inc(size)

    def add_bytes(self, method: str, buffer: str, received: int, sent: int) -> None:
        if received:
            self._child(self.received, method, buffer).inc(received)
        if sent:
            self._child(self.sent, method, buffer).inc(sent)

    def add_received(self, method: str, request: object) -> None:
        self.add_bytes(method, self.label(buffer_of(request)), request_bytes(request), 0)
