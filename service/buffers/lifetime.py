"""A buffer's lock and its deleted flag: every use of a buffer's shared memory holds the lock of a live buffer.

A call racing a delete gets NOT_FOUND, never a read of unmapped memory. `with lifetime:` is entered on
every sample, so it is a small class rather than a generator context manager (0.3 µs instead of 1.2 µs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from replayd.wire.errors import NotFound


class Lifetime:
    __slots__ = ("closed", "lock", "name")

    def __init__(self, lock: threading.Lock | threading.RLock, name: str) -> None:
        self.lock = lock
        self.name = name
        self.closed = False  # set under the lock by end()

    def __enter__(self) -> None:
        self.lock.acquire()
        if self.closed:
            self.lock.release()
            raise NotFound(f"buffer {self.name!r} was deleted")

    def __exit__(self, *exc_info: object) -> None:
        self.lock.release()

    def check(self) -> None:
        """For code that waited on a condition of the lock inside `with`: the wait released it."""
        if self.closed:
            raise NotFound(f"buffer {self.name!r} was deleted")

    def end(self, release: Callable[[], None]) -> None:
        """Waits for the call holding the lock, marks the buffer deleted and runs `release` (unmapping its
        memory) once; later calls do nothing."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            release()


class SharedReads:
    """The lock-free samples of one attached ring (a LocalReader's, a sample worker's): any number run at
    once, close() waits for those running and unmaps, and a sample after that raises NotFound. The arrays
    point into the mapping, so a sample that outlived it would read unmapped memory (a crash, not an error).
    """

    __slots__ = ("active", "closed", "condition", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.condition = threading.Condition(threading.Lock())
        self.active = 0
        self.closed = False

    def __enter__(self) -> None:
        with self.condition:
            if self.closed:
                raise NotFound(f"this reader of buffer {self.name!r} was closed")
            self.active += 1

    def __exit__(self, *exc_info: object) -> None:
        with self.condition:
            self.active -= 1
            if not self.active:
                self.condition.notify_all()

    def end(self, release: Callable[[], None]) -> None:
        """Refuses new samples, waits for the running ones and runs `release` (unmapping) once."""
        with self.condition:
            if self.closed:
                return
            self.closed = True
            while self.active:
                self.condition.wait()
            release()


class LiveBuffer:
    """What both buffer kinds expose of their Lifetime."""

    lifetime: Lifetime

    def live(self) -> Lifetime:
        """`with buffer.live():` holds the lock of a buffer that is not deleted."""
        return self.lifetime

    @property
    def closed(self) -> bool:
        return self.lifetime.closed
