"""numpy <-> Arrow IPC codec shared by the server and the client.

Every column is a numpy array whose first axis is the row axis. The Arrow field carries the exact
numpy dtype and per-row shape in its metadata; multi-dimensional rows travel as a fixed-size list
over the flat values, and booleans travel as uint8 bytes, so both directions are zero-copy: decoding
yields read-only numpy views into the received bytes. When a batch holds the same array under two
names (e.g. `bootstrap_obs` is `next_obs` for 1-step samples), it is sent once and aliased.

A payload is a complete IPC stream (schema message, one record-batch message, end-of-stream marker).
Both sides cache what they derive from a schema, so a batch of a shape seen before costs only the
record-batch message: a learner's stream repeats one schema forever. They also cache what they derive
from a whole layout (the columns and the row count): the encoder learns the bytes Arrow's IPC writer puts
around the column bodies and afterwards emits those bytes around the new bodies itself (checked byte for
byte against Arrow's output when learned), and the decoder learns where each column lies in a payload it
has fully validated, so that a later payload with the same metadata bytes and size maps to numpy views
at the same offsets. Both are fixed per layout: without nulls, a record batch's metadata holds only the
row count and the buffers' offsets and lengths.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa

T = TypeVar("T")

ALLOWED_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"]
)
_DTYPE_KEY = b"dtype"
_SHAPE_KEY = b"shape"
_ALIASES_KEY = b"aliases"
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_CONTINUATION = 0xFFFFFFFF
_MESSAGE_PREFIX = struct.Struct("<Ii")  # an IPC message's continuation marker and metadata length
_CACHE_LIMIT = 512
# Payload metadata (schema message, record batch header) is cached by its bytes only up to this size: a client
# can pad field metadata at will, and every payload is decoded (and its metadata cached) before the buffer
# compares its schema. 256 fields with 64-character names (the limits) take 64 KB of schema and 76 KB of head;
# the usual few fields, under 1 KB. At most 512 x 128 KiB = 64 MiB per cache.
_MAX_CACHED_KEY_BYTES = 1 << 17
_PARTS_MIN_BYTES = 256 * 2**10
# A row travels as one Arrow fixed-size list, whose size is an int32; numpy allows at most 64 dimensions.
_MAX_ROW_VALUES = 2**31 - 1
_MAX_RANK = 32
# Room around a payload's column bytes: the Arrow schema (names, shapes, dtypes), buffer padding and
# protobuf framing: a few KB, and up to 1 KB per column (its schema entry with a 64-character name and its
# dtype and shape metadata, its nodes, buffers and padding: about 350 bytes measured for such a column).
FRAMING_BYTES = 64 * 2**10
COLUMN_FRAMING_BYTES = 2**10


def framing_bytes(columns: int) -> int:
    """The most a payload of `columns` columns holds besides their bytes."""
    return FRAMING_BYTES + columns * COLUMN_FRAMING_BYTES


class CodecError(ValueError):
    """A payload that is not a well-formed replayd Arrow batch."""


def check_dtype(name: str, dtype: np.dtype | str) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError) as exc:  # numpy parses strings like "," and "i4 (2,)" too
        raise CodecError(f"field {name!r}: {dtype!r} is not a numpy dtype") from exc
    if dtype.name not in ALLOWED_DTYPES:
        raise CodecError(f"field {name!r}: dtype {dtype.name} is not supported (use one of {sorted(ALLOWED_DTYPES)})")
    return dtype


@dataclass(frozen=True)
class _Column:
    """How one field maps between numpy and Arrow."""

    name: str
    dtype: np.dtype  # the numpy dtype handed to users
    storage: np.dtype  # what travels (uint8 for bool)
    shape: tuple[int, ...]  # per row
    row_size: int
    values_type: pa.DataType
    arrow_type: pa.DataType  # values_type, or a fixed-size list of row_size values


def _column(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> _Column:
    storage = np.dtype(np.uint8) if dtype == np.bool_ else dtype
    values_type = pa.from_numpy_dtype(storage)
    row_size = math.prod(shape)
    arrow_type = pa.list_(values_type, row_size) if shape else values_type
    return _Column(name, dtype, storage, shape, row_size, values_type, arrow_type)


@dataclass(frozen=True)
class _Plan:
    """A schema and its columns; cached by the layout it describes (encode) or its bytes (decode)."""

    schema: pa.Schema
    schema_message: bytes
    columns: tuple[_Column, ...]
    aliases: tuple[tuple[str, str], ...]


_encode_plans: dict[tuple, _Plan] = {}
_decode_plans: dict[bytes, _Plan] = {}


def _remember(cache: dict, key: object, value: T) -> T:
    if isinstance(key, bytes) and len(key) > _MAX_CACHED_KEY_BYTES:
        return value  # decoded each time instead: held, 512 such keys would fill the server's memory
    if len(cache) >= _CACHE_LIMIT:
        try:
            cache.pop(next(iter(cache)), None)
        except (RuntimeError, StopIteration):  # another thread changed the cache meanwhile: evict next time
            pass
    cache[key] = value
    return value


def _encode_plan(key: tuple, columns: tuple[_Column, ...], aliases: tuple[tuple[str, str], ...]) -> _Plan:
    fields = [
        pa.field(c.name, c.arrow_type, nullable=False,
                 metadata={_DTYPE_KEY: c.dtype.name.encode(), _SHAPE_KEY: json.dumps(list(c.shape)).encode()})
        for c in columns
    ]
    metadata = {_ALIASES_KEY: json.dumps(dict(aliases)).encode()} if aliases else None
    schema = pa.schema(fields, metadata=metadata)
    return _remember(_encode_plans, key, _Plan(schema, schema.serialize().to_pybytes(), columns, aliases))


class _Parts:
    """A write-only file that keeps what Arrow's IPC writer writes as a list, without copying: metadata
    arrives as small bytes, column bodies as pyarrow Buffers over the caller's numpy memory."""

    closed = False

    def __init__(self) -> None:
        self.parts: list = []

    def write(self, data) -> int:
        self.parts.append(data)
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class _Frame:
    """What Arrow's IPC writer emits around the column bodies of one layout (columns and row count): the
    schema message and the record batch's metadata before them, zero padding after each."""

    head: bytes
    pads: tuple[bytes, ...]

    def parts(self, bodies: list[np.ndarray]) -> tuple:
        parts: list = [self.head]
        for body, pad in zip(bodies, self.pads, strict=True):
            parts.append(body)
            if pad:
                parts.append(pad)
        parts.append(_END_OF_STREAM)
        return tuple(parts)


