"""Removers: which stored steps stop being sample items, besides the ring's own eviction.

An item is a step (a position with a successor, the unit every sampler draws). Removal retires the
item: it is never drawn again, but its row stays in place as data, so n-step windows and future
states of earlier steps in its episode still read it. Its row is reclaimed by the ring's eviction.

A remover keeps its per-row state in arrays of the buffer's shared memory and returns what it decides;
the writer applies it to the ring's counts (each hook below that changes which steps are items returns
how many sampleable steps that takes from, or gives back to, the ring).
"""

from __future__ import annotations

from abc import ABC
from collections import Counter
from typing import NamedTuple

import numpy as np

from replayd.server.buffers.ring import NOTHING_RETIRED, EpisodicRing, Retired
from replayd.server.configured import Configured
from replayd.server.storage.shared_arrays import ArraySpec
from replayd.wire.components import Fifo, MaxTimesSampled, RemoverOptions


class DrawCounts(NamedTuple):
    rows: np.ndarray  # the rows a round drew, each once
    before: np.ndarray  # their draw counts before it
    retired: int  # steps it retired


class CountedDraws(NamedTuple):
    """What counting a round's draws decided."""

    kept: np.ndarray  # mask of the draws within their steps' draws left
    retired: np.ndarray  # positions the kept draws used up, each once (no longer items)
    counts: DrawCounts  # what uncount_draws needs to take the round back


class Remover(Configured, ABC):
    options: RemoverOptions

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    @property
    def retires(self) -> bool:
        return self.options.retires

    def array_specs(self, capacity: int) -> list[ArraySpec]:
        return []

    def bind(self, arrays: dict[str, np.ndarray]) -> None:
        """Takes the arrays named by array_specs (new, or holding its state already)."""

    def retired(self) -> Retired:
        """What the bound lookup reads to treat retired steps as holes."""
        return NOTHING_RETIRED

    def on_rows_written(self, ring: EpisodicRing, lo: int, hi: int) -> None:
        """Positions [lo, hi) become items (new rows, or a last row that just got its successor)."""

    def on_rows_cleared(self, ring: EpisodicRing, lo: int, hi: int) -> int:
        """Positions [lo, hi) stop holding steps; returns the retired ones among them, which had left the
        ring's sampleable count already (the writer gives them back once, as it takes the whole range off)."""
        return 0

    def state_of_rows(self, rows: np.ndarray) -> np.ndarray | None:
        """Per-row item state to carry when an open episode's steps move to the head (None: none kept)."""
        return None

    def restore_rows(self, ring: EpisodicRing, rows: np.ndarray, state: np.ndarray | None) -> int:
        """Gives moved steps, just written at `rows` as new items, the state they had (state_of_rows);
        returns how many of them stay retired (no items)."""
        return 0

    def recover(self, ring: EpisodicRing, positions: np.ndarray) -> int:
        """After a crash, `positions` are the live rows the ring rebuilt its counts from; returns how many
        of them are retired steps (no items)."""
        return 0

    def count_draws(self, ring: EpisodicRing, positions: np.ndarray) -> CountedDraws:
        """Counts a round's draws (in draw order) up to each step's draws left; a remover that retires
        nothing keeps them all."""
        none = np.empty(0, dtype=np.int64)
        return CountedDraws(np.ones(positions.size, dtype=bool), none, DrawCounts(none, none, 0))

    def uncount_draws(self, counts: DrawCounts) -> None:
        """Takes back a round's count_draws (rounds in reverse order) when its batch is not served."""


class FifoRemover(Remover):
    """First in, first out: the ring evicts its oldest whole episodes when the head needs room
    (service/buffers/writer.py); there is nothing else to remove or track."""

    def __init__(self) -> None:
        super().__init__()
        self.options = Fifo()


class MaxTimesSampledRemover(Remover):
    """Reverb's MaxTimesSampled with item = step: a step sampled `max_times_sampled` times is retired.

    A per-row counter in shared memory counts draws. Retired rows read as holes to the samplers (the bound
    lookup reads the counter) and leave the buffer's sampleable count. A batch is drawn in rounds
    (EpisodicBuffer.sample): a round's draws past a step's draws left are dropped and drawn again, so a
    step comes back at most max_times_sampled times, within one batch too (as Reverb retires an item
    within a batch).
    """

    def __init__(self, max_times_sampled: int) -> None:
        super().__init__()
        self.options = MaxTimesSampled(max_times_sampled)
        self.max_times_sampled = self.options.max_times_sampled
        self.times_sampled: np.ndarray | None = None

    def array_specs(self, capacity: int) -> list[ArraySpec]:
        return [ArraySpec("remover.times_sampled", "int64", (capacity,))]

    def bind(self, arrays: dict[str, np.ndarray]) -> None:
        self.times_sampled = arrays["remover.times_sampled"]

    def retired(self) -> Retired:
        return Retired(self.times_sampled, self.max_times_sampled)

    def on_rows_written(self, ring: EpisodicRing, lo: int, hi: int) -> None:
        # Rows in the range were not items before (new rows, or a last row that just got its successor).
        for row, _, length in ring.pieces(lo, hi - lo):
            self.times_sampled[row:row + length] = 0

    def on_rows_cleared(self, ring: EpisodicRing, lo: int, hi: int) -> int:
        given_back = 0
        for row, _, length in ring.pieces(lo, hi - lo):
            counts = self.times_sampled[row:row + length]
            given_back += int(np.count_nonzero(counts >= self.max_times_sampled))
            counts.fill(0)
        return given_back

    def state_of_rows(self, rows: np.ndarray) -> np.ndarray:
        return self.times_sampled.take(rows)

    def restore_rows(self, ring: EpisodicRing, rows: np.ndarray, state: np.ndarray | None) -> int:
        self.times_sampled[rows] = state
        return int(np.count_nonzero(state >= self.max_times_sampled))

    def recover(self, ring: EpisodicRing, positions: np.ndarray) -> int:
        rows = positions % ring.capacity
        # Rows outside them hold no step: counts left there by the interrupted op (a moved episode's old
        # rows, rows a move carried counts to) would be given back to the sampleable count on eviction.
        live = np.zeros(ring.capacity, dtype=bool)
        live[rows] = True
        self.times_sampled[~live] = 0
        return int(np.count_nonzero(self.times_sampled.take(rows) >= self.max_times_sampled))

    def count_draws(self, ring: EpisodicRing, positions: np.ndarray) -> CountedDraws:
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
        self.counters["retired_steps"] += retired.size
        return CountedDraws(kept, retired, DrawCounts(rows, before, retired.size))

    def uncount_draws(self, counts: DrawCounts) -> None:
        self.times_sampled[counts.rows] = counts.before
        self.counters["retired_steps"] -= counts.retired
