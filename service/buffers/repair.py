"""Crash repair: makes a ring consistent again after its writer died in the middle of an insert.

The committed state is what the head covers: every op writes rows, bounds and extent records, and moves
the head last (service/buffers/writer.py). Extents past the head belong to an interrupted op and are
dropped; row bounds (of every row) and counters are rebuilt from the surviving extent table; an episode
that an interrupted move left in two places keeps its newest; the sampler's and remover's per-row state is
recomputed for the live rows; each arena's head and stored bytes are rebuilt from the live rows' frames (an
interrupted op may have written frames past them, which nothing references).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replayd.server.buffers.arena import ARENA_HEAD, ARENA_STORED, Arena
from replayd.server.buffers.planner import Extent
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
    EpisodicRing,
)
from replayd.server.removers import Remover
from replayd.server.samplers.base import Sampler
from replayd.wire.errors import FailedPrecondition


@dataclass(frozen=True)
class Repaired:
    """What the writer keeps outside shared memory, rebuilt: open episodes, and the closed ones (for the
    exactly-once memory of stored spans)."""

    open: dict[int, Extent]
    closed_ids: np.ndarray
    closed_lengths: np.ndarray


@dataclass
class _Extents:
    """The live extent table as arrays (seq order)."""

    seqs: np.ndarray
    slots: np.ndarray
    starts: np.ndarray

    def keep(self, which: slice) -> None:
        self.seqs, self.slots, self.starts = self.seqs[which], self.slots[which], self.starts[which]


def repair(ring: EpisodicRing, sampler: Sampler, remover: Remover) -> Repaired:
    """Repairs `ring` in place (its writer's lock held); FailedPrecondition when it is no consistent ring."""
    head, tail_pos = _check_state(ring)
    extents = _committed_extents(ring, head, tail_pos)
    flags = ring.extent_flags[extents.slots]
    alive = (flags & ALIVE) != 0
    is_open = alive & ((flags & IS_OPEN) != 0)
    ids = ring.extent_episode_id[extents.slots]
    # A close in place sets how the episode ended, then its rows' bounds, then its last row: one killed
    # before the last row moved leaves the first row's bound off the extent's last row. The episode is
    # still open at its old last row (the client's retry closes it).
    torn = alive & ~is_open & (ring.row_end[extents.starts % ring.capacity] != ring.extent_last[extents.slots])
    ring.extent_flags[extents.slots[torn]] = ALIVE | IS_OPEN
    is_open |= torn
    # An interrupted move leaves an open episode in two extents, the newer one (open, or closed by the
    # move) complete: an open extent is stale when a newer live extent has its id.
    alive_index = np.flatnonzero(alive)
    _, first = np.unique(ids[alive_index][::-1], return_index=True)
    stale = np.setdiff1d(np.flatnonzero(is_open), alive_index[::-1][first])
    ring.extent_flags[extents.slots[stale]] = 0
    alive[stale] = is_open[stale] = False
    lasts = ring.extent_last[extents.slots]
    ends = np.append(extents.starts[1:], head)  # each extent's room reaches the next extent (or the head)
    if np.any(alive & ((lasts < extents.starts) | (lasts >= ends))):
        raise FailedPrecondition(f"recover {ring.name!r}: an extent's last row lies outside its room")
    positions, lengths = _rebuild_rows(ring, extents, alive, is_open, lasts)
    ring.state[SAMPLEABLE] -= remover.recover(ring, positions)
    sampler.recover(ring, tail_pos, head)
    for arena in ring.arenas.values():
        _rebuild_arena(ring, arena, positions % ring.capacity)
    open_extents = {int(ids[i]): _open_extent(ring, int(ids[i]), int(extents.seqs[i]), int(extents.starts[i]),
                                              int(lasts[i]), int(ends[i]))
                    for i in np.flatnonzero(is_open)}
    closed = np.flatnonzero(alive & ~is_open)
    return Repaired(open_extents, ids[closed], lengths[closed])


def _open_extent(ring: EpisodicRing, episode_id: int, seq: int, start: int, last: int, end: int) -> Extent:
    """An open episode's extent, with its first frame and frame bytes in each arena."""
    rows, arenas = np.arange(start, last + 1) % ring.capacity, ring.arenas.values()
    return Extent(episode_id, seq, start, last, end, tuple(int(a.offset[start % ring.capacity]) for a in arenas),
                  tuple(int(a.length[rows].sum()) for a in arenas))


def _rebuild_arena(ring: EpisodicRing, arena: Arena, rows: np.ndarray) -> None:
    """The arena's head (the end of the newest live frame: frames an interrupted op wrote past it are nobody's)
    and stored bytes, from the live `rows`; FailedPrecondition when a live frame lies off the arena or further
    than its size below the newest one's end."""
    if rows.size == 0:  # nothing lives: the next frame may go anywhere
        arena.state[ARENA_STORED] = 0
        return
    offsets, lengths = arena.offset[rows], arena.length[rows].astype(np.int64)
    head = int((offsets + lengths).max())
    if np.any(lengths < 1) or np.any(offsets % arena.size + lengths > arena.size) or offsets.min() < head - arena.size:
        raise FailedPrecondition(f"recover {ring.name!r}: field {arena.field.name!r} has a live frame off its arena")
    arena.state[ARENA_HEAD] = head
    arena.state[ARENA_STORED] = int(lengths.sum())


def _check_state(ring: EpisodicRing) -> tuple[int, int]:
    state = ring.state
    head, tail_pos = int(state[HEAD]), int(state[TAIL_POS])
    tail_seq, next_seq = int(state[TAIL_SEQ]), int(state[NEXT_SEQ])
    if not (0 <= tail_pos <= head and head - tail_pos <= ring.capacity and 0 <= tail_seq <= next_seq
            and next_seq - tail_seq <= ring.extent_slots):
        raise FailedPrecondition(
            f"recover {ring.name!r}: inconsistent ring state head={head} tail={tail_pos} extents "
            f"{tail_seq}..{next_seq}"
        )
    return head, tail_pos


def _committed_extents(ring: EpisodicRing, head: int, tail_pos: int) -> _Extents:
    """The live extents the head covers; finishes an interrupted eviction and drops an interrupted op's."""
    tail_seq = int(ring.state[TAIL_SEQ])
    seqs = np.arange(tail_seq, int(ring.state[NEXT_SEQ]), dtype=np.int64)
    extents = _Extents(seqs, seqs % ring.extent_slots, ring.extent_start[seqs % ring.extent_slots])
    # An eviction publishes the tail position before the first live extent: one killed in between left
    # evicted extents (starting below the tail) in the range. Finish it.
    starts = extents.starts
    evicted = int(np.argmin(starts < tail_pos)) if np.any(starts >= tail_pos) else len(starts)
    if evicted:
        ring.extent_flags[extents.slots[:evicted]] = 0
        tail_seq += evicted
        ring.state[TAIL_SEQ] = tail_seq
        extents.keep(slice(evicted, None))
    committed = int(np.count_nonzero(extents.starts < head))
    if np.any(extents.starts[:committed] < tail_pos) or np.any(np.diff(extents.starts[:committed]) <= 0):
        raise FailedPrecondition(f"recover {ring.name!r}: extent starts are not ordered within the ring")
    ring.extent_flags[extents.slots[committed:]] = 0
    extents.keep(slice(None, committed))
    ring.state[NEXT_SEQ] = tail_seq + committed
    return extents


def _rebuild_rows(ring: EpisodicRing, extents: _Extents, alive: np.ndarray, is_open: np.ndarray,
                  lasts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row bounds and counts rebuilt from the extent table, over the whole ring: an interrupted op may have
    left bounds past the head (a block killed before the head moved) or below the tail (an eviction killed
    before its rows became holes), which rooms reserved later would read as steps. Returns the live
    positions and each extent's landed rows."""
    starts = extents.starts
    ring.row_end[:] = HOLE
    ring.row_seq[:] = -1
    lengths = np.where(alive, lasts - starts + 1, 0)
    positions = np.repeat(starts, lengths) + (np.arange(int(lengths.sum())) -
                                              np.repeat(np.cumsum(lengths) - lengths, lengths))
    rows = positions % ring.capacity
    ring.row_seq[rows] = np.repeat(extents.seqs, lengths)
    ring.row_end[rows] = np.repeat(np.where(is_open, OPEN, lasts), lengths)
    ring.state[EPISODES] = int(np.count_nonzero(alive & ~is_open))
    ring.state[STORED] = int(lengths.sum())
    ring.state[SAMPLEABLE] = int(np.where(alive, lasts - starts, 0).sum())
    return positions, lengths
