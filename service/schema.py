"""Field declarations of a buffer and validation of incoming columns against them."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from replayd.wire.codec import CodecError, check_dtype
from replayd.wire.errors import InvalidArgument
from replayd.wire.frame_fields import CompressedFrames, check_frames, stacked_shape

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# No underscore: segments are named rpd_<instance>_<buffer>, and buffer names may contain one, so an
# instance "a_b" would own instance "a"'s buffer "b_c" (recovery and stale-segment removal match prefixes).
_INSTANCE = re.compile(r"[A-Za-z0-9]{1,32}")
# Column names the samplers add to batches; a stored field may not shadow them.
RESERVED_NAMES = frozenset(
    ["terminated", "truncated", "n_step_return", "bootstrap_discount", "offset", "key", "episode_id",
     "probability", "weight", "advantage", "return"]
)
RESERVED_PREFIXES = ("next_", "future_", "bootstrap_")
# Bounds on declared schemas: far above any real observation (Atari stacks are (4, 84, 84)), low enough
# that sizes computed from them stay exact and a schema cannot describe more than the host could hold.
MAX_FIELDS = 256
MAX_RANK = 8
MAX_ROW_BYTES = 2**30


@dataclass(frozen=True)
class Field:
    """One stored column: `shape` excludes the row axis. Observation fields have a row per state.

    A field stacked `stack` deep stores one frame (`shape`) per row and is sampled as its frames of rows
    t-k+1 .. t of one episode, stacked on `stack_axis` of the batch's row; a compressed one ("zstd" at
    `compression_level`, or "lz4") stores each frame compressed (proto/frame_fields.py).
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    observation: bool = False
    stack: int = 1
    stack_axis: int = -1
    compression: str | None = None
    compression_level: int | None = None

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (one frame)."""
        return np.dtype(self.dtype).itemsize * math.prod(int(d) for d in self.shape)

    @property
    def framed(self) -> bool:
        """Whether sampling assembles this field from stored frames (the batch modes' kernels gather only the
        others; a pass after them stacks these: service/buffers/stacking.py)."""
        return self.stack > 1 or self.compressed

    @property
    def compressed(self) -> bool:
        """Whether this field's frames are stored compressed (in a byte arena of the ring, not a column)."""
        return self.compression is not None

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The row shape of this field in a batch: its frames stacked."""
        return stacked_shape(self.shape, self.stack, self.stack_axis)

    @property
    def item_bytes(self) -> int:
        """Bytes of one row of this field in a batch."""
        return self.row_bytes * self.stack

    def to_config(self) -> dict[str, Any]:
        """Every attribute, as JSON: the encoding of the shared-memory header and of checkpoints."""
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Field:
        return cls(**{**config, "shape": tuple(config["shape"])})


def check_buffer_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(f"buffer name {name!r} must match {_NAME.pattern}")
    return name


def check_instance_name(instance: str) -> str:
    if not isinstance(instance, str) or not _INSTANCE.fullmatch(instance):
        raise InvalidArgument(f"instance name {instance!r} must match {_INSTANCE.pattern} (letters and digits)")
    return instance


def check_field_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(f"field name {name!r} must match {_NAME.pattern}")
    return name


def check_shape(name: str, dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A row shape of positive dimensions, at most MAX_RANK of them and MAX_ROW_BYTES per row."""
    try:  # integers only: int() would turn a dimension of 2.7 into 2
        shape = tuple(operator.index(d) for d in shape)
    except TypeError as exc:
        raise InvalidArgument(f"field {name!r}: shape {shape!r} must be a sequence of integers") from exc
    if len(shape) > MAX_RANK:
        raise InvalidArgument(f"field {name!r}: shape {list(shape)} has rank {len(shape)}, expected <= {MAX_RANK}")
    if any(d <= 0 for d in shape):
        raise InvalidArgument(f"field {name!r}: shape {list(shape)} must have positive dimensions")
    row_bytes = np.dtype(dtype).itemsize * math.prod(shape)
    if row_bytes > MAX_ROW_BYTES:
        raise InvalidArgument(
            f"field {name!r}: a row of {dtype}{list(shape)} takes {row_bytes} bytes, expected <= {MAX_ROW_BYTES}"
        )
    return shape