# None: a layout whose bytes a frame does not reproduce; _ONCE: seen once (a frame is learned when a layout
# comes back, as every batch of a stream does; inserts of varying row counts never pay for learning).
_frames: dict[tuple, object] = {}
_UNSEEN, _ONCE = object(), object()


def _learn_frame(bodies: list[np.ndarray], arrow_parts: tuple) -> _Frame | None:
    """The frame of a layout, taken from Arrow's own encoding of it; None unless it reproduces every byte."""
    payload = b"".join(arrow_parts)
    pads = tuple(bytes(-body.nbytes % 8) for body in bodies)
    head_size = len(payload) - sum(b.nbytes + len(p) for b, p in zip(bodies, pads, strict=True)) - len(_END_OF_STREAM)
    if head_size <= 0:
        return None
    frame = _Frame(payload[:head_size], pads)
    return frame if b"".join(frame.parts(bodies)) == payload else None


def _arrow_parts(plan: _Plan, arrays: list[np.ndarray], bodies: list[np.ndarray], body_bytes: int) -> tuple:
    """The payload as Arrow's IPC writer writes it."""
    arrow_columns = []
    for column, array, body in zip(plan.columns, arrays, bodies, strict=True):
        flat = body.reshape(-1)
        values = pa.Array.from_buffers(column.values_type, flat.size, [None, pa.py_buffer(flat.view(column.storage))])
        if column.shape:
            values = pa.Array.from_buffers(column.arrow_type, len(array), [None], children=[values])
        arrow_columns.append(values)
    batch = pa.RecordBatch.from_arrays(arrow_columns, schema=plan.schema)
    if body_bytes < _PARTS_MIN_BYTES:  # small batches: one serialize copy is cheaper than the writer's calls
        return plan.schema_message, batch.serialize(), _END_OF_STREAM
    sink = _Parts()
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), plan.schema) as writer:
        writer.write_batch(batch)
    return tuple(sink.parts)


