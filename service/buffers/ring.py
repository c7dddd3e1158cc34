"""The ring of an episodic buffer as its readers see it: rows, bounds and extent table in shared memory.

What every component reads (samplers, removers, rate limiters, batch modes are typed against this class)
and what any process can map: the writer's (service/buffers/episodic.py), a learner's local reader and a
sample worker (service/buffers/reader.py) hold the same arrays, so a batch has the same format whichever
process gathers it. This class holds no component and changes nothing.

Positions. Absolute positions increase forever; position `pos` lives in ring row `pos % capacity`. An
episode of L steps occupies L + 1 consecutive positions: its final observation is stored once, and the
step fields of that final row are padding. Positions are handed out in extents (one per live episode),
numbered by `seq` in ring order (service/buffers/writer.py says how they are written).

Readers hold no lock; they validate by the tail. A position's row never changes while the position is
live (>= the tail): the writer marks the rows of evicted extents as holes and moves `state[TAIL_POS]`
past them before it overwrites any of them, and the tail never moves back. So a batch whose positions
are all >= the tail read after the gather was read from live rows only: it is whole. Otherwise it raced
with an eviction and is drawn again. Bounds publish rows, not the head, which moves back when the newest
episode closes short of its room (see writer.py's commit order). (x86 keeps stores in program order,
and loads too, which this relies on.)

A compressed field has no column: its frames live in a byte arena, each row holding its frame's offset and
length (arena.py). A frame's bytes never change while its row's position is live either: the writer evicts
every episode whose frames a write would overwrite, publishing the tail first, so the same tail check covers
them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.arena import Arena
from replayd.server.kernels import Columns
from replayd.server.schema import Field, check_instance_name
from replayd.server.storage.shared_arrays import SharedArrays

OPEN, HOLE = kernels.OPEN, kernels.HOLE  # row_end of a row whose episode is open / that holds no episode
NO_COUNTS = np.empty(0, dtype=np.int64)  # no remover counts draws
NO_REWARD = np.empty(0, dtype=np.float32)  # no reward field: transition_batch writes no returns

ALIVE, IS_OPEN, TERMINATED = 1, 2, kernels.TERMINATED  # extent flags

# Indices into the shared `state` array.
HEAD, TAIL_SEQ, NEXT_SEQ, EPISODES, SAMPLEABLE, STORED, TAIL_POS = range(7)
STATE_SIZE = 8


def shm_name(instance: str, buffer: str) -> str:
    return f"rpd_{check_instance_name(instance)}_{buffer}"


class Retired(NamedTuple):
    """What a remover that retires steps shares with the bound lookup: a step drawn `max_times_sampled`
    times reads as a hole. NO_COUNTS and 0 when nothing is retired."""

    times_sampled: np.ndarray
    max_times_sampled: int


NOTHING_RETIRED = Retired(NO_COUNTS, 0)


def ring_pieces(pos: int, count: int, capacity: int) -> list[tuple[int, int, int]]:
    """(ring_row, source_offset, length) pieces covering positions [pos, pos + count) of a ring."""
    row = pos % capacity
    first = min(count, capacity - row)
    pieces = [(row, 0, first)]
    if first < count:
        pieces.append((0, first, count - first))
    return pieces


class EpisodicRing:
    """Rows, bounds and extent table of one episodic buffer, over its shared arrays."""

    kind = "episodic"

    def __init__(self, storage: SharedArrays, retired: Retired = NOTHING_RETIRED) -> None:
        meta = storage.meta
        self.storage = storage
        self.name: str = meta["name"]
        self.capacity: int = int(meta["capacity"])
        self.fields = tuple(Field.from_config(field) for field in meta["fields"])
        self.observation_fields = tuple(f for f in self.fields if f.observation)
        self.step_fields = tuple(f for f in self.fields if not f.observation)
        # Observation fields sampled as stacks of frames: the batch modes' kernels gather the other columns,
        # a pass after them these (BatchMode.gather).
        self.framed_fields = tuple(f for f in self.observation_fields if f.framed)
        plain_observations = tuple(f for f in self.observation_fields if not f.framed)
        self.reward_field: str | None = meta["reward_field"]
        # (achieved, desired): the observation fields of goal-conditioned episodes, or None
        self.goal_fields: tuple[str, str] | None = tuple(meta["goal_fields"]) if meta["goal_fields"] else None
        self.extent_slots = self.capacity // 2 + 2  # every extent spans >= 2 positions
        arrays = storage.arrays
        self.columns = {f.name: arrays[f"field.{f.name}"] for f in self.fields if not f.compressed}
        # The compressed fields' frames: byte arenas with a frame offset and length per row (arena.py).
        self.arenas = {f.name: Arena(f, arrays[f"field.{f.name}.offset"], arrays[f"field.{f.name}.length"],
                                     arrays[f"field.{f.name}.arena"], arrays["arena.state"][i])
                       for i, f in enumerate(f for f in self.fields if f.compressed)}
        # The columns the batch modes' kernels gather, looked up once: a sample pays per dict lookup.
        self.observation_columns = Columns.of(self.columns, plain_observations)
        self.observation_and_step_columns = Columns.of(self.columns, plain_observations + self.step_fields)
        self.reward_column = NO_REWARD if self.reward_field is None else self.columns[self.reward_field]
        # Batch bytes of one state's observation fields and of one row of every field (frames stacked): they
        # size a batch's items. `row_bytes` is what a row takes in the ring.
        self.observation_row_bytes = sum(f.item_bytes for f in self.observation_fields)
        self.item_row_bytes = sum(f.item_bytes for f in self.fields)
        self.row_bytes = sum(f.row_bytes for f in self.fields if not f.compressed)  # the columns' (arenas apart)
        self.row_end, self.row_seq = arrays["row.end"], arrays["row.seq"]
        self.extent_episode_id, self.extent_start = arrays["extent.episode_id"], arrays["extent.start"]
        self.extent_last, self.extent_flags = arrays["extent.last"], arrays["extent.flags"]
        self.state = arrays["state"]
        # The arguments after `positions` of the bound-lookup kernels.
        self.bound_tables = (self.capacity, self.row_end, self.row_seq, self.extent_last, self.extent_slots,
                             *retired)

    # ------------------------------------------------------------------ state
    @property
    def head(self) -> int:
        return self.state.item(HEAD)

    def tail_position(self) -> int:
        """Absolute position of the oldest live extent's first row (the head when empty); never decreases."""
        return self.state.item(TAIL_POS)

    @property
    def sampleable_steps(self) -> int:
        return self.state.item(SAMPLEABLE)

    def live_range(self) -> tuple[int, int, int]:
        """(tail position, head, sampleable steps), read in that order: a draw's view of the ring, in one call."""
        state = self.state
        return state.item(TAIL_POS), state.item(HEAD), state.item(SAMPLEABLE)

    @property
    def stored_steps(self) -> int:
        return self.state.item(STORED)

    @property
    def episodes(self) -> int:
        return self.state.item(EPISODES)

    def pieces(self, pos: int, count: int) -> list[tuple[int, int, int]]:
        """(ring_row, source_offset, length) pieces covering positions [pos, pos + count)."""
        return ring_pieces(pos, count, self.capacity)

    # ------------------------------------------------------------------ lookups
    def episode_bounds(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ring rows, episode bounds and closed-episode mask of absolute positions.

        The bound is the absolute position of the episode's final row (the last landed row while the
        episode is open); positions that hold no episode, or a step a remover retired, get HOLE.
        Sampleable iff position < bound.
        """
        rows, bounds, closed, _ = self.locate(positions)
        return rows, bounds, closed

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rows, bounds, closed, open_seq) of absolute positions: a Draw's fields (see Draw)."""
        return kernels.episode_bounds(np.ascontiguousarray(positions, dtype=np.int64), *self.bound_tables)

    def terminated_at(self, rows: np.ndarray) -> np.ndarray:
        """Whether the episode of each row ended by termination (False for open or truncated episodes)."""
        flags = self.extent_flags.take(self.row_seq.take(rows) % self.extent_slots)
        return (flags & TERMINATED) != 0

    def extent_slots_of(self, rows: np.ndarray, open_seq: np.ndarray) -> np.ndarray:
        """Extent-table slots of drawn rows; `open_seq` is the extent read for a row of an open episode (see
        Draw), which may move (and its rows' sequence numbers go) after the draw."""
        seqs = np.where(open_seq >= 0, open_seq, self.row_seq.take(rows))
        return seqs % self.extent_slots

    def episode_ids_of(self, rows: np.ndarray, open_seq: np.ndarray) -> np.ndarray:
        return self.extent_episode_id.take(self.extent_slots_of(rows, open_seq))

    def episode_starts_of(self, rows: np.ndarray, open_seq: np.ndarray) -> np.ndarray:
        """Absolute position of the first row of each drawn row's episode."""
        return self.extent_start.take(self.extent_slots_of(rows, open_seq))

    def longest_episode(self) -> int:
        """Steps of the longest live episode (an open one's landed so far); 0 when none is stored."""
        tail_seq, next_seq = self.state.item(TAIL_SEQ), self.state.item(NEXT_SEQ)
        slots = np.arange(tail_seq, next_seq, dtype=np.int64) % self.extent_slots
        alive = (self.extent_flags.take(slots) & ALIVE) != 0
        steps = self.extent_last.take(slots) - self.extent_start.take(slots)
        return int(steps[alive].max(initial=0))
