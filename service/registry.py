"""The server's buffers by name. Server state lives here and in the buffers, never in globals."""

from __future__ import annotations

import threading

from replayd.server.buffers.episodic import EpisodicBuffer
from replayd.server.buffers.rollout import RolloutBuffer
from replayd.server.worker_seats import WorkerSeats
from replayd.wire.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable

Buffer = EpisodicBuffer | RolloutBuffer
# Buffers one server holds at most: each keeps 4 file descriptors open (its two segments), so without a bound
# a client creating tiny buffers would exhaust a 1024-descriptor limit at about 250 and stop new connections.
MAX_BUFFERS = 200


class BufferRegistry:
    """A server's buffers by name. `worker_seats` caps the calls that may block at once across them all."""

    def __init__(self, instance: str, worker_seats: WorkerSeats | None = None, max_buffers: int = MAX_BUFFERS) -> None:
        self.instance = instance
        self.max_buffers = max_buffers
        self.worker_seats = worker_seats or WorkerSeats()
        self._buffers: dict[str, Buffer] = {}
        self._lock = threading.Lock()
        self.closed = False  # by close(): the server is stopping

    def add(self, name: str, buffer: Buffer) -> None:
        with self._lock:
            try:
                self._check_room(name)
            except BaseException:
                buffer.close(unlink=True)
                raise
            self._buffers[name] = buffer
            if isinstance(buffer, EpisodicBuffer):  # rollout buffers never block a call
                buffer.worker_seats = self.worker_seats

    def reserve_check(self, name: str) -> None:
        """Fails fast before allocating shared memory for a name that is taken, or a buffer too many."""
        with self._lock:
            self._check_room(name)

    def _check_room(self, name: str) -> None:
        if self.closed:  # a create still running when the server stopped: its buffer must not outlive close()
            raise Unavailable(f"buffer {name!r}: the server is stopping")
        if name in self._buffers:
            raise FailedPrecondition(f"buffer {name!r} already exists")
        if len(self._buffers) >= self.max_buffers:
            raise ResourceExhausted(f"buffer {name!r}: the server holds {len(self._buffers)} buffers, its most; "
                                    "delete one first")

    def get(self, name: str) -> Buffer:
        try:
            return self._buffers[name]
        except KeyError:
            raise NotFound(f"buffer {name!r} does not exist (have: {sorted(self._buffers)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._buffers

    def episodic(self, name: str) -> EpisodicBuffer:
        buffer = self.get(name)
        if not isinstance(buffer, EpisodicBuffer):
            raise InvalidArgument(f"buffer {name!r} is a rollout buffer; this call needs an episodic one")
        return buffer

    def rollout(self, name: str) -> RolloutBuffer:
        buffer = self.get(name)
        if not isinstance(buffer, RolloutBuffer):
            raise InvalidArgument(f"buffer {name!r} is an episodic buffer; this call needs a rollout one")
        return buffer

    def delete(self, name: str) -> None:
        with self._lock:
            buffer = self._buffers.pop(name, None)
        if buffer is None:
            raise NotFound(f"buffer {name!r} does not exist")
        buffer.close(unlink=True)

    def detach(self, name: str) -> None:
        """Drops a buffer and unmaps it, leaving its shared memory in place."""
        with self._lock:
            buffer = self._buffers.pop(name)
        buffer.close(unlink=False)

    def all(self) -> list[tuple[str, Buffer]]:
        with self._lock:
            return list(self._buffers.items())

    def close(self) -> None:
        """Unlinks every buffer's shared memory (clean shutdown)."""
        with self._lock:
            self.closed = True
            buffers, self._buffers = list(self._buffers.values()), {}
        for buffer in buffers:
            buffer.close(unlink=True)