def _layout(columns: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray], tuple, int | None]:
    """(the arrays sent, in order, aliases left out; the layout key: each sent column's name, dtype and row
    shape, and the aliases; the row count)."""
    arrays: list[np.ndarray] = []
    layout: list[tuple[str, str, tuple[int, ...]]] = []
    aliases: list[tuple[str, str]] = []
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
            aliases.append((name, seen[id(array)]))
            continue
        seen[id(array)] = name
        if not array.dtype.isnative:  # Arrow bodies are little-endian, as is every host replayd runs on
            array = array.astype(array.dtype.newbyteorder("="))
        if array.ndim - 1 > _MAX_RANK or math.prod(array.shape[1:]) > _MAX_ROW_VALUES:  # as decode requires
            raise CodecError(f"field {name!r}: row shape {array.shape[1:]} exceeds rank {_MAX_RANK} or "
                             f"{_MAX_ROW_VALUES} values")
        arrays.append(array)
        layout.append((name, array.dtype.str, array.shape[1:]))
    return arrays, (tuple(layout), tuple(aliases)), num_rows


def encode_parts(columns: Mapping[str, np.ndarray]) -> tuple:
    """`encode` as a tuple of buffers whose concatenation is the payload; column bodies are views of the
    (contiguous) input arrays, so the only copy is the caller's final join (e.g. into a gRPC message).
    The arrays must not change until the parts are joined."""
    arrays, key, num_rows = _layout(columns)
    plan = _encode_plans.get(key)
    if plan is None:
        plan = _encode_plan(key, tuple(_column(n, check_dtype(n, a.dtype), a.shape[1:])
                                       for (n, _, _), a in zip(key[0], arrays, strict=True)), key[1])
    bodies = [np.ascontiguousarray(array) for array in arrays]
    frame_key = (key, num_rows)
    frame = _frames.get(frame_key, _UNSEEN)
    if isinstance(frame, _Frame):
        return frame.parts(bodies)
    parts = _arrow_parts(plan, arrays, bodies, sum(body.nbytes for body in bodies))
    if frame is _UNSEEN:
        _remember(_frames, frame_key, _ONCE)
    elif frame is _ONCE:  # Arrow encoded this layout; the frame is learned from its bytes
        _remember(_frames, frame_key, _learn_frame(bodies, parts))
    return parts


@dataclass(frozen=True)
class InPlace:
    """Where the columns of one layout lie in its payload, to write a batch of that layout in place: the
    payload is allocated first, its columns are gathered straight into views of it, and the batch is never
    copied into a message afterwards."""

    names: tuple[str, ...]  # the batch's columns, in order
    key: tuple  # the layout key (see _layout) that a batch written in place must still have
    num_rows: int
    frame: _Frame
    bodies: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]  # each sent column: name, dtype, array shape
    size: int  # payload bytes

    def views(self, payload: np.ndarray) -> dict[str, np.ndarray]:
        """Writes the frame's bytes into `payload` (uint8, `size` bytes) and returns the batch to gather into:
        writable views of `payload` for every column, in order (an alias is its column's view)."""
        head = len(self.frame.head)
        payload[:head] = np.frombuffer(self.frame.head, np.uint8)
        at, views = head, {}
        for (name, dtype, shape), pad in zip(self.bodies, self.frame.pads, strict=True):
            nbytes = math.prod(shape) * dtype.itemsize
            views[name] = payload[at:at + nbytes].view(dtype).reshape(shape)
            at += nbytes
            payload[at:at + len(pad)] = 0
            at += len(pad)
        payload[at:] = np.frombuffer(_END_OF_STREAM, np.uint8)
        for name, target in self.key[1]:  # the layout's aliases
            views[name] = views[target]
        return {name: views[name] for name in self.names}

    def written(self, batch: Mapping[str, np.ndarray], views: Mapping[str, np.ndarray]) -> bool:
        """Whether the payload `views` lie in now holds `batch`: the batch has this layout, and every column
        that is not the view it was given (a column a caller replaced instead of writing into) is copied in."""
        if tuple(batch) != self.names or _layout(batch)[1:] != (self.key, self.num_rows):
            return False
        for name, _, _ in self.bodies:
            if batch[name] is not views[name]:
                views[name][...] = batch[name]
        return True


