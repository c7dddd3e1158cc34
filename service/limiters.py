"""Rate limiters (Reverb's MinSize and SampleToInsertRatio) for an episodic buffer.

Every buffer has one; MinSize(1), the default, holds back only the samples of an empty buffer. A limiter
decides, from the buffer's size and its own counts, whether an insert or a sample may proceed now; the
buffer does the waiting (service/buffers/episodic.py), on its condition, and tells the limiter what
happened (record_insert, record_sample, waited).

Units: items, as the samplers see them. An insert adds one item per step it makes sampleable
(rows - 1 for a span that begins an episode, rows for a continuation chunk); a sample of B takes B.
size = the buffer's sampleable steps.

SampleToInsertRatio:

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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from replayd.server.configured import Configured
from replayd.wire.components import MinSize, RateLimiterOptions, SampleToInsertRatio
from replayd.wire.errors import InvalidArgument

SIDES = ("insert", "sample")


class RateLimiter(Configured, ABC):
    options: RateLimiterOptions
    min_size_to_sample: int

    def __init__(self) -> None:
        self.insert_waits = self.sample_waits = 0  # waits that ended, by side
        self.insert_wait_seconds = self.sample_wait_seconds = 0.0
        self.insert_waiting = self.sample_waiting = 0  # calls held back right now

    @property
    def samples_change_state(self) -> bool:
        return self.options.samples_change_state

    @abstractmethod
    def insert_allowed(self, size: int, short_of_draws: bool) -> bool:
        """Whether an insert may proceed now. `short_of_draws`: a sample waits for draws that only inserts
        bring (see the module docstring)."""

    @abstractmethod
    def sample_allowed(self, size: int, batch_size: int) -> bool:
        """Whether a sample of `batch_size` may proceed now."""

    def check_batch(self, batch_size: int, buffer: str) -> None:
        """Raises InvalidArgument for a batch that could never pass (it would wait forever)."""

    def blocked_reason(self, size: int) -> str:
        """Why a sample is held back, for the error a refused or expired one gets."""
        return f"sampleable_steps={size} < min_size_to_sample={self.min_size_to_sample}"

    def insert_blocked_reason(self) -> str:
        """Why an insert is held back, for the error an expired one gets."""
        return "inserts are not held back"

    def record_insert(self, items: int) -> None:
        """An insert landed `items` new sampleable steps."""

    def record_sample(self, items: int) -> None:
        """A sample took `items` items."""

    def recover(self, sampleable_steps: int) -> None:
        """After a crash the counts are gone: start again from the buffer as it is."""

    def waiting(self, side: str, change: int, seconds: float = 0.0) -> None:
        """A call of `side` starts (+1) or ends (-1, with the seconds it waited) being held back."""
        setattr(self, f"{side}_waiting", getattr(self, f"{side}_waiting") + change)
        if change < 0:
            setattr(self, f"{side}_waits", getattr(self, f"{side}_waits") + 1)
            setattr(self, f"{side}_wait_seconds", getattr(self, f"{side}_wait_seconds") + seconds)

    _STATE: tuple[str, ...] = ("insert_waits", "sample_waits", "insert_wait_seconds", "sample_wait_seconds")

    def snapshot(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in self._STATE}

    def restore(self, state: dict[str, float]) -> None:
        for key in self._STATE:
            setattr(self, key, state[key])

    def counters(self) -> dict[str, float]:
        return {f"rate_limiter.{side}_{what}": getattr(self, f"{side}_{what}")
                for what in ("waits", "wait_seconds", "waiting") for side in SIDES}


class MinSizeLimiter(RateLimiter):
    """Samples wait for `min_size_to_sample` sampleable steps; inserts never wait, and samples change
    nothing, so lock-free readers apply it themselves."""

    def __init__(self, min_size_to_sample: int = 1) -> None:
        super().__init__()
        self.options = MinSize(min_size_to_sample)
        self.min_size_to_sample = self.options.min_size_to_sample

    def insert_allowed(self, size: int, short_of_draws: bool) -> bool:
        return True

    def sample_allowed(self, size: int, batch_size: int) -> bool:
        return size >= self.min_size_to_sample


class SampleToInsertRatioLimiter(RateLimiter):
    """Reverb's SampleToInsertRatio (see the module docstring)."""

    def __init__(self, min_size_to_sample: int = 1, samples_per_insert: float = 0.0, error_buffer: float = 0.0) -> None:
        super().__init__()
        self.options = SampleToInsertRatio(samples_per_insert, min_size_to_sample, error_buffer)
        self.min_size_to_sample = self.options.min_size_to_sample
        self.samples_per_insert = self.options.samples_per_insert
        self.error_buffer = self.options.error_buffer
        center = self.min_size_to_sample * self.samples_per_insert
        self.min_diff, self.max_diff = center - self.error_buffer, center + self.error_buffer
        self.inserts = 0
        self.samples = 0

    _STATE = ("inserts", "samples", *RateLimiter._STATE)

    @property
    def diff(self) -> float:
        return self.inserts * self.samples_per_insert - self.samples

    def insert_allowed(self, size: int, short_of_draws: bool) -> bool:
        return (size < self.min_size_to_sample or self.samples_per_insert == 0 or short_of_draws
                or self.diff + self.samples_per_insert <= self.max_diff)

    def sample_allowed(self, size: int, batch_size: int) -> bool:
        if size < self.min_size_to_sample:
            return False
        return self.samples_per_insert == 0 or self.diff - batch_size >= self.min_diff

    def check_batch(self, batch_size: int, buffer: str) -> None:
        if self.samples_per_insert > 0 and batch_size + self.samples_per_insert > self.max_diff - self.min_diff:
            raise InvalidArgument(
                f"sample: batch_size={batch_size} can never pass the rate limiter of buffer {buffer!r}: "
                f"2 * error_buffer={2 * self.error_buffer:g} must be >= batch_size + samples_per_insert"
            )

    def blocked_reason(self, size: int) -> str:
        if size < self.min_size_to_sample:
            return super().blocked_reason(size)
        return f"inserts are behind (diff={self.diff:g}, min_diff={self.min_diff:g})"

    def insert_blocked_reason(self) -> str:
        return (f"samples are behind (diff={self.diff:g} > max_diff - samples_per_insert="
                f"{self.max_diff - self.samples_per_insert:g})")

    def record_insert(self, items: int) -> None:
        self.inserts += items

    def record_sample(self, items: int) -> None:
        self.samples += items

    def recover(self, sampleable_steps: int) -> None:
        """Restarts balanced, as if the stored steps were inserted and sampled exactly at the target ratio
        (the centre of the allowed band)."""
        self.inserts = sampleable_steps
        self.samples = max(0, round(self.inserts * self.samples_per_insert
                                    - self.min_size_to_sample * self.samples_per_insert))

    def counters(self) -> dict[str, Any]:
        return {"rate_limiter.inserts": self.inserts, "rate_limiter.samples": self.samples, **super().counters(),
                "rate_limiter.diff": self.diff}
