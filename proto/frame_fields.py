"""Framed observation fields: what a client declares, the checks both ends share, and the frame codecs.

A field declared with `Frames(stack=k)` stores one frame per row (the frame is the field's `shape`), and every
batch mode returns it stacked: the frames of rows t-k+1 .. t of the same episode, the episode's first frame
repeated before its start (gymnasium's `FrameStackObservation` with padding by the first observation). The
stack is a new axis of the batch's column, last by default (`stack_axis=-1`: (84, 84) frames come out as
(84, 84, k)) or first (`stack_axis=0`, channel-first: (k, 84, 84)).

A field declared with `Frames(compression="zstd")` (level 1..22, 3 by default) or `"lz4"` (its fast mode, or
LZ4 HC with a level 1..12, smaller frames for a slower insert) travels and is
stored as its frames compressed one by one (zstandard's frames, with their content checksum, or lz4's blocks):
the client compresses them at insert, the server checks that each decompresses to the field's frame size
(and, for zstd, matches its checksum) and keeps the bytes, and a sample decompresses each frame it needs once
(on the server, or on the client: decompress="client").
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import lz4.block
import numpy as np
import zstandard

from replayd.wire.errors import InvalidArgument

STACK_AXES = (-1, 0)  # the stack's axis in a sampled column's row: last or first
MAX_STACK = 64
COMPRESSIONS = ("zstd", "lz4")
ZSTD_LEVELS = (1, 22)
DEFAULT_ZSTD_LEVEL = 3
LZ4_HC_LEVELS = (1, 12)  # lz4 with a level compresses in LZ4 HC mode (slower, smaller, the same block format)


def check_frames(what: str, stack: object, stack_axis: object, observation: bool, compression: object = None,
                 compression_level: object = None) -> tuple[int, int, str | None, int | None]:
    """(stack, stack_axis, compression, compression_level), checked (zstd's level defaults to 3);
    InvalidArgument naming `what` (the field, or the options) otherwise."""
    if isinstance(stack, bool) or not isinstance(stack, numbers.Integral) or not 1 <= stack <= MAX_STACK:
        raise InvalidArgument(f"{what}: stack must be an integer in 1..{MAX_STACK}, got {stack!r}")
    if isinstance(stack_axis, bool) or stack_axis not in STACK_AXES:
        raise InvalidArgument(f"{what}: stack_axis must be -1 (last) or 0 (first), got {stack_axis!r}")
    if stack > 1 and not observation:
        raise InvalidArgument(f"{what}: stack={stack}, expected 1: only observation fields are stacked "
                              "(step fields have one value per step)")
    if compression is not None and compression not in COMPRESSIONS:
        raise InvalidArgument(f"{what}: compression must be one of {', '.join(map(repr, COMPRESSIONS))} or none, "
                              f"got {compression!r}")
    if compression is not None and not observation:
        raise InvalidArgument(f"{what}: compression={compression!r}, expected none: only observation fields are "
                              "compressed")
    return int(stack), int(stack_axis), compression, _level(what, compression, compression_level)


def _level(what: str, compression: str | None, level: object) -> int | None:
    """zstd's level (3 unless given), or lz4's high-compression level (none: lz4's fast mode)."""
    if compression is None:
        if level is not None:
            raise InvalidArgument(f"{what}: compression_level={level!r} applies to a compressed field, expected none "
                                  "without compression")
        return None
    if level is None:
        return DEFAULT_ZSTD_LEVEL if compression == "zstd" else None
    low, high = ZSTD_LEVELS if compression == "zstd" else LZ4_HC_LEVELS
    if isinstance(level, bool) or not isinstance(level, numbers.Integral) or not low <= level <= high:
        raise InvalidArgument(f"{what}: compression_level must be an integer in {low}..{high} for {compression}, "
                              f"got {level!r}")
    return int(level)


def stacked_shape(shape: tuple[int, ...], stack: int, stack_axis: int) -> tuple[int, ...]:
    """The row shape of a sampled column of frames of `shape` stacked `stack` deep (a frame's shape when 1)."""
    if stack == 1:
        return tuple(shape)
    return (stack, *shape) if stack_axis == 0 else (*shape, stack)


@dataclass(frozen=True)
class Frames:
    """How an observation field's frames are stored and sampled, given as a schema entry's third element:
    `{"obs": ("uint8", (84, 84), Frames(stack=4, stack_axis=0, compression="zstd"))}`. Validated where constructed
    (InvalidArgument naming `frames`); the server checks it against the field (only observation fields are
    stacked or compressed)."""

    stack: int = 1
    stack_axis: int = -1
    compression: str | None = None
    compression_level: int | None = None

    def __post_init__(self) -> None:
        checked = check_frames("frames", self.stack, self.stack_axis, True, self.compression, self.compression_level)
        for name, value in zip(("stack", "stack_axis", "compression", "compression_level"), checked, strict=True):
            object.__setattr__(self, name, value)


# ---------------------------------------------------------------------------------------------- codecs
class FrameError(ValueError):
    """Bytes that are not one compressed frame of the expected size."""


_codecs = threading.local()  # zstandard's (de)compressors are not for concurrent use: one per thread


def _zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    compressors = _codecs.__dict__.setdefault("compressors", {})
    if level not in compressors:
        compressors[level] = zstandard.ZstdCompressor(level=level, write_checksum=True)
    return compressors[level]


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_codecs, "decompressor"):
        _codecs.decompressor = zstandard.ZstdDecompressor()
    return _codecs.decompressor


def compress(compression: str, level: int | None, frames: np.ndarray) -> CompressedFrames:
    """Each row of `frames` (frames, *frame) compressed on its own."""
    frames = np.ascontiguousarray(frames)
    if compression == "zstd":
        compressor = _zstd_compressor(level)
        parts = [compressor.compress(frame) for frame in frames]
    else:
        mode = {} if level is None else {"mode": "high_compression", "compression": level}  # LZ4 HC, same blocks
        parts = [lz4.block.compress(frame, store_size=False, **mode) for frame in frames]
    return CompressedFrames(np.frombuffer(b"".join(parts), np.uint8), np.array([len(p) for p in parts], np.int64))


def decompress(compression: str, data: memoryview | bytes | np.ndarray, frame_bytes: int) -> bytes:
    """The frame `data` holds, exactly `frame_bytes` long; FrameError otherwise (corrupt bytes, another size,
    bytes after the frame). A frame whose header declares another size is refused before it is inflated."""
    try:
        if compression == "zstd":
            declared = zstandard.frame_content_size(data)
            if declared not in (frame_bytes, zstandard.CONTENTSIZE_UNKNOWN):
                raise FrameError(f"the frame declares {declared} bytes")
            frame = _zstd_decompressor().decompress(data, max_output_size=frame_bytes, allow_extra_data=False)
        else:
            frame = lz4.block.decompress(data, uncompressed_size=frame_bytes)
    except (zstandard.ZstdError, lz4.block.LZ4BlockError) as exc:
        raise FrameError(str(exc)) from None
    if len(frame) != frame_bytes:
        raise FrameError(f"it decompresses to {len(frame)} bytes")
    return frame


def decompress_many(compression: str, frames: CompressedFrames, frame_bytes: int) -> np.ndarray:
    """Every frame of `frames` decompressed, (frames, frame_bytes) uint8; FrameError if any is not whole. zstd's
    are decompressed in one call (python-zstandard's multi_decompress_to_buffer), after each frame's declared
    size is checked."""
    count = len(frames)
    if count == 0 or compression != "zstd":
        out = np.empty((count, frame_bytes), np.uint8)
        for i in range(count):
            out[i] = np.frombuffer(decompress(compression, frames.frame(i), frame_bytes), np.uint8)
        return out
    data = memoryview(frames.data)
    segments = np.stack([frames.starts[:-1], frames.lengths], axis=1).astype(np.uint64)  # (frames, 2)
    try:
        for start, end in zip(frames.starts[:-1].tolist(), frames.starts[1:].tolist(), strict=True):
            declared = zstandard.frame_content_size(data[start:end])
            if declared != frame_bytes:  # unknown sizes too: the batch call needs them
                raise FrameError(f"a frame declares {declared} bytes")
        decoded = _zstd_decompressor().multi_decompress_to_buffer(
            zstandard.BufferWithSegments(data, segments.tobytes()),
            decompressed_sizes=np.full(count, frame_bytes, np.uint64).tobytes(), threads=1)
    except zstandard.ZstdError as exc:
        raise FrameError(str(exc)) from None
    return np.frombuffer(b"".join(decoded[i] for i in range(count)), np.uint8).reshape(count, frame_bytes)


@dataclass(frozen=True)
class CompressedFrames:
    """One field's frames, compressed one by one: `data` holds them back to back, `lengths` their sizes. A column
    of an insert (one frame per row): sliced and concatenated by rows like a numpy column."""

    data: np.ndarray  # uint8 (total bytes,)
    lengths: np.ndarray  # int64 (frames,)

    @cached_property
    def starts(self) -> np.ndarray:
        """Where each frame starts in `data`, and the end: (frames + 1,)."""
        return np.concatenate([[0], np.cumsum(self.lengths)])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def frame(self, index: int) -> np.ndarray:
        return self.data[self.starts[index]:self.starts[index + 1]]

    def __getitem__(self, rows: slice | np.ndarray) -> CompressedFrames:
        """The frames of a slice of rows (a view), or of a boolean row mask."""
        if isinstance(rows, slice):
            lo, hi, step = rows.indices(len(self))
            if step != 1:
                raise ValueError("compressed frames: expected a contiguous slice of rows")
            hi = max(lo, hi)
            return CompressedFrames(self.data[self.starts[lo]:self.starts[hi]], self.lengths[lo:hi])
        return concatenate([self[int(lo):int(hi)] for lo, hi in _runs(np.asarray(rows, bool))])

    def check(self, name: str, compression: str, frame_bytes: int, rows: int) -> None:
        """InvalidArgument naming field `name` and the row unless these are `rows` frames that each decompress
        to `frame_bytes` bytes."""
        if len(self) != rows:
            raise InvalidArgument(f"insert: field {name!r} has {len(self)} compressed frames, other fields have {rows} "
                                  "rows")
        if len(self) and (self.lengths.min() < 1 or int(self.lengths.sum()) != self.data.size):
            raise InvalidArgument(f"insert: field {name!r}: frame lengths must be >= 1 and sum to the {self.data.size} "
                                  f"bytes of its frames, got lengths summing to {int(self.lengths.sum())}")
        try:
            decompress_many(compression, self, frame_bytes)
            return
        except FrameError:  # one by one, to name the row (or to take frames that do not declare their size)
            pass
        for row in range(len(self)):
            try:
                decompress(compression, self.frame(row), frame_bytes)
            except FrameError as exc:
                raise InvalidArgument(f"insert: field {name!r} row {row}: expected a {compression} frame of "
                                      f"{frame_bytes} bytes, but {exc}") from None


def concatenate(parts: Sequence[CompressedFrames]) -> CompressedFrames:
    if len(parts) == 1:
        return parts[0]
    return CompressedFrames(np.concatenate([p.data for p in parts]) if parts else np.empty(0, np.uint8),
                            np.concatenate([p.lengths for p in parts]) if parts else np.empty(0, np.int64))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(lo, hi) of each run of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return list(zip(edges[0::2], edges[1::2], strict=True))


def compress_bound(compression: str, frame_bytes: int) -> int:
    """The most bytes one frame of `frame_bytes` compresses to (zstd's ZSTD_compressBound, lz4's LZ4_COMPRESSBOUND)."""
    if compression == "zstd":
        small = (128 * 2**10 - frame_bytes) >> 11 if frame_bytes < 128 * 2**10 else 0
        return frame_bytes + (frame_bytes >> 8) + small
    return frame_bytes + frame_bytes // 255 + 16
