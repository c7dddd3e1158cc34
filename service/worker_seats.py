"""WorkerSeats: how many of a server's gRPC worker threads long calls may hold at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from replayd.wire.errors import Unavailable


class WorkerSeats:
    """Caps the calls that may hold one of a server's gRPC worker threads for long, in two pools: calls
    blocked on a rate limiter or waiting for data (`waits`), and open server streams (`streams`: sample
    streams, rollout minibatches).

    Were every worker held so (more actors held back by a rate limiter than the server has workers, or
    open streams beside them), the sample that would release them could never be served. Separate pools
    keep a learner's stream able to open however many inserts wait, and the workers outside both pools
    free for short calls. A call that would take a seat while its pool is full fails at once with
    UNAVAILABLE and a retry-after hint instead (clients retry it until its deadline). A thread counts
    once: one holding a seat takes no second one when it waits (a stream's own samples), nor does a
    thread working for it (`lend`). None: no cap (in-process use).
    """

    RETRY_AFTER_MS = 100

    def __init__(self, waits: int | None = None, streams: int | None = None) -> None:
        for name, cap in (("waits", waits), ("streams", streams)):
            if cap is not None and cap < 1:
                raise ValueError(f"{name}: expected >= 1 or None, got {cap}")
        self.caps = {"waits": waits, "streams": streams}
        self.taken = {"waits": 0, "streams": 0}
        self._lock = threading.Lock()
        self._held = threading.local()  # .count: seats (or lent seats) the current thread is inside

    @classmethod
    def for_workers(cls, max_workers: int) -> WorkerSeats:
        """A quarter of the workers (at least one) stays free for short calls; the rest is split in two."""
        long_calls = max_workers - max(1, max_workers // 4)
        if long_calls < 2:
            raise ValueError(f"max_workers: expected >= 3, got {max_workers}")
        return cls(waits=long_calls - long_calls // 2, streams=long_calls // 2)

    def wait_seat(self, what: str) -> AbstractContextManager[None]:
        return self._seat("waits", what)

    def stream_seat(self, what: str) -> AbstractContextManager[None]:
        return self._seat("streams", what)

    @contextmanager
    def _seat(self, pool: str, what: str) -> Iterator[None]:
        """Holds a seat of `pool` for the duration (none if this thread holds one); `what` names the call."""
        if getattr(self._held, "count", 0):
            with self.lend():
                yield
            return
        with self._lock:
            cap = self.caps[pool]
            if cap is not None and self.taken[pool] >= cap:
                kind = "open streams" if pool == "streams" else "calls waiting on rate limiters or for data"
                raise Unavailable(
                    f"{what}: the server is busy: {self.taken[pool]} {kind} hold worker threads, the most it "
                    f"allows so that workers stay free for the calls that release them; retry later, or start "
                    f"the server with more --max-workers",
                    retry_after_ms=self.RETRY_AFTER_MS,
                )
            self.taken[pool] += 1
        try:
            with self.lend():
                yield
        finally:
            with self._lock:
                self.taken[pool] -= 1

    @contextmanager
    def lend(self) -> Iterator[None]:
        """Marks the current thread as working under a seat taken elsewhere (e.g. a stream's producer)."""
        self._held.count = getattr(self._held, "count", 0) + 1
        try:
            yield
        finally:
            self._held.count -= 1
