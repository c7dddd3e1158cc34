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

Frames of compressed fields are written with their rows: the bytes into the arena, then the rows' offsets and
lengths, then the arena's head; an op first evicts every extent whose first frame its bytes would overwrite
(arena.py), which publishes the tail before any byte of an evicted episode is overwritten, so a lock-free
reader's tail check also proves the frames of its batch whole.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping

import numpy as np

from replayd.server.buffers.arena import ARENA_HEAD, ARENA_STORED, Arena
from replayd.server.buffers.planner import Extent, Op, Spans
from replayd.server.buffers.ring import (
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
from replayd.server.buffers.stacking import frames_of
from replayd.server.removers import Remover
from replayd.server.samplers.base import Sampler
from replayd.wire.frame_fields import CompressedFrames

Columns = Mapping[str, np.ndarray | CompressedFrames]


class RingWriter:
    """Writes rows, bounds and extents of one ring, evicting whole episodes to make room."""

    def __init__(self, ring: EpisodicRing, sampler: Sampler, remover: Remover, counters: Counter[str]) -> None:
        self.ring = ring
        self.sampler = sampler
        self.remover = remover
        self.counters = counters  # the buffer's: evictions and moves are counted there
        self.open: dict[int, Extent] = {}  # open episodes by id

    def apply(self, op: Op, columns: Columns, spans: Spans) -> None:
        ring = self.ring
        if op.kind == "block":
            self.evict_before(op.head_after - ring.capacity, self._below(op))
            self._write_block(op, columns, spans)
        elif op.kind == "open":
            self.evict_before(op.head_after - ring.capacity, self._below(op))
            self._write_extent_rows(op, columns, at=op.extent.start, mark_from=op.extent.start, prev_sampleable=0)
        elif op.kind == "append":
            # In its room the rows need no eviction (what lies below the head less the capacity is evicted
            # already), its frames may.
            self.evict_before(op.head_after - ring.capacity, self._below(op))
            if op.head_after > op.head_before:  # the head extent grew its room
                # Cover the grown room now, while it holds only holes (as the unused part of a room does):
                # the extent's last row then never lies past the head, whenever the writer dies.
                ring.state[HEAD] = op.head_after
            old_last = int(ring.extent_last[op.extent.seq % ring.extent_slots])
            self._write_extent_rows(op, columns, at=old_last + 1, mark_from=old_last + 1,
                                    prev_sampleable=old_last - op.extent.start)
        else:
            self._move(op, columns)
        ring.state[HEAD] = op.head_after

    def _below(self, op: Op) -> tuple[int, ...]:
        """Per arena, the absolute byte position below which the op's frames overwrite what is there."""
        return tuple(after - arena.size for after, arena in zip(op.arena_after, self.ring.arenas.values(), strict=True))

    def _move(self, op: Op, columns: Columns) -> None:
        """Copies an open episode's landed rows (and frames) to the head before their old place can be evicted
        or reused."""
        ring, old = self.ring, op.moved_from
        landed = self.gather_positions(np.arange(old.start, old.last + 1, dtype=np.int64))
        # Its steps (all landed rows but the last) keep their draw counts and priorities.
        old_rows = np.arange(old.start, old.last, dtype=np.int64) % ring.capacity
        carried = self.remover.state_of_rows(old_rows), self.sampler.state_of_rows(old_rows)
        self.open.pop(old.episode_id)  # moving, not lost: the eviction below must not count it
        self.evict_before(op.head_after - ring.capacity, self._below(op))
        self.write_rows(op.extent.start, landed, 0, old.landed, tuple(o[:old.landed] for o in op.frame_offsets))
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

    def _write_block(self, op: Op, columns: Columns, spans: Spans) -> None:
        ring, head = self.ring, op.head_before
        self.write_rows(head, columns, op.row_lo, op.row_hi, op.frame_offsets)
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

    def _write_extent_rows(self, op: Op, columns: Columns, at: int, mark_from: int, prev_sampleable: int) -> None:
        """Writes a chunk at position `at`, then the bounds of rows [mark_from, last], then the extent record."""
        ring, extent = self.ring, op.extent
        chunk = op.row_hi - op.row_lo  # the op's last frames (a move writes the landed ones first)
        self.write_rows(at, columns, op.row_lo, op.row_hi, tuple(o[o.size - chunk:] for o in op.frame_offsets))
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
        for arena in ring.arenas.values():
            arena.state[ARENA_STORED] -= self._frame_bytes(arena, extent.start, extent.last + 1, live_only=False)

    def evict_before(self, boundary: int, arena_boundaries: tuple[int, ...] = ()) -> None:
        """Evicts, oldest first, every extent that starts before `boundary` (whole episodes only), or whose first
        frame of a compressed field lies below that field's arena boundary (absolute byte positions)."""
        ring = self.ring
        tail_seq, next_seq = int(ring.state[TAIL_SEQ]), int(ring.state[NEXT_SEQ])
        if next_seq == tail_seq:  # empty ring: the next extent starts at the head
            ring.state[TAIL_POS] = ring.head
            return
        n = self._count_starts_before(tail_seq % ring.extent_slots, next_seq - tail_seq, boundary)
        for arena, below in zip(ring.arenas.values(), arena_boundaries, strict=True):
            n = max(n, self._count_frames_before(arena, tail_seq, next_seq, below))
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
        for arena in ring.arenas.values():  # the evicted episodes' frames (rows of killed extents hold none)
            arena.state[ARENA_STORED] -= self._frame_bytes(arena, tail_pos, new_tail_pos, live_only=True)
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

    def _count_frames_before(self, arena: Arena, tail_seq: int, next_seq: int, boundary: int) -> int:
        """Live extents whose first frame lies below `boundary`: first frames increase with extent numbers."""
        ring = self.ring
        first_frame = lambda seq: int(arena.offset[ring.extent_start[seq % ring.extent_slots] % ring.capacity])  # noqa: E731
        return bisect.bisect_left(range(tail_seq, next_seq), boundary, key=first_frame)

    def _frame_bytes(self, arena: Arena, lo: int, hi: int, live_only: bool) -> int:
        """Bytes of the frames of positions [lo, hi), or of those a live episode holds (row_seq set)."""
        total = 0
        for row, _, length in self.ring.pieces(lo, hi - lo) if hi > lo else ():
            lengths = arena.length[row:row + length]
            total += int(lengths[self.ring.row_seq[row:row + length] >= 0].sum() if live_only else lengths.sum())
        return total

    # ------------------------------------------------------------------ ring helpers
    def set_ring(self, array: np.ndarray, pos: int, values: np.ndarray) -> None:
        for row, offset, length in self.ring.pieces(pos, len(values)):
            array[row:row + length] = values[offset:offset + length]

    def write_rows(self, pos: int, columns: Columns, lo: int, hi: int, frame_offsets: tuple[np.ndarray, ...] = ()
                   ) -> None:
        """Rows [lo, hi) of `columns` at positions from `pos`; the compressed fields' frames at `frame_offsets`
        of their arenas (one array per arena: the planner's)."""
        for row, offset, length in self.ring.pieces(pos, hi - lo):
            for name, target in self.ring.columns.items():
                target[row:row + length] = columns[name][lo + offset:lo + offset + length]
        for arena, offsets in zip(self.ring.arenas.values(), frame_offsets, strict=True):
            self._write_frames(arena, pos, columns[arena.field.name][lo:hi], offsets)

    def _write_frames(self, arena: Arena, pos: int, frames: CompressedFrames, offsets: np.ndarray) -> None:
        """The frames' bytes at their offsets (back to back but where a frame skips the arena's end), then the
        rows' offsets and lengths, then the arena's head."""
        if len(frames) == 0:
            return
        size, lengths = arena.size, frames.lengths
        # Runs of frames that lie back to back in the arena, within one lap of it: one copy each.
        apart = (offsets[1:] != offsets[:-1] + lengths[:-1]) | (offsets[1:] // size != offsets[:-1] // size)
        breaks = np.flatnonzero(apart) + 1
        for lo, hi in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(frames)]]), strict=True):
            start, source = int(offsets[lo] % size), frames.data[frames.starts[lo]:frames.starts[hi]]
            arena.data[start:start + source.size] = source
        self.set_ring(arena.offset, pos, offsets)
        self.set_ring(arena.length, pos, lengths.astype(np.int32))
        arena.state[ARENA_STORED] += int(lengths.sum())
        arena.state[ARENA_HEAD] = int(offsets[-1] + lengths[-1])

    def gather_positions(self, positions: np.ndarray) -> dict[str, np.ndarray | CompressedFrames]:
        """The rows (and compressed frames) of `positions`, copied out of the ring."""
        rows = positions % self.ring.capacity
        gathered: dict[str, np.ndarray | CompressedFrames] = {
            name: column[rows] for name, column in self.ring.columns.items()}
        for name, arena in self.ring.arenas.items():
            gathered[name] = frames_of(arena, rows)
        return gathered

