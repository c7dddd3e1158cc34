"""Removers: which stored steps stop being sample items, besides the ring's own eviction.

An item is a step (a position with a successor, the unit every sampler draws). Removal retires the
item: it is never drawn again, but its row stays in place as data, so n-step windows and future
states of earlier steps in its episode still read it. Its row is reclaimed by the ring's eviction.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from service.errors import InvalidArgument
from service.storage.shared_arrays import ArraySpec

if TYPE_CHECKING:
    from service.buffers.episodic import EpisodicBuffer

class DrawCounts(NamedTuple):
    rows: np.ndarray  # the rows a round drew, each once
    before: np.ndarray  # their draw counts before it
    retired: int  # steps it retired


class FifoRemover:
    """First in, first out: the ring evicts its oldest whole episodes when the head needs room
    (EpisodicBuffer._evict_before); there is nothing else to remove or track."""

    name = "fifo"
    retires = False

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    def array_specs(self, capacity: int) -> list[ArraySpec]:
        return []

    def bind(self, arrays: dict[str, np.ndarray]) -> None:
        pass

    def on_rows_written(self, ring: EpisodicBuffer, lo: int, hi: int) -> None:
        pass

    def on_rows_cleared(self, ring: EpisodicBuffer, lo: int, hi: int) -> None:
        pass

    def state_of_rows(self, rows: np.ndarray) -> np.ndarray | None:
        """Per-row item state to carry when an open episode's steps move to the head (None: none kept)."""
        return None

    def restore_rows(self, ring: EpisodicBuffer, rows: np.ndarray, state: np.ndarray | None) -> None:
        """Gives moved steps, just written at `rows` as new items, the state they had (state_of_rows)."""

    def recover(self, ring: EpisodicBuffer, positions: np.ndarray) -> None:
        """After a crash, `positions` are the live rows the ring rebuilt its counts from."""

    def config(self) -> dict[str, float]:
        return {}


class MaxTimesSampledRemover(FifoRemover):
    """Reverb's MaxTimesSampled with item = step: a step sampled `max_times_sampled` times is retired.

    A per-row counter in shared memory counts draws. Retired rows read as holes to the samplers
    (EpisodicBuffer.episode_bounds) and leave the buffer's sampleable count. A batch is drawn in rounds
    (EpisodicBuffer.sample): a round's draws past a step's draws left are dropped and drawn again, so a
    step comes back at most max_times_sampled times, within one batch too (as Reverb retires an item
    within a batch).
    """

    name = "max_times_sampled"
    retires = True

    def __init__(self, max_times_sampled: int) -> None:
        super().__init__()
        if not isinstance(max_times_sampled, int | np.integer) or max_times_sampled < 1:
            raise InvalidArgument(f"remover.max_times_sampled must be an integer >= 1, got {max_times_sampled!r}")
        self.max_times_sampled = int(max_times_sampled)
        self.times_sampled: np.ndarray | None = None

    def array_specs(self, capacity: int) -> list[ArraySpec]:
        return [ArraySpec("remover.times_sampled", "int64", (capacity,))]

    def bind(self, arrays: dict[str, np.ndarray]) -> None:
        self.times_sampled = arrays["remover.times_sampled"]

    def on_rows_written(self, ring: EpisodicBuffer, lo: int, hi: int) -> None:
        # Rows in the range were not items before (new rows, or a last row that just got its successor).
        for row, _, length in ring._ring_pieces(lo, hi - lo):
            self.times_sampled[row:row + length] = 0

    def on_rows_cleared(self, ring: EpisodicBuffer, lo: int, hi: int) -> None:
        # The buffer has just subtracted every step of the range from its sampleable count, retired
        # ones included; those had already left it when retired, so they are given back once.
        from service.buffers.episodic import SAMPLEABLE

        for row, _, length in ring._ring_pieces(lo, hi - lo):
            counts = self.times_sampled[row:row + length]
            ring.state[SAMPLEABLE] += int(np.count_nonzero(counts >= self.max_times_sampled))
            counts.fill(0)

    def state_of_rows(self, rows: np.ndarray) -> np.ndarray:
        return self.times_sampled.take(rows)

    def restore_rows(self, ring: EpisodicBuffer, rows: np.ndarray, state: np.ndarray | None) -> None:
        # The move counted every step as a new sampleable item: the retired ones stay retired.
        from service.buffers.episodic import SAMPLEABLE

        self.times_sampled[rows] = state
        ring.state[SAMPLEABLE] -= int(np.count_nonzero(state >= self.max_times_sampled))

    def recover(self, ring: EpisodicBuffer, positions: np.ndarray) -> None:
        # The ring recounted every step of its live extents as sampleable; retired ones are not items.
        from service.buffers.episodic import SAMPLEABLE

        rows = positions % ring.capacity
        # Rows outside them hold no step: counts left there by the interrupted op (a moved episode's old
        # rows, rows a move carried counts to) would be given back to the sampleable count on eviction.
        live = np.zeros(ring.capacity, dtype=bool)
        live[rows] = True
        self.times_sampled[~live] = 0
        retired = self.times_sampled.take(rows) >= self.max_times_sampled
        ring.state[SAMPLEABLE] -= int(np.count_nonzero(retired))

    def count_draws(self, ring: EpisodicBuffer, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, DrawCounts]:
        """Counts a round's draws (in draw order) up to each step's draws left: returns (kept: a mask of the
        draws within them, retired: the positions the kept draws used up, each once, what uncount_draws needs)."""
        from service.buffers.episodic import SAMPLEABLE

        unique, inverse, draws = np.unique(positions, return_inverse=True, return_counts=True)
        # Each draw's rank among the draws of its position, in draw order.
        by_position = np.argsort(inverse, kind="stable")
        rank = np.empty(positions.size, dtype=np.int64)
        rank[by_position] = np.arange(positions.size) - np.repeat(np.cumsum(draws) - draws, draws)
        rows = unique % ring.capacity
        before = self.times_sampled.take(rows)
        kept = before[inverse] + rank < self.max_times_sampled
        after = np.minimum(before + draws, self.max_times_sampled)
        self.times_sampled[rows] = after
        retired = unique[(before < self.max_times_sampled) & (after >= self.max_times_sampled)]
        ring.state[SAMPLEABLE] -= retired.size
        self.counters["retired_steps"] += retired.size
        return kept, retired, DrawCounts(rows, before, retired.size)

    def uncount_draws(self, ring: EpisodicBuffer, counts: DrawCounts) -> None:
        """Takes back a round's count_draws (rounds in reverse order) when its batch is not served."""
        from service.buffers.episodic import SAMPLEABLE

        self.times_sampled[counts.rows] = counts.before
        ring.state[SAMPLEABLE] += counts.retired
        self.counters["retired_steps"] -= counts.retired

    def config(self) -> dict[str, float]:
        return {"max_times_sampled": float(self.max_times_sampled)}