def in_place(columns: Mapping[str, np.ndarray]) -> InPlace | None:
    """How to write batches of the layout of `columns` in place, once encode_parts has learned its frame
    (from its second batch of that layout on); None before, or for a layout Arrow frames otherwise."""
    arrays, key, num_rows = _layout(columns)
    frame = _frames.get((key, num_rows))
    if not isinstance(frame, _Frame):
        return None
    bodies = tuple((name, np.dtype(dtype), array.shape) for (name, dtype, _), array in zip(key[0], arrays, strict=True))
    size = len(frame.head) + sum(array.nbytes for array in arrays) + sum(map(len, frame.pads)) + len(_END_OF_STREAM)
    return InPlace(tuple(columns), key, num_rows, frame, bodies, size)


def encoded_size(parts: tuple) -> int:
    """The payload size of `encode_parts`'s result."""
    return sum(memoryview(part).nbytes for part in parts)


def encode(columns: Mapping[str, np.ndarray]) -> bytes:
    """Encodes equal-length columns into one Arrow IPC stream (schema + one record batch)."""
    return b"".join(encode_parts(columns))


def _decode_plan(schema_message: bytes, schema: pa.Schema) -> _Plan:
    columns = []
    for field in schema:
        metadata = field.metadata or {}
        if _DTYPE_KEY not in metadata or _SHAPE_KEY not in metadata:
            raise CodecError(f"field {field.name!r}: missing dtype/shape metadata")
        try:
            # Bodies are little-endian whatever the metadata's byte order says (">f4" is float32 too).
            dtype = np.dtype(check_dtype(field.name, metadata[_DTYPE_KEY].decode()).name)
            shape = json.loads(metadata[_SHAPE_KEY])
        except (TypeError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise CodecError(f"field {field.name!r}: bad dtype/shape metadata ({exc})") from exc
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):  # not 1.5, true, 1e999
            raise CodecError(f"field {field.name!r}: shape metadata must be a list of integers, got {shape!r}")
        shape = tuple(shape)
        if any(d < 0 for d in shape):
            raise CodecError(f"field {field.name!r}: negative dimension in shape {shape}")
        if len(shape) > _MAX_RANK or math.prod(shape) > _MAX_ROW_VALUES:
            raise CodecError(f"field {field.name!r}: row shape {shape} exceeds rank {_MAX_RANK} or "
                             f"{_MAX_ROW_VALUES} values")
        column = _column(field.name, dtype, shape)
        if field.type != column.arrow_type:
            raise CodecError(f"field {field.name!r}: arrow type {field.type} does not match dtype {dtype.name} "
                             f"and row shape {shape} (expected {column.arrow_type})")
        if any(c.name == field.name for c in columns):
            raise CodecError(f"field {field.name!r} appears twice")
        columns.append(column)
    aliases: tuple[tuple[str, str], ...] = ()
    if schema.metadata and _ALIASES_KEY in schema.metadata:
        names = {c.name for c in columns}
        try:
            aliases = tuple(json.loads(schema.metadata[_ALIASES_KEY]).items())
        except (ValueError, AttributeError, RecursionError) as exc:
            raise CodecError(f"bad alias metadata: {exc}") from exc
        if any(not isinstance(a, str) or not isinstance(target, str) or target not in names for a, target in aliases):
            raise CodecError(f"bad alias metadata: {aliases} must name fields of the batch")
    return _remember(_decode_plans, schema_message, _Plan(schema, schema_message, tuple(columns), aliases))


