"""The per-sample loops of the sampling hot path, compiled (_kernels.c): bound lookup, rejection draw, a
batch mode's targets and gathers (transitions, geometric pairs, states, sequences, hindsight goals), the
stacking of frames, the lock-free reader's checks.

A batch of 256 needs a few dozen elementwise steps per sample; as numpy calls that is about twenty
calls of ~1 µs of overhead each, as one compiled loop per stage it is a few µs. A stage is one C call:
numpy's own calls spend most of their time on a batch of 256 in argument handling and allocation.

Every row a kernel computes is wrapped onto the ring before it indexes a table: a lock-free reader's
tables may be mid-write (a torn bound can lie laps ahead, the live range it read can exceed the
capacity), which gives it wrong answers it detects and redraws, but never an access off an array.
Array arguments are checked for item type, length and contiguity (TypeError or ValueError otherwise).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from replayd.server.kernels import _kernels
from replayd.server.kernels._kernels import (
    bounds_kept,
    draw_uniform,
    drawn_live,
    geometric_batch,
    hindsight_goals,
    new_bytes,
    sequence_batch,
    stack_frames,
    take_rows,
    transition_batch,
)
from replayd.server.schema import Field

OPEN = _kernels.OPEN  # row_end of a row whose episode is still open
HOLE = _kernels.HOLE  # row_end of a row that holds no episode
TERMINATED = _kernels.TERMINATED  # extent flag

REWARD_DTYPES = ("float32", "float64")  # the reward columns transition_batch reads

__all__ = ["HOLE", "OPEN", "REWARD_DTYPES", "TERMINATED", "Columns", "bounds_kept", "draw_uniform", "drawn_live",
           "episode_bounds", "gather_columns", "geometric_batch", "hindsight_goals", "new_bytes", "prefixed",
           "sequence_batch", "stack_frames", "take_rows", "transition_batch"]


def episode_bounds(positions: np.ndarray, capacity: int, row_end: np.ndarray, row_seq: np.ndarray,
                   extent_last: np.ndarray, extent_slots: int, times_sampled: np.ndarray,
                   max_times_sampled: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows, bounds, closed, open_seq) of absolute positions; see EpisodicRing.locate. A bound is the
    absolute position of the episode's final row (its last landed row while open), HOLE where the row
    holds no episode or a remover retired the step; open_seq is the extent sequence number read for a
    row of an open episode (-1 for others)."""
    located = np.empty((3, positions.size), np.int64)  # rows, bounds, open_seq
    closed = np.empty(positions.size, np.bool_)
    _kernels.episode_bounds(positions, capacity, row_end, row_seq, extent_last, extent_slots, times_sampled,
                            max_times_sampled, located, closed)
    return located[0], located[1], closed, located[2]


class Columns(NamedTuple):
    """Ring columns a batch mode gathers together: their names and arrays, in batch order."""

    names: tuple[str, ...]
    arrays: tuple[np.ndarray, ...]

    @staticmethod
    def of(columns: dict[str, np.ndarray], fields: tuple[Field, ...]) -> Columns:
        return Columns(tuple(f.name for f in fields), tuple(columns[f.name] for f in fields))


@functools.cache
def prefixed(prefix: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The names with a prefix (`next_`, `future_`, ...), built once per schema and prefix."""
    return tuple(prefix + name for name in names)


def gather_columns(batch: dict[str, np.ndarray], rows: np.ndarray, columns: Columns) -> None:
    """batch[name] = column[rows] for every column, in one compiled call."""
    take_rows(batch, columns.names, rows, columns.arrays)
