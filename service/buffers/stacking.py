"""The frame pass: a batch's stacked observation fields, assembled from the frames the ring stores one per row.

A batch mode's kernels gather the plain columns; the mode then says which absolute positions each of its
output prefixes reads (BatchMode.frame_reads: "" at the drawn steps, "next_" one later, ...), and this pass
writes `prefix + field` for every framed field: for a position p of an episode starting at s, the frames of
positions max(p - k + 1 + j, s), j = 0 .. k-1 (the episode's first frame repeated before its start, as
gymnasium's FrameStackObservation pads), stacked by the compiled kernel (kernels.stack_frames). Positions a
read marks invalid (a sequence's rows past its episode) get zeros.

A compressed field's frames are decompressed from its arena, each distinct frame a batch needs once, into a
scratch array the kernel stacks from; or, for a sample with decompress="client", copied out compressed
(`Shipped`), each distinct frame once, while the batch's columns of the field hold each stacked frame's index
into them: the client decompresses and stacks them (client/batch_stream.py).

Every position is wrapped onto the ring, and episode starts come from the extent table: a lock-free reader
reading tables mid-write gets wrong frames that its validation detects (service/buffers/reader.py), never a
read off an array. A frame it finds torn (an offset or length off the arena, bytes that do not decompress to
the frame's size) raises RingChanged, and it draws again; the writer's checks at insert keep every stored frame
whole for a reader that holds the lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.arena import Arena
from replayd.server.buffers.ring import EpisodicRing
from replayd.server.schema import Field
from replayd.wire.errors import RingChanged
from replayd.wire.frame_fields import CompressedFrames, FrameError, decompress_many


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


class Shipped(NamedTuple):
    """A compressed field's frames a batch ships compressed (decompress="client"): each distinct frame once, and
    the batch's columns that hold int32 indices into them (one per frame of a stack, -1: a frame of zeros)."""

    field: Field
    frames: CompressedFrames
    columns: tuple[str, ...]


def gather_frames(ring: EpisodicRing, reads: Iterable[FrameRead], starts: np.ndarray, batch: dict[str, np.ndarray],
                  shipped: list[Shipped] | None = None) -> None:
    """Writes `prefix + field` of every read for every framed field of `ring`. A read whose positions are the
    array of an earlier read (bootstrap_ at t + 1 for 1-step transitions) gets that read's column itself. With
    `shipped`, a compressed field's columns hold indices into its frames, which are appended there compressed."""
    reads = tuple(reads)
    for field in ring.framed_fields:
        _gather_field(ring, field, reads, starts, batch, shipped)


def _gather_field(ring: EpisodicRing, field: Field, reads: tuple[FrameRead, ...], starts: np.ndarray,
                  batch: dict[str, np.ndarray], shipped: list[Shipped] | None) -> None:
    written: dict[int, str] = {}  # id of a read's positions -> the column written for it
    aliases: dict[str, str] = {}
    stacks: list[tuple[str, tuple[int, ...], np.ndarray]] = []  # name, positions' shape, ring rows (N, stack)
    for read in reads:
        name = read.prefix + field.name
        same = written.get(id(read.positions))
        if same is not None:
            aliases[name] = same
            continue
        slots = frame_positions(read, starts, field.stack)
        stacks.append((name, read.positions.shape, np.where(slots >= 0, slots % ring.capacity, -1).reshape(
            -1, field.stack)))  # (N, stack)
        written[id(read.positions)] = name
    if field.compressed:  # each distinct frame once; rows become indices into those frames
        needed, inverse = np.unique(np.concatenate([rows.reshape(-1) for _, _, rows in stacks]), return_inverse=True)
        at = np.cumsum([0] + [rows.size for _, _, rows in stacks])
        stacks = [(name, shape, inverse[at[i]:at[i + 1]].reshape(rows.shape) - int(needed[0] < 0))
                  for i, (name, shape, rows) in enumerate(stacks)]
        arena, needed = ring.arenas[field.name], needed[needed >= 0]
        if shipped is not None:
            shipped.append(Shipped(field, frames_of(arena, needed), (*written.values(), *aliases)))
            for name, shape, indices in stacks:  # (*positions' shape[, stack])
                batch[name] = indices.astype(np.int32).reshape(shape + ((field.stack,) if field.stack > 1 else ()))
            _alias(batch, aliases)
            return
        source = decompressed(arena, needed)
    else:
        source = ring.columns[field.name]
    for name, shape, rows in stacks:
        out = output(batch, name, shape + field.batch_shape, source.dtype)
        kernels.stack_frames(out, source, rows, int(field.stack_axis == 0))
        batch[name] = out
    _alias(batch, aliases)


def _alias(batch: dict[str, np.ndarray], aliases: dict[str, str]) -> None:
    for name, same in aliases.items():
        batch[name] = batch[same]


def frame_spans(arena: Arena, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start in the arena, length) of the frames of ring `rows`; RingChanged for one that lies off the arena (a
    lock-free reader's torn read of the tables)."""
    starts, lengths = arena.offset[rows] % arena.size, arena.length[rows].astype(np.int64)
    if np.any((lengths < 1) | (lengths > arena.size - starts)):
        raise RingChanged(f"field {arena.field.name!r}: a frame's offset and length read mid-write lie off its arena")
    return starts, lengths


def frames_of(arena: Arena, rows: np.ndarray) -> CompressedFrames:
    """The compressed frames of ring `rows`, copied out of their arena."""
    starts, lengths = frame_spans(arena, rows)
    if not lengths.size:
        return CompressedFrames(np.empty(0, np.uint8), lengths)
    # A frame never crosses the arena's end (arena.py): each is one slice.
    return CompressedFrames(np.concatenate([arena.data[start:start + length] for start, length
                                            in zip(starts.tolist(), lengths.tolist(), strict=True)]), lengths)


def decompressed(arena: Arena, rows: np.ndarray) -> np.ndarray:
    """The frames of ring `rows` decompressed into one array (frames, *frame). RingChanged for a frame that is not
    whole (a lock-free reader's torn read)."""
    field = arena.field
    try:
        decoded = decompress_many(field.compression, frames_of(arena, rows), field.row_bytes)
    except FrameError as exc:
        raise RingChanged(f"field {field.name!r}: a frame read mid-write ({exc})") from None
    return decoded.view(field.dtype).reshape(rows.size, *field.shape)