@dataclass(frozen=True)
class _Layout:
    """Where the columns of a validated payload lie, for payloads with the same metadata bytes and size."""

    size: int
    columns: tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]  # name, storage dtype, array shape, offset
    booleans: frozenset[str]
    aliases: tuple[tuple[str, str], ...]


_layouts: dict[bytes, _Layout] = {}


def _head_size(data: memoryview) -> int:
    """The size of a payload's schema message and record batch metadata (0 if they are not well framed)."""
    at = 0
    for _ in range(2):
        if len(data) < at + _MESSAGE_PREFIX.size:
            return 0
        continuation, length = _MESSAGE_PREFIX.unpack_from(data, at)
        if continuation != _CONTINUATION or length < 0:
            return 0
        at += _MESSAGE_PREFIX.size + length
    return at if at <= len(data) else 0


def _learn_layout(data: memoryview, head_size: int, body_size: int, plan: _Plan,
                  columns: dict[str, np.ndarray]) -> None:
    if head_size + body_size + len(_END_OF_STREAM) != len(data) or data[-len(_END_OF_STREAM):] != _END_OF_STREAM:
        return  # only payloads that are exactly schema, batch and end-of-stream
    base = np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0]
    placed = []
    for column in plan.columns:
        array = columns[column.name]
        offset = array.__array_interface__["data"][0] - base
        if array.size == 0 or not array.flags.c_contiguous or not 0 <= offset <= len(data) - array.nbytes:
            return  # not a plain view into the payload: no shortcut for this layout
        placed.append((column.name, column.storage, array.shape, offset))
    booleans = frozenset(c.name for c in plan.columns if c.dtype == np.bool_)
    _remember(_layouts, bytes(data[:head_size]), _Layout(len(data), tuple(placed), booleans, plan.aliases))


def _decode_known(data: memoryview, layout: _Layout) -> dict[str, np.ndarray]:
    columns = {}
    for name, storage, shape, offset in layout.columns:
        flat = np.frombuffer(data, dtype=storage, count=math.prod(shape), offset=offset)
        if name in layout.booleans:
            if flat.max() > 1:
                raise CodecError(f"field {name!r}: boolean bytes must be 0 or 1")
            flat = flat.view(np.bool_)
        columns[name] = flat.reshape(shape)
    for name, target in layout.aliases:
        columns[name] = columns[target]
    return columns


def decode(payload: bytes | memoryview | pa.Buffer) -> dict[str, np.ndarray]:
    """Decodes one Arrow IPC stream into read-only numpy views over `payload`."""
    data = memoryview(payload)
    # Shortcut for read-only bytes (what gRPC hands over) whose layout was validated before.
    head_size = _head_size(data) if data.readonly and data.ndim == 1 and data.format in ("B", "b", "c") else 0
    if head_size:
        data = data.cast("B")
        layout = _layouts.get(bytes(data[:head_size]))
        if layout is not None and layout.size == len(data) and data[-len(_END_OF_STREAM):] == _END_OF_STREAM:
            return _decode_known(data, layout)
    plan, columns, body_size = _decode_arrow(payload)
    if head_size and data.c_contiguous:
        _learn_layout(data, head_size, body_size, plan, columns)
    return columns


def _flatbuffer_field(data: bytes, table: int, index: int) -> int | None:
    """Where field `index` of the flatbuffers table at `table` lies in `data`; None if it is absent."""
    vtable = table - _read(data, "<i", table)
    vtable_size = _read(data, "<H", vtable)
    entry = 4 + 2 * index
    offset = _read(data, "<H", vtable + entry) if entry + 2 <= vtable_size else 0
    return table + offset if offset else None


