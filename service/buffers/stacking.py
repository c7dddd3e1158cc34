"""The frame pass: a batch's stacked observation fields, assembled from the frames the ring stores one per row.

A batch mode's kernels gather the plain columns; the mode then says which absolute positions each of its
output prefixes reads (BatchMode.frame_reads: "" at the drawn steps, "next_" one later, ...), and this pass
writes `prefix + field` for every framed field: for a position p of an episode starting at s, the frames of
positions max(p - k + 1 + j, s), j = 0 .. k-1 (the episode's first frame repeated before its start, as
gymnasium's FrameStackObservation pads), stacked by the compiled kernel (kernels.stack_frames). Positions a
read marks invalid (a sequence's rows past its episode) get zeros.

Every position is wrapped onto the ring, and episode starts come from the extent table: a lock-free reader
reading tables mid-write gets wrong frames that its validation detects (service/buffers/reader.py), never a
read off an array.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from service import kernels
from service.buffers.ring import EpisodicRing
from service.schema import Field


class FrameRead(NamedTuple):
    """Where an output prefix reads its observations: absolute positions, shaped (B,) or (B, T) (batch-major),
    and which of them hold a state (None: all)."""

    prefix: str
    positions: np.ndarray
    valid: np.ndarray | None = None


def frame_positions(read: FrameRead, starts: np.ndarray, stack: int) -> np.ndarray:
    """The positions of every stacked frame of a read, (*positions.shape, stack): each clipped to its episode's
    start (`starts`, one per drawn item), -1 where the read holds no state."""
    positions = read.positions
    first = starts.reshape(starts.shape + (1,) * positions.ndim)  # (B, 1[, 1])
    slots = positions[..., None] + np.arange(1 - stack, 1, dtype=np.int64)  # (*positions.shape, stack)
    slots = np.maximum(slots, first)
    if read.valid is not None:
        slots[~read.valid] = -1
    return slots


def output(batch: dict[str, np.ndarray], name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The array batch[name] holds when it can take the column (a view of a message to gather into), else a new one."""
    given = batch.get(name)
    if (isinstance(given, np.ndarray) and given.shape == shape and given.dtype == dtype
            and given.flags.c_contiguous and given.flags.writeable):
        return given
    return np.empty(shape, dtype)


def gather_frames(ring: EpisodicRing, reads: Iterable[FrameRead], starts: np.ndarray,
                  batch: dict[str, np.ndarray]) -> None:
    """Writes `prefix + field` of every read for every framed field of `ring`. A read whose positions are the
    array of an earlier read (bootstrap_ at t + 1 for 1-step transitions) gets that read's column itself."""
    reads = tuple(reads)
    for field in ring.framed_fields:
        _gather_field(ring, field, reads, starts, batch)


def _gather_field(ring: EpisodicRing, field: Field, reads: tuple[FrameRead, ...], starts: np.ndarray,
                  batch: dict[str, np.ndarray]) -> None:
    column, capacity = ring.columns[field.name], ring.capacity
    written: dict[int, str] = {}  # id of a read's positions -> the column written for it
    for read in reads:
        name = read.prefix + field.name
        same = written.get(id(read.positions))
        if same is not None:
            batch[name] = batch[same]
            continue
        slots = frame_positions(read, starts, field.stack)
        rows = np.where(slots >= 0, slots % capacity, -1).reshape(-1, field.stack)  # (N, stack)
        out = output(batch, name, read.positions.shape + field.batch_shape, column.dtype)
        kernels.stack_frames(out, column, rows, int(field.stack_axis == 0))
        batch[name] = out
        written[id(read.positions)] = name
