"""CallEnd: the event a waiting call watches to stop when its RPC ends (cancelled, or finished)."""

from __future__ import annotations

from replayd.server.grpc_server.servicer import CallEnd


class _Context:
    """What CallEnd uses of a grpc.ServicerContext: add_callback, which returns False (and never calls the
    callback) when the call has ended already."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.callbacks: list = []

    def add_callback(self, callback) -> bool:
        if self.active:
            self.callbacks.append(callback)
        return self.active


class _Buffer:
    def __init__(self) -> None:
        self.wakes = 0

    def wake_waiters(self) -> None:
        self.wakes += 1


def test_a_call_that_ended_before_its_wait_began_is_seen_as_ended() -> None:
    """gRPC never runs a callback added after the call ended: the event must be set at once, or a wait on it
    would hold its worker until the deadline."""
    assert CallEnd(_Context(active=False)).event.is_set()


def test_the_end_of_a_call_sets_its_event_and_wakes_its_buffers_once_each() -> None:
    context, buffer = _Context(active=True), _Buffer()
    ended = CallEnd(context)
    assert ended.on(buffer) is ended.event and ended.on(buffer) is ended.event
    assert not ended.event.is_set() and len(context.callbacks) == 1
    context.callbacks[0]()  # gRPC: the call ended
    assert ended.event.is_set() and buffer.wakes == 1