def _read(data: bytes, fmt: str, at: int) -> int:
    if not 0 <= at <= len(data) - struct.calcsize(fmt):  # unpack_from would count a negative offset from the end
        raise CodecError("malformed Arrow IPC payload: record batch metadata out of bounds")
    return struct.unpack_from(fmt, data, at)[0]


def _body_compression(metadata: bytes) -> int | None:
    """The codec (0: LZ4 frame, 1: ZSTD) a record batch message's metadata declares for its body, if any.
    Message: header (field 2, the RecordBatch table); RecordBatch: compression (field 3, a BodyCompression
    table whose field 0 is the codec, default LZ4 frame)."""
    message = _read(metadata, "<I", 0)
    header = _flatbuffer_field(metadata, message, 2)
    if header is None:
        return None
    batch = header + _read(metadata, "<I", header)
    compression = _flatbuffer_field(metadata, batch, 3)
    if compression is None:
        return None
    table = compression + _read(metadata, "<I", compression)
    codec_at = _flatbuffer_field(metadata, table, 0)
    return 0 if codec_at is None else _read(metadata, "<b", codec_at)


def _decode_arrow(payload: bytes | memoryview | pa.Buffer) -> tuple[_Plan, dict[str, np.ndarray], int]:
    """Decodes and fully validates a payload with Arrow's IPC reader: (plan, columns, record batch body size)."""
    buffer = payload if isinstance(payload, pa.Buffer) else pa.py_buffer(payload)
    try:
        reader = pa.ipc.MessageReader.open_stream(buffer)
        schema_message = reader.read_next_message()
        if schema_message.type != "schema":
            raise CodecError(f"expected a schema message first, got {schema_message.type}")
        key = schema_message.metadata.to_pybytes()
        plan = _decode_plans.get(key)
        if plan is None:
            plan = _decode_plan(key, pa.ipc.read_schema(schema_message))
        batch_message = reader.read_next_message()
        if batch_message.type != "record batch":
            raise CodecError(f"expected one record batch after the schema, got {batch_message.type}")
        compression = _body_compression(batch_message.metadata.to_pybytes())
        if compression is not None:
            # Arrow's reader would inflate every buffer to the size the body claims, before anything is
            # checked: a few KB of zstd claim gigabytes, far past the message limit. replayd never compresses.
            name = {0: "lz4", 1: "zstd"}.get(compression, f"codec {compression}")
            raise CodecError(f"compressed record batches are not supported (got {name}); send the body "
                             "uncompressed (gRPC compresses messages if the channel asks it to)")
        batch = pa.ipc.read_record_batch(batch_message, plan.schema)
        # The IPC reader trusts lengths in the message; buffers shorter than they claim would be read past.
        batch.validate(full=True)
        try:
            reader.read_next_message()
        except StopIteration:
            pass
        else:
            raise CodecError("expected exactly one record batch, got more")
    except StopIteration as exc:
        raise CodecError("malformed Arrow IPC payload: the stream ends before its record batch") from exc
    except (pa.ArrowException, OSError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"malformed Arrow IPC payload: {exc}") from exc
    columns = {}
    for column, array in zip(plan.columns, batch.columns, strict=True):
        if array.null_count:
            raise CodecError(f"field {column.name!r}: null values are not allowed")
        values = array.flatten() if column.shape else array
        if values.null_count:  # a fixed-size list's child values may hold nulls of their own
            raise CodecError(f"field {column.name!r}: null values are not allowed")
        flat = values.to_numpy(zero_copy_only=True)
        if column.dtype == np.bool_:
            if flat.size and flat.max() > 1:
                raise CodecError(f"field {column.name!r}: boolean bytes must be 0 or 1")
            flat = flat.view(np.bool_)
        columns[column.name] = flat.reshape((len(array), *column.shape))
    for name, target in plan.aliases:
        columns[name] = columns[target]
    return plan, columns, batch_message.body.size
