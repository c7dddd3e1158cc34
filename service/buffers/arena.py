"""Byte arenas: where a ring keeps the frames of its compressed fields, and how a buffer is sized by bytes.

Each compressed field has an arena in the buffer's shared memory and two per-row arrays: `offset`, the
absolute byte position of the row's frame (increasing forever, like row positions: it lives at
`offset % size` of the arena) and `length`. Frames are appended at the arena's head in position order, a
chunk's frames back to back, except that a frame that would cross the arena's end starts at its beginning
(the bytes skipped are slack). So an extent's first frame is its lowest, and first frames increase with
extent numbers: the writer maps a byte boundary to the extents it must evict by their first rows' offsets
(service/buffers/writer.py), and evicts whole episodes, FIFO, as for rows.

The head and the bytes of stored frames live in the shared `arena.state` array (a row per compressed field):
the head says where the next frame goes (readers never read it: a position's bounds publish its row, and its
row its frame), and crash repair rebuilds both from the surviving rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from replayd.server.schema import Field
from replayd.server.storage.shared_arrays import ArraySpec
from replayd.wire.errors import InvalidArgument

ARENA_HEAD, ARENA_STORED = 0, 1  # columns of `arena.state`
# Sizing a buffer by one capacity alone takes a compressed frame's size as this share of its raw size. Arenas
# sized from rows take 1/8 (zstd and lz4 shrink Atari frames 18-45x: the rows bind first); rows sized from bytes
# take 1/64: a row's tables cost tens of bytes, so a buffer sized by bytes is bound by its arena's bytes unless
# its frames compress more than 64x.
ARENA_SIZING_RATIO = 8
ROW_SIZING_RATIO = 64


class Arena(NamedTuple):
    """A compressed field's storage in the ring's shared arrays."""

    field: Field
    offset: np.ndarray  # int64 (capacity,): each row's frame, as an absolute byte position
    length: np.ndarray  # int32 (capacity,)
    data: np.ndarray  # uint8 (size,)
    state: np.ndarray  # int64 (2,): head, stored bytes (a row of the shared `arena.state`)

    @property
    def size(self) -> int:
        return self.data.size


def arena_specs(fields: Sequence[Field], capacity: int, sizes: Sequence[int]) -> list[ArraySpec]:
    """The arrays of the compressed fields' arenas (`sizes` bytes each, in field order)."""
    compressed = [f for f in fields if f.compressed]
    if not compressed:
        return []
    specs = [spec for field, size in zip(compressed, sizes, strict=True) for spec in (
        ArraySpec(f"field.{field.name}.offset", "int64", (capacity,)),
        ArraySpec(f"field.{field.name}.length", "int32", (capacity,)),
        ArraySpec(f"field.{field.name}.arena", "uint8", (size,)),
    )]
    return [*specs, ArraySpec("arena.state", "int64", (len(compressed), 2))]


def place(head: int, lengths: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """(absolute offsets, new head) of frames of `lengths` (each <= size) appended at `head` of an arena of
    `size` bytes: back to back, but a frame that would cross the arena's end starts at its beginning."""
    if lengths.size == 0:
        return np.empty(0, np.int64), head
    offsets = head + np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)])  # (frames,)
    while True:
        crossing = offsets // size != (offsets + lengths - 1) // size
        if not crossing.any():
            return offsets, int(offsets[-1] + lengths[-1])
        first = int(np.argmax(crossing))
        offsets[first:] += size - offsets[first] % size


def fits(lengths: np.ndarray, size: int) -> bool:
    """Whether frames of `lengths` fit an arena of `size` bytes wherever its head is: their bytes and one frame's
    slack (a run crosses the arena's end at most once)."""
    return lengths.size == 0 or int(lengths.sum()) + int(lengths.max()) <= size


def arena_sizes(fields: Sequence[Field], budget: int) -> list[int]:
    """`budget` bytes shared by the compressed fields' arenas in proportion to their raw frame sizes."""
    compressed = [f for f in fields if f.compressed]
    raw = sum(f.row_bytes for f in compressed)
    return [budget * f.row_bytes // raw for f in compressed]


def sizes_from_rows(fields: Sequence[Field], capacity: int) -> list[int]:
    """Arenas for `capacity` rows of frames compressed ARENA_SIZING_RATIO times."""
    return [capacity * f.row_bytes // ARENA_SIZING_RATIO for f in fields if f.compressed]


def rows_from_bytes(fields: Sequence[Field], capacity_bytes: int, row_table_bytes: float) -> int:
    """Rows for a buffer of `capacity_bytes`, each row taking `row_table_bytes` of tables and columns and its
    compressed frames ROW_SIZING_RATIO times smaller than raw."""
    row = row_table_bytes + sum(f.row_bytes for f in fields if f.compressed) / ROW_SIZING_RATIO
    rows = int(capacity_bytes // row)
    if rows < 2:
        raise InvalidArgument(f"capacity_bytes={capacity_bytes} holds {rows} rows of {row:.0f} bytes; expected room "
                              "for at least 2")
    return rows
