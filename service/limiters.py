"""Reverb's rate limiter (SampleToInsertRatio / MinSize) for an episodic buffer.

Units: items, as the samplers see them. An insert adds one item per step it makes sampleable
(rows - 1 for a span that begins an episode, rows for a continuation chunk); a sample of B takes B.
size = the buffer's sampleable steps.

    diff = inserts * samples_per_insert - samples
    min_diff = min_size_to_sample * samples_per_insert - error_buffer
    max_diff = min_size_to_sample * samples_per_insert + error_buffer

A sample of B may proceed iff size >= min_size_to_sample and, with samples_per_insert > 0,
diff - B >= min_diff: samples never run ahead of the ratio by more than error_buffer.
An insert may proceed iff size < min_size_to_sample (filling up; also keeps a remover from starving
the buffer) or diff + samples_per_insert <= max_diff, i.e. its first item fits, as Reverb admits
items one by one. The rest of a multi-step insert may overshoot max_diff: inserts are whole episodes
and cannot be split, and running ahead on inserts only leaves data less reused.

No deadlock: both sides block only if max_diff - min_diff < B + samples_per_insert, so a sample with
a batch too large for error_buffer is rejected up front instead of waiting forever. With a remover that
retires steps (max_times_sampled), a sample the ratio lets through can still find fewer draws left than its
batch needs and wait for inserts: while one does, inserts may run ahead of the ratio (only they bring draws).

Blocked calls wait on the buffer's Condition (`ring.inserted`, over `ring.lock`), which releases the
buffer's lock while waiting, so the other side can proceed; the buffer notifies it after every insert
and, with a limiter, after every sample.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import numpy as np

from service.errors import Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable

if TYPE_CHECKING:
    from service.buffers.episodic import EpisodicBuffer


def call_ended(ended: threading.Event | None) -> bool:
    return ended is not None and ended.is_set()


def wait_on(ring: EpisodicBuffer, ready: Callable[[], bool], timeout: float | None, ended: threading.Event | None,
            what: str, waiting: Callable[[int], None] | None = None) -> bool:
    """Waits (releasing ring.lock, in a wait seat) until `ready()`, the ring closes or `ended` is set (the
    call was cancelled: Cancelled). False: `timeout` passed first. `waiting(+1)` / `waiting(-1)` bracket the
    wait itself (not a refusal for want of a seat). The caller checks `closed` before it touches the arrays
    again (a closed ring is unmapped)."""
    with ring.worker_seats.wait_seat(what):
        if waiting is not None:
            waiting(1)
        try:
            ok = ring.inserted.wait_for(lambda: ring.closed or call_ended(ended) or ready(), timeout=timeout)
        finally:
            if waiting is not None:
                waiting(-1)  # wait_for returns (or raises) with ring.lock held again
    if not ring.closed and call_ended(ended) and not ready():
        raise Cancelled(f"{what}: the call ended while it waited")
    return ok


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


class RateLimiter:
    def __init__(self, min_size_to_sample: int = 1, samples_per_insert: float = 0.0, error_buffer: float = 0.0) -> None:
        if not isinstance(min_size_to_sample, int | np.integer) or min_size_to_sample < 1:
            raise InvalidArgument(f"rate_limiter.min_size_to_sample must be an integer >= 1 (an empty buffer has "
                                  f"nothing to sample), got {min_size_to_sample!r}")
        if not np.isfinite(samples_per_insert) or samples_per_insert < 0:
            raise InvalidArgument(f"rate_limiter.samples_per_insert must be finite and >= 0, got {samples_per_insert}")
        if not np.isfinite(error_buffer) or error_buffer < 0:
            raise InvalidArgument(f"rate_limiter.error_buffer must be finite and >= 0, got {error_buffer}")
        if samples_per_insert > 0 and 2 * error_buffer < samples_per_insert + 1:
            raise InvalidArgument(
                f"rate_limiter.error_buffer={error_buffer} is too small for samples_per_insert={samples_per_insert}: "
                f"need 2 * error_buffer >= samples_per_insert + 1, or inserts and samples could block each other"
            )
        self.min_size_to_sample = int(min_size_to_sample)
        self.samples_per_insert = float(samples_per_insert)
        self.error_buffer = float(error_buffer)
        center = self.min_size_to_sample * self.samples_per_insert
        self.min_diff, self.max_diff = center - self.error_buffer, center + self.error_buffer
        self.inserts = 0
        self.samples = 0
        self.insert_waits = self.sample_waits = 0
        self.insert_wait_seconds = self.sample_wait_seconds = 0.0
        self.insert_waiting = self.sample_waiting = 0  # calls held back right now

    _STATE = ("inserts", "samples", "insert_waits", "sample_waits", "insert_wait_seconds", "sample_wait_seconds")

    def snapshot(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in self._STATE}

    def restore(self, state: dict[str, float]) -> None:
        for key in self._STATE:
            setattr(self, key, state[key])

    def recover(self, sampleable_steps: int) -> None:
        """After a crash the counts are gone: restart balanced, as if the stored steps were inserted and
        sampled exactly at the target ratio (the centre of the allowed band)."""
        self.inserts = sampleable_steps
        self.samples = max(0, round(self.inserts * self.samples_per_insert
                                    - self.min_size_to_sample * self.samples_per_insert))

    @property
    def diff(self) -> float:
        return self.inserts * self.samples_per_insert - self.samples

    def can_insert(self, ring: EpisodicBuffer) -> bool:
        return (ring.sampleable_steps < self.min_size_to_sample or self.samples_per_insert == 0
                or ring.samples_short_of_draws > 0 or self.diff + self.samples_per_insert <= self.max_diff)

    def can_sample(self, ring: EpisodicBuffer, batch_size: int) -> bool:
        if ring.sampleable_steps < self.min_size_to_sample or not ring.sampler.drawable(ring):
            return False
        return self.samples_per_insert == 0 or self.diff - batch_size >= self.min_diff

    # ---------------------------------------------------------------- called with ring.lock held
    def await_insert(self, ring: EpisodicBuffer, timeout: float | None, ended: threading.Event | None = None) -> None:
        """Waits (releasing ring.lock) until an insert may proceed; None = no deadline. `ended`: set when the
        call ends (its client cancelled it): the wait stops at once (Cancelled)."""
        if not self._wait(ring, lambda: self.can_insert(ring), timeout, "insert", ended):
            raise DeadlineExceeded(
                f"insert: rate limiter of buffer {ring.name!r} kept the insert waiting past its deadline "
                f"({timeout:.3g}s): samples are behind (diff={self.diff:g} > max_diff - samples_per_insert="
                f"{self.max_diff - self.samples_per_insert:g})"
            )

    def await_sample(self, ring: EpisodicBuffer, batch_size: int, timeout: float | None,
                     ended: threading.Event | None = None) -> None:
        """Waits (releasing ring.lock) until a sample may proceed; timeout None = fail at once; `ended` as in
        await_insert."""
        if self.samples_per_insert > 0 and batch_size + self.samples_per_insert > self.max_diff - self.min_diff:
            raise InvalidArgument(
                f"sample: batch_size={batch_size} can never pass the rate limiter of buffer {ring.name!r}: "
                f"2 * error_buffer={2 * self.error_buffer:g} must be >= batch_size + samples_per_insert"
            )
        if timeout is None:
            if not self.can_sample(ring, batch_size):
                raise FailedPrecondition(f"sample: rate limiter of buffer {ring.name!r} blocks it: {self._why(ring)}")
            return
        if not self._wait(ring, lambda: self.can_sample(ring, batch_size), timeout, "sample", ended):
            raise DeadlineExceeded(
                f"sample: rate limiter of buffer {ring.name!r} kept the sample waiting past its deadline "
                f"({timeout:.3g}s): {self._why(ring)}"
            )

    def _why(self, ring: EpisodicBuffer) -> str:
        if ring.sampleable_steps < self.min_size_to_sample:
            return f"sampleable_steps={ring.sampleable_steps} < min_size_to_sample={self.min_size_to_sample}"
        if not ring.sampler.drawable(ring):
            return f"none of its {ring.sampleable_steps} sampleable steps can be drawn (all priorities 0)"
        return f"inserts are behind (diff={self.diff:g}, min_diff={self.min_diff:g})"

    def _wait(self, ring: EpisodicBuffer, ready: Callable[[], bool], timeout: float | None, side: str,
              ended: threading.Event | None) -> bool:
        if ready():
            return True
        start = time.monotonic()
        # closed: wait_on returns True and the caller raises NotFound
        return wait_on(ring, ready, timeout, ended, f"{side} on buffer {ring.name!r} (held back by its rate limiter)",
                       lambda change: self._waiting(side, change, start))

    def _waiting(self, side: str, change: int, since: float) -> None:
        """The held-back gauge; a wait that ends (change -1) is counted with its length."""
        seconds = time.monotonic() - since if change < 0 else 0.0
        if side == "insert":
            self.insert_waiting += change
            self.insert_waits += int(change < 0)
            self.insert_wait_seconds += seconds
        else:
            self.sample_waiting += change
            self.sample_waits += int(change < 0)
            self.sample_wait_seconds += seconds

    def record_insert(self, items: int) -> None:
        self.inserts += items

    def record_sample(self, items: int) -> None:
        self.samples += items

    def config(self) -> dict[str, float]:
        return {"min_size_to_sample": self.min_size_to_sample, "samples_per_insert": self.samples_per_insert,
                "error_buffer": self.error_buffer}

    def counters(self) -> dict[str, float]:
        return {"rate_limiter.inserts": self.inserts, "rate_limiter.samples": self.samples,
                "rate_limiter.insert_waits": self.insert_waits, "rate_limiter.sample_waits": self.sample_waits,
                "rate_limiter.insert_wait_seconds": self.insert_wait_seconds,
                "rate_limiter.sample_wait_seconds": self.sample_wait_seconds,
                "rate_limiter.insert_waiting": self.insert_waiting, "rate_limiter.sample_waiting": self.sample_waiting,
                "rate_limiter.diff": self.diff}
