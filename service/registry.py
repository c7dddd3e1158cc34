"""The server's buffers by name. Server state lives here and in the buffers, never in globals."""

from __future__ import annotations

import threading

from service.buffers.episodic import EpisodicBuffer
from service.errors import FailedPrecondition, NotFound


class BufferRegistry:
    def __init__(self, instance: str) -> None:
        self.instance = instance
        self._buffers: dict[str, EpisodicBuffer] = {}
        self._lock = threading.Lock()

    def add(self, buffer: EpisodicBuffer) -> None:
        with self._lock:
            if buffer.name in self._buffers:
                buffer.close()
                raise FailedPrecondition(f"buffer {buffer.name!r} already exists")
            self._buffers[buffer.name] = buffer

    def reserve_check(self, name: str) -> None:
        """Fails fast before allocating shared memory for a name that is taken."""
        with self._lock:
            if name in self._buffers:
                raise FailedPrecondition(f"buffer {name!r} already exists")

    def get(self, name: str) -> EpisodicBuffer:
        try:
            return self._buffers[name]
        except KeyError:
            raise NotFound(f"buffer {name!r} does not exist (have: {sorted(self._buffers)})") from None

    def delete(self, name: str) -> None:
        with self._lock:
            buffer = self._buffers.pop(name, None)
        if buffer is None:
            raise NotFound(f"buffer {name!r} does not exist")
        buffer.close(unlink=True)

    def all(self) -> list[EpisodicBuffer]:
        with self._lock:
            return list(self._buffers.values())

    def close(self) -> None:
        """Unlinks every buffer's shared memory (clean shutdown)."""
        with self._lock:
            buffers, self._buffers = list(self._buffers.values()), {}
        for buffer in buffers:
            buffer.close(unlink=True)
