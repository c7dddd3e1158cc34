"""RingWriter: applies the planner's operations to the ring's shared arrays (the only process that writes).

Precomputed bounds. `row_end[row]` is the absolute position of the episode's final row, written once
when the episode closes, so a sample finds its bound in O(1) and never searches for boundaries. Rows of
open episodes hold OPEN and take their bound from the extent table (the last row landed so far); rows
that hold nothing hold HOLE. Every insert rewrites the bounds of the rows it reuses.

Commit order within an insert: rows first; a whole episode's extent record and its rows' `row_seq`, then
their bounds (a lock-free reader that reads a bound then finds the episode's record in place, even below a
head it read before the head moved back); an open episode's rows are marked OPEN before its extent's last
row covers them; counters, then the head, last. Evictions publish the new tail before they touch anything
of the extents they evict. The sampler and remover hear of rows before their bounds are published
(`_rows_written`), so whenever the writer dies, a step recovery finds published has its sampler state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np

from service.buffers.planner import Extent, Op, Spans
from service.buffers.ring import (
    ALIVE,
    EPISODES,
    HEAD,
    HOLE,
    IS_OPEN,
    NEXT_SEQ,
    OPEN,
    SAMPLEABLE,
    STORED,
    TAIL_POS,
    TAIL_SEQ,
    TERMINATED,
    EpisodicRing,
)
from service.removers import Remover
from service.samplers.base import Sampler


class RingWriter:
    """Writes rows, bounds and extents of one ring, evicting whole episodes to make room."""

    def __init__(self, ring: EpisodicRing, sampler: Sampler, remover: Remover, counters: Counter[str]) -> None:
        self.ring = ring
        self.sampler = sampler
        self.remover = remover
        self.counters = counters  # the buffer's: evictions and moves are counted there
        self.open: dict[int, Extent] = {}  # open episodes by id

    def apply(self, op: Op, columns: Mapping[str, np.ndarray], spans: Spans) -> None:
        ring = self.ring
        if op.kind == "block":
            self.evict_before(op.head_after - ring.capacity)
            self._write_block(op, columns, spans)
        elif op.kind == "open":
            self.evict_before(op.head_after - ring.capacity)
            self._write_extent_rows(op, columns, at=op.extent.start, mark_from=op.extent.start, prev_sampleable=0)
        elif op.kind == "append":
            if op.head_after > op.head_before:  # the head extent grew its room: make space for it
                self.evict_before(op.head_after - ring.capacity)
                # Cover the grown room now, while it holds only holes (as the unused part of a room does):
                # the extent's last row then never lies past the head, whenever the writer dies.
                ring.state[HEAD] = op.head_after
            old_last = int(ring.extent_last[op.extent.seq % ring.extent_slots])
            self._write_extent_rows(op, columns, at=old_last + 1, mark_from=old_last + 1,
                                    prev_sampleable=old_last - op.extent.start)
        else:
            self._move(op, columns)
        ring.state[HEAD] = op.head_after

    def _move(self, op: Op, columns: Mapping[str, np.ndarray]) -> None:
        """Copies an open episode's landed rows to the head before their old place can be evicted or reused."""
        ring, old = self.ring, op.moved_from
        landed = self.gather_positions(np.arange(old.start, old.last + 1, dtype=np.int64))
        # Its steps (all landed rows but the last) keep their draw counts and priorities.
        old_rows = np.arange(old.start, old.last, dtype=np.int64) % ring.capacity
        carried = self.remover.state_of_rows(old_rows), self.sampler.state_of_rows(old_rows)
        self.open.pop(old.episode_id)  # moving, not lost: the eviction below must not count it
        self.evict_before(op.head_after - ring.capacity)
        self.write_rows(op.extent.start, landed, 0, old.landed)
        self._write_extent_rows(op, columns, at=op.extent.start + old.landed, mark_from=op.extent.start,
                                prev_sampleable=0)
        new_rows = (op.extent.start + np.arange(old_rows.size, dtype=np.int64)) % ring.capacity
        ring.state[SAMPLEABLE] -= self.remover.restore_rows(ring, new_rows, carried[0])
        self.sampler.restore_rows(ring, new_rows, carried[1])
        ring.state[HEAD] = op.head_after
        # The old place is retired only once the new one is committed: a crash in between leaves the
        # episode alive in one place or both (recovery keeps the newest), never in neither.
        if old.seq >= int(ring.state[TAIL_SEQ]):  # unless the eviction above took it already
            self._kill_extent(old)
        self.counters["moved_open_episodes"] += 1

    def _write_block(self, op: Op, columns: Mapping[str, np.ndarray], spans: Spans) -> None:
        ring, head = self.ring, op.head_before
        self.write_rows(head, columns, op.row_lo, op.row_hi)
        rows = spans.rows[op.span_lo:op.span_hi]
        starts = head + np.concatenate([[0], np.cumsum(rows[:-1])])
        lasts = starts + rows - 1
        seq0 = int(ring.state[NEXT_SEQ])
        seqs = np.arange(seq0, seq0 + len(rows), dtype=np.int64)
        # The rows' bounds last: the head does not publish these rows to every reader, as it moves back when
        # the head episode closes and gives up unused room, so a reader may hold a head past them already.
        # One that reads a bound then finds the rows' extents (id, how they ended) in place.
        self.set_ring(ring.row_seq, head, np.repeat(seqs, rows))
        slots = seqs % ring.extent_slots
        ring.extent_episode_id[slots] = spans.episode_ids[op.span_lo:op.span_hi]
        ring.extent_start[slots] = starts
        ring.extent_last[slots] = lasts
        ring.extent_flags[slots] = ALIVE | np.where(spans.terminated[op.span_lo:op.span_hi], TERMINATED, 0)
        bounds = np.repeat(lasts, rows)
        self._rows_written(head, head + int(rows.sum()), bounds)
        self.set_ring(ring.row_end, head, bounds)
        ring.state[NEXT_SEQ] = seq0 + len(rows)
        ring.state[EPISODES] += len(rows)
        ring.state[SAMPLEABLE] += int(rows.sum()) - len(rows)
        ring.state[STORED] += int(rows.sum())

    def _write_extent_rows(self, op: Op, columns: Mapping[str, np.ndarray], at: int, mark_from: int,
                           prev_sampleable: int) -> None:
        """Writes a chunk at position `at`, then the bounds of rows [mark_from, last], then the extent record."""
        ring, extent = self.ring, op.extent
        self.write_rows(at, columns, op.row_lo, op.row_hi)
        slot = extent.seq % ring.extent_slots
        if op.kind != "append":  # a new extent record (opened, or moved to the head)
            ring.extent_episode_id[slot] = extent.episode_id
            ring.extent_start[slot] = extent.start
            ring.state[NEXT_SEQ] = extent.seq + 1
        marked = extent.last + 1 - mark_from
        self.set_ring(ring.row_seq, mark_from, np.full(marked, extent.seq, dtype=np.int64))
        # The previous last row and the new rows but the last become steps once the last row is published.
        self._rows_written(max(extent.start, mark_from - 1), extent.last + 1, extent.last)
        if op.closes:
            # How it ended first: a reader that sees a row's final bound also sees that. Then the bounds,
            # then the extent's last row: a lock-free reader that saw a row OPEN and then this last row
            # finds the row's bound changed when it checks its batch (bounds_kept), and draws again.
            ring.extent_flags[slot] = ALIVE | (TERMINATED if op.terminated else 0)
            self.set_ring(ring.row_end, extent.start, np.full(extent.landed, extent.last))
            ring.extent_last[slot] = extent.last
        else:
            # New rows carry OPEN before the extent's last row moves over them, so readers see them whole.
            self.set_ring(ring.row_end, mark_from, np.full(marked, OPEN, dtype=np.int64))
            ring.extent_last[slot] = extent.last
            ring.extent_flags[slot] = ALIVE | IS_OPEN
        # Every landed row but the last has its successor, so it is sampleable.
        ring.state[SAMPLEABLE] += (extent.last - extent.start) - prev_sampleable
        ring.state[STORED] += marked
        if op.closes:
            self.open.pop(extent.episode_id, None)
            ring.state[EPISODES] += 1
        else:
            self.open[extent.episode_id] = extent

    def _kill_extent(self, extent: Extent) -> None:
        """Turns a moved-away extent into holes (its rows were copied to the head)."""
        ring = self.ring
        ring.extent_flags[extent.seq % ring.extent_slots] = 0
        self.set_ring(ring.row_end, extent.start, np.full(extent.landed, HOLE, dtype=np.int64))
        self.set_ring(ring.row_seq, extent.start, np.full(extent.landed, -1, dtype=np.int64))
        ring.state[SAMPLEABLE] -= extent.landed - 1
        ring.state[STORED] -= extent.landed
        self._rows_cleared(extent.start, extent.last + 1)

    def evict_before(self, boundary: int) -> None:
        """Evicts, oldest first, every extent that starts before `boundary` (whole episodes only)."""
        ring = self.ring
        tail_seq, next_seq = int(ring.state[TAIL_SEQ]), int(ring.state[NEXT_SEQ])
        if next_seq == tail_seq:  # empty ring: the next extent starts at the head
            ring.state[TAIL_POS] = ring.head
            return
        n = self._count_starts_before(tail_seq % ring.extent_slots, next_seq - tail_seq, boundary)
        if n == 0:
            return
        starts, slots = ring.extent_start, ring.extent_slots
        tail_pos = int(starts[tail_seq % slots])
        new_tail_seq = tail_seq + n
        new_tail_pos = ring.head if new_tail_seq == next_seq else int(starts[new_tail_seq % slots])
        # Publish the new tail before touching anything of the evicted extents: a reader that saw any of
        # the changes below then also sees the tail past its positions, and draws again.
        ring.state[TAIL_POS] = new_tail_pos
        ring.state[TAIL_SEQ] = new_tail_seq
        self._forget_extents((tail_seq + np.arange(n)) % ring.extent_slots)
        self.set_ring(ring.row_end, tail_pos, np.full(new_tail_pos - tail_pos, HOLE, dtype=np.int64))
        self.set_ring(ring.row_seq, tail_pos, np.full(new_tail_pos - tail_pos, -1, dtype=np.int64))
        self._rows_cleared(tail_pos, new_tail_pos)

    def _forget_extents(self, slots: np.ndarray) -> None:
        """Takes evicted extents off the ring's counts and the open episodes, and clears their records."""
        ring = self.ring
        flags = ring.extent_flags[slots]
        alive = (flags & ALIVE) != 0
        is_open = (flags & IS_OPEN) != 0
        starts, lasts = ring.extent_start[slots], ring.extent_last[slots]
        ring.state[EPISODES] -= int(np.count_nonzero(alive & ~is_open))
        ring.state[SAMPLEABLE] -= int((lasts - starts)[alive].sum())
        ring.state[STORED] -= int((lasts - starts + 1)[alive].sum())
        for episode_id in ring.extent_episode_id[slots[alive & is_open]]:
            if self.open.pop(int(episode_id), None) is not None:
                self.counters["evicted_open_episodes"] += 1
        self.counters["evicted_episodes"] += int(np.count_nonzero(alive & ~is_open))
        ring.extent_flags[slots] = 0

    def _rows_written(self, lo: int, hi: int, bounds: np.ndarray | int) -> None:
        """Positions [lo, hi) are about to get these bounds (their episode's final row, or last landed row
        while open). Called before the bounds are stored."""
        self.remover.on_rows_written(self.ring, lo, hi)
        self.sampler.on_rows_written(self.ring, lo, hi, bounds)

    def _rows_cleared(self, lo: int, hi: int) -> None:
        # The range was just taken off the sampleable count whole; retired steps had left it already.
        self.ring.state[SAMPLEABLE] += self.remover.on_rows_cleared(self.ring, lo, hi)
        self.sampler.on_rows_cleared(self.ring, lo, hi)

    def _count_starts_before(self, first: int, live: int, boundary: int) -> int:
        # Extent starts increase with seq, so the ring of starts is two sorted runs.
        starts, slots = self.ring.extent_start, self.ring.extent_slots
        end = first + live
        if end <= slots:
            return int(np.searchsorted(starts[first:end], boundary, side="left"))
        head_run = starts[first:]
        n = int(np.searchsorted(head_run, boundary, side="left"))
        if n < len(head_run):
            return n
        return n + int(np.searchsorted(starts[: end - slots], boundary, side="left"))

    # ------------------------------------------------------------------ ring helpers
    def set_ring(self, array: np.ndarray, pos: int, values: np.ndarray) -> None:
        for row, offset, length in self.ring.pieces(pos, len(values)):
            array[row:row + length] = values[offset:offset + length]

    def write_rows(self, pos: int, columns: Mapping[str, np.ndarray], lo: int, hi: int) -> None:
        for row, offset, length in self.ring.pieces(pos, hi - lo):
            for name, target in self.ring.columns.items():
                target[row:row + length] = columns[name][lo + offset:lo + offset + length]

    def gather_positions(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        rows = positions % self.ring.capacity
        return {name: column[rows] for name, column in self.ring.columns.items()}