def check_fields(fields: Iterable[Field], reserved: frozenset[str] = RESERVED_NAMES) -> tuple[Field, ...]:
    fields = tuple(fields)
    if not fields:
        raise InvalidArgument("schema: at least one field is required")
    if len(fields) > MAX_FIELDS:
        raise InvalidArgument(f"schema: {len(fields)} fields, expected <= {MAX_FIELDS}")
    seen = set()
    checked = []
    for field in fields:
        check_field_name(field.name)
        if field.name in reserved or field.name.startswith(RESERVED_PREFIXES):
            raise InvalidArgument(f"field name {field.name!r} is reserved for sampled columns")
        if field.name in seen:
            raise InvalidArgument(f"field {field.name!r} declared twice")
        seen.add(field.name)
        try:  # any numpy spelling ("<f4", "f4", "float32") is stored under its name, as for rollouts
            dtype = check_dtype(field.name, field.dtype).name
        except CodecError as exc:
            raise InvalidArgument(str(exc)) from exc
        shape = check_shape(field.name, dtype, field.shape)
        stack, stack_axis, compression, level = check_frames(f"field {field.name!r}", field.stack, field.stack_axis,
                                                             field.observation, field.compression,
                                                             field.compression_level)
        checked.append(replace(field, dtype=dtype, shape=shape, stack=stack, stack_axis=stack_axis,
                               compression=compression, compression_level=level))
    return tuple(checked)


def check_columns(fields: tuple[Field, ...], columns: Mapping[str, np.ndarray | CompressedFrames], what: str) -> int:
    """Checks that `columns` holds exactly the declared fields with equal row counts, the compressed fields as
    frames that each decompress to the field's frame size; returns the row count."""
    declared = {field.name for field in fields}
    extra = sorted(set(columns) - declared)
    if extra:
        raise InvalidArgument(f"{what}: unknown field(s) {extra}; the buffer declares {sorted(declared)}")
    rows = None
    for field in sorted(fields, key=lambda f: f.compressed):  # the cheap checks first
        if field.name not in columns:
            raise InvalidArgument(f"{what}: field {field.name!r} is missing")
        column = columns[field.name]
        if field.compressed or isinstance(column, CompressedFrames):
            rows = _check_frames(field, column, rows, what)
            continue
        if column.dtype != np.dtype(field.dtype):
            got = column.dtype.name if column.dtype.isnative else f"{column.dtype.name} in non-native byte order"
            raise InvalidArgument(f"{what}: field {field.name!r} expected dtype {field.dtype}, got {got}")
        if tuple(column.shape[1:]) != tuple(field.shape):
            raise InvalidArgument(
                f"{what}: field {field.name!r} expected row shape {tuple(field.shape)}, got {tuple(column.shape[1:])}"
            )
        if rows is None:
            rows = len(column)
        elif len(column) != rows:
            raise InvalidArgument(f"{what}: field {field.name!r} has {len(column)} rows, other fields have {rows}")
    return int(rows or 0)


def _check_frames(field: Field, column: np.ndarray | CompressedFrames, rows: int | None, what: str) -> int:
    """The rows of a compressed field's frames (checked: proto/frame_fields.py), or InvalidArgument for a
    field sent in the other form than it is stored in."""
    if not field.compressed:
        raise InvalidArgument(f"{what}: field {field.name!r} is not compressed: expected an Arrow column, got "
                              "compressed frames")
    if not isinstance(column, CompressedFrames):
        raise InvalidArgument(f"{what}: field {field.name!r} is compressed ({field.compression}): expected its "
                              "frames compressed one by one (InsertRequest.frames), got a column")
    column.check(field.name, field.compression, field.row_bytes, len(column) if rows is None else rows)
    return len(column)
