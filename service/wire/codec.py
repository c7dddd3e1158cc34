"""numpy <-> Arrow IPC codec shared by the server and the client.

Every column is a numpy array whose first axis is the row axis. The Arrow field carries the exact
numpy dtype and per-row shape in its metadata; multi-dimensional rows travel as a fixed-size list
over the flat values, and booleans travel as uint8 bytes, so both directions are zero-copy: decoding
yields read-only numpy views into the received bytes. When a batch holds the same array under two
names (e.g. `bootstrap_obs` is `next_obs` for 1-step samples), it is sent once and aliased.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

ALLOWED_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"]
)
_DTYPE_KEY = b"dtype"
_SHAPE_KEY = b"shape"
_ALIASES_KEY = b"aliases"


class CodecError(ValueError):
    """A payload that is not a well-formed replayd Arrow batch."""


def check_dtype(name: str, dtype: np.dtype | str) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.name not in ALLOWED_DTYPES:
        raise CodecError(f"field {name!r}: dtype {dtype.name} is not supported (use one of {sorted(ALLOWED_DTYPES)})")
    return dtype


def _to_arrow(name: str, array: np.ndarray) -> tuple[pa.Field, pa.Array]:
    dtype = check_dtype(name, array.dtype)
    row_shape = array.shape[1:]
    flat = np.ascontiguousarray(array).reshape(-1)
    if dtype == np.bool_:
        flat = flat.view(np.uint8)
    values = pa.array(flat)
    row_size = int(np.prod(row_shape, dtype=np.int64))
    column = values if not row_shape else pa.FixedSizeListArray.from_arrays(values, row_size)
    metadata = {_DTYPE_KEY: dtype.name.encode(), _SHAPE_KEY: json.dumps(list(row_shape)).encode()}
    return pa.field(name, column.type, nullable=False, metadata=metadata), column


def encode(columns: Mapping[str, np.ndarray]) -> pa.Buffer:
    """Encodes equal-length columns into one Arrow IPC stream (schema + one record batch)."""
    fields, arrays, aliases = [], [], {}
    seen: dict[int, str] = {}
    num_rows = None
    for name, array in columns.items():
        if not isinstance(array, np.ndarray) or array.ndim == 0:
            raise CodecError(f"field {name!r}: expected a numpy array with a row axis, got {type(array).__name__}")
        if num_rows is None:
            num_rows = len(array)
        elif len(array) != num_rows:
            raise CodecError(f"field {name!r}: {len(array)} rows, but earlier fields have {num_rows}")
        if id(array) in seen:
            aliases[name] = seen[id(array)]
            continue
        seen[id(array)] = name
        field, column = _to_arrow(name, array)
        fields.append(field)
        arrays.append(column)
    schema_metadata = {_ALIASES_KEY: json.dumps(aliases).encode()} if aliases else None
    batch = pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=schema_metadata))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def _field_dtype_shape(field: pa.Field) -> tuple[np.dtype, tuple[int, ...]]:
    metadata = field.metadata or {}
    if _DTYPE_KEY not in metadata or _SHAPE_KEY not in metadata:
        raise CodecError(f"field {field.name!r}: missing dtype/shape metadata")
    try:
        dtype = check_dtype(field.name, metadata[_DTYPE_KEY].decode())
        shape = tuple(int(d) for d in json.loads(metadata[_SHAPE_KEY]))
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise CodecError(f"field {field.name!r}: bad dtype/shape metadata ({exc})") from exc
    if any(d < 0 for d in shape):
        raise CodecError(f"field {field.name!r}: negative dimension in shape {shape}")
    return dtype, shape


def _to_numpy(field: pa.Field, column: pa.Array) -> np.ndarray:
    dtype, shape = _field_dtype_shape(field)
    if column.null_count:
        raise CodecError(f"field {field.name!r}: null values are not allowed")
    storage_dtype = np.dtype(np.uint8) if dtype == np.bool_ else dtype
    if shape:
        row_size = int(np.prod(shape, dtype=np.int64))
        if not pa.types.is_fixed_size_list(column.type) or column.type.list_size != row_size:
            raise CodecError(f"field {field.name!r}: rows of shape {shape} need a fixed-size list of {row_size}")
        values = column.flatten()
    else:
        values = column
    if values.type != pa.from_numpy_dtype(storage_dtype) or values.null_count:
        raise CodecError(f"field {field.name!r}: arrow type {values.type} does not match dtype {dtype.name}")
    flat = values.to_numpy(zero_copy_only=True)
    if dtype == np.bool_:
        if flat.size and flat.max() > 1:
            raise CodecError(f"field {field.name!r}: boolean bytes must be 0 or 1")
        flat = flat.view(np.bool_)
    return flat.reshape((len(column), *shape))


def decode(payload: bytes | memoryview | pa.Buffer) -> dict[str, np.ndarray]:
    """Decodes one Arrow IPC stream into read-only numpy views over `payload`."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(payload) if not isinstance(payload, pa.Buffer) else payload)
        batches = list(reader)
    except (pa.ArrowException, OSError) as exc:
        raise CodecError(f"malformed Arrow IPC payload: {exc}") from exc
    if len(batches) != 1:
        raise CodecError(f"expected exactly one record batch, got {len(batches)}")
    batch = batches[0]
    columns = {}
    for field, column in zip(batch.schema, batch.columns, strict=True):
        if field.name in columns:
            raise CodecError(f"field {field.name!r} appears twice")
        columns[field.name] = _to_numpy(field, column)
    schema_metadata = batch.schema.metadata or {}
    if _ALIASES_KEY in schema_metadata:
        try:
            aliases = json.loads(schema_metadata[_ALIASES_KEY])
            for name, target in aliases.items():
                columns[name] = columns[target]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CodecError(f"bad alias metadata: {exc}") from exc
    return columns
