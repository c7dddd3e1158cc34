import numpy as np
import pyarrow as pa
import pytest

from replayd.wire import codec


def test_round_trip_keeps_dtype_and_shape_zero_copy() -> None:
    rng = np.random.default_rng(0)
    columns = {
        "obs": rng.integers(0, 255, (5, 84, 84, 4), dtype=np.uint8),
        "vec": rng.random((5, 376), dtype=np.float32),
        "action": rng.integers(0, 9, 5),
        "flag": np.array([True, False, True, True, False]),
        "half": rng.random((5, 2, 3)).astype(np.float16),
        "u64": np.array([2**63 + 5, 1, 2, 3, 4], dtype=np.uint64),
    }
    payload = codec.encode(columns)
    decoded = codec.decode(payload)
    assert list(decoded) == list(columns)
    for name, array in columns.items():
        assert decoded[name].dtype == array.dtype, name
        assert decoded[name].shape == array.shape, name
        np.testing.assert_array_equal(decoded[name], array)
        assert not decoded[name].flags.writeable  # a view into the received bytes, not a copy
    obs_address = decoded["obs"].__array_interface__["data"][0]
    base = np.frombuffer(payload, dtype=np.uint8).__array_interface__["data"][0]
    assert base <= obs_address < base + len(payload)


def test_same_array_under_two_names_is_sent_once() -> None:
    obs = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    alone = len(codec.encode({"next_obs": obs}))
    both = len(codec.encode({"next_obs": obs, "bootstrap_obs": obs}))
    assert both < alone + 200
    decoded = codec.decode(codec.encode({"next_obs": obs, "bootstrap_obs": obs}))
    np.testing.assert_array_equal(decoded["bootstrap_obs"], obs)


@pytest.mark.parametrize("payload", [b"", b"garbage", b"\xff\xff\xff\xff" + b"\x00" * 20])
def test_malformed_bytes_raise_codec_error(payload: bytes) -> None:
    with pytest.raises(codec.CodecError):
        codec.decode(payload)


def test_foreign_arrow_without_metadata_is_rejected() -> None:
    batch = pa.RecordBatch.from_pydict({"x": [1, 2, 3]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    with pytest.raises(codec.CodecError, match="'x': missing dtype/shape metadata"):
        codec.decode(sink.getvalue())


def test_unsupported_dtype_names_the_field() -> None:
    with pytest.raises(codec.CodecError, match=r"'name'.*not supported"):
        codec.encode({"name": np.array(["a", "b"])})


def test_unequal_rows_name_the_field() -> None:
    with pytest.raises(codec.CodecError, match="'b': 2 rows, but earlier fields have 3"):
        codec.encode({"a": np.zeros(3), "b": np.zeros(2)})


def test_schema_cache_keeps_batches_of_different_layouts_apart() -> None:
    a = {"x": np.arange(6, dtype=np.int64).reshape(3, 2)}
    b = {"x": np.arange(6, dtype=np.int32).reshape(3, 2)}
    c = {"x": np.arange(6, dtype=np.int64).reshape(2, 3)}
    for columns in (a, b, c, a, c, b):
        decoded = codec.decode(codec.encode(columns))
        assert decoded["x"].dtype == columns["x"].dtype and decoded["x"].shape == columns["x"].shape
        np.testing.assert_array_equal(decoded["x"], columns["x"])


def test_two_record_batches_are_rejected() -> None:
    reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(codec.encode({"x": np.zeros(3)})))
    schema = reader.read_next_message().serialize().to_pybytes()
    record = reader.read_next_message().serialize().to_pybytes()
    with pytest.raises(codec.CodecError, match="exactly one record batch"):
        codec.decode(schema + record + record + b"\xff\xff\xff\xff\x00\x00\x00\x00")
    with pytest.raises(codec.CodecError, match="ends before its record batch"):
        codec.decode(schema + b"\xff\xff\xff\xff\x00\x00\x00\x00")


LAYOUTS = [
    # name -> (dtype, row shape); sizes chosen so that bodies need padding to 8 bytes
    {"obs": (np.uint8, (3, 5)), "flag": (np.bool_, ()), "half": (np.float16, (3,)), "id": (np.uint64, ())},
    {"obs": (np.float32, (7,)), "action": (np.int64, ()), "reward": (np.float32, ())},
    {"big": (np.uint8, (84, 84, 4)), "small": (np.int8, ())},  # over the writer's parts threshold
]


def _columns(layout: dict, rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    columns = {name: rng.integers(0, 2 if dtype == np.bool_ else 100, (rows, *shape)).astype(dtype)
               for name, (dtype, shape) in layout.items()}
    if "obs" in columns:
        columns["next_obs"] = columns["obs"]  # an alias
    return columns


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_encoding_a_known_layout_gives_arrows_bytes(layout: dict, rows: int) -> None:
    for seed in (0, 1):  # the second time a layout comes, its frame is learned
        codec.encode(_columns(layout, rows, seed=seed))
    names = (*layout, "next_obs") if "obs" in layout else tuple(layout)
    assert any(isinstance(frame, codec._Frame) for (key, count), frame in codec._frames.items()
               if count == rows and tuple(name for name, _, _ in key[0]) + tuple(a for a, _ in key[1]) == names)
    columns = _columns(layout, rows, seed=2)
    parts = codec.encode_parts(columns)
    assert codec.encoded_size(parts) == len(b"".join(parts))
    fast = b"".join(parts)
    codec._frames.clear()  # Arrow's writer again, for the same columns
    assert fast == codec.encode(columns)
    table = pa.ipc.open_stream(fast).read_all()  # Arrow's own reader agrees
    assert table.num_rows == rows
    decoded = codec.decode(fast)
    for name, array in columns.items():
        np.testing.assert_array_equal(decoded[name], array)
        assert decoded[name].dtype == array.dtype


def test_encoded_parts_are_views_of_the_columns() -> None:
    obs = np.arange(2 * 300_000, dtype=np.uint32).astype(np.uint8).reshape(2, 300_000)
    address = obs.__array_interface__["data"][0]
    for _ in range(3):  # Arrow's writer, then the learned frame
        parts = codec.encode_parts({"obs": obs, "a": np.arange(2)})
        bodies = [p for p in parts if memoryview(p).nbytes == obs.nbytes]
        assert len(bodies) == 1
        assert np.frombuffer(bodies[0], np.uint8).__array_interface__["data"][0] == address


def test_decode_maps_a_validated_layout_again() -> None:
    layout = LAYOUTS[0]
    first = codec.encode(_columns(layout, 5, seed=0))
    codec.decode(first)  # validated by Arrow; its layout is remembered
    columns = _columns(layout, 5, seed=2)
    payload = codec.encode(columns)
    decoded = codec.decode(payload)
    base = np.frombuffer(payload, np.uint8).__array_interface__["data"][0]
    for name, array in columns.items():
        np.testing.assert_array_equal(decoded[name], array)
        assert decoded[name].dtype == array.dtype and not decoded[name].flags.writeable
        address = decoded[name].__array_interface__["data"][0]
        assert base <= address < base + len(payload)  # a view, not a copy
    assert decoded["next_obs"] is decoded["obs"]
    # The same checks as Arrow's path: booleans are 0/1, and the size must be the validated one.
    flag = decoded["flag"].__array_interface__["data"][0] - base
    corrupt = bytearray(payload)
    corrupt[flag] = 2
    with pytest.raises(codec.CodecError, match="'flag': boolean bytes must be 0 or 1"):
        codec.decode(bytes(corrupt))
    with pytest.raises(codec.CodecError):
        codec.decode(payload[:-40])  # the same head over a body shorter than it says
    # Other buffer types still decode (bytearray: through Arrow; it is writable).
    for other in (memoryview(payload), pa.py_buffer(payload), bytearray(payload)):
        np.testing.assert_array_equal(codec.decode(other)["obs"], columns["obs"])


def test_trailing_bytes_after_the_stream_are_not_remembered() -> None:
    columns = {"x": np.arange(12, dtype=np.int32).reshape(4, 3)}
    payload = codec.encode(columns) + b"\x00" * 8
    for _ in range(2):
        np.testing.assert_array_equal(codec.decode(payload)["x"], columns["x"])
    assert not any(layout.size == len(payload) for layout in codec._layouts.values())


@pytest.mark.parametrize("dtype", [",", "i4 (2,)", "not-a-dtype", 3.5])
def test_strings_numpy_cannot_parse_as_dtypes_are_codec_errors(dtype: object) -> None:
    with pytest.raises(codec.CodecError, match=r"'f': .* is not a numpy dtype"):
        codec.check_dtype("f", dtype)


@pytest.mark.parametrize("aliases", [b'{"y": ["x"]}', b'{"y": 3}', b'{"y": "nope"}', b"[1, 2]"])
def test_malformed_alias_metadata_is_a_codec_error(aliases: bytes) -> None:
    reader = pa.ipc.open_stream(codec.encode({"x": np.zeros(3)}))
    batch = reader.read_next_batch()
    schema = batch.schema.with_metadata({**(batch.schema.metadata or {}), b"aliases": aliases})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch(batch.columns, schema=schema))
    with pytest.raises(codec.CodecError, match="bad alias metadata"):
        codec.decode(sink.getvalue().to_pybytes())


def test_big_endian_arrays_arrive_with_their_values() -> None:
    for dtype in (">f4", ">i8", ">f2"):
        array = np.arange(12, dtype=dtype).reshape(4, 3)
        for _ in range(3):  # the learned-frame path too
            decoded = codec.decode(codec.encode({"a": array}))["a"]
            np.testing.assert_array_equal(decoded, array)
            assert decoded.dtype == np.dtype(dtype).newbyteorder("=")


def _payload(array: pa.Array, dtype: bytes, shape: bytes) -> bytes:
    field = pa.field("x", array.type, metadata={codec._DTYPE_KEY: dtype, codec._SHAPE_KEY: shape})
    batch = pa.record_batch([array], schema=pa.schema([field]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("shape", [b"[1e999]", b"[1.5, 2]", b"[true, 3]", b'"3"', b"3"])
def test_shape_metadata_must_be_a_list_of_integers(shape: bytes) -> None:
    array = pa.array([[1.0, 2.0, 3.0]], type=pa.list_(pa.float32(), 3))
    with pytest.raises(codec.CodecError, match="'x'"):
        codec.decode(_payload(array, b"float32", shape))


def test_nulls_inside_a_rows_values_are_a_codec_error() -> None:
    array = pa.array([[1.0, None, 3.0]], type=pa.list_(pa.float32(), 3))
    with pytest.raises(codec.CodecError, match="'x': null values are not allowed"):
        codec.decode(_payload(array, b"float32", b"[3]"))


def test_rows_too_large_to_describe_are_refused_when_encoding() -> None:
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=(1, 2**31), strides=(0, 0))
    with pytest.raises(codec.CodecError, match="'x': row shape"):
        codec.encode({"x": huge})


def test_big_endian_dtype_metadata_decodes_in_native_order_every_time() -> None:
    """A payload whose dtype metadata says '>f4' (bodies are little-endian whatever it says) decodes the same
    the first time (through Arrow) and every time after (from the learned layout), never byte-swapped."""
    values = pa.array(np.array([1.0, 2.0, 3.0], np.float32))
    schema = pa.schema([pa.field("x", pa.float32(), metadata={b"dtype": b">f4", b"shape": b"[]"})])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays([values], schema=schema))
    payload = sink.getvalue().to_pybytes()
    for _ in range(3):
        decoded = codec.decode(payload)["x"]
        assert decoded.dtype == np.dtype("float32") and decoded.tolist() == [1.0, 2.0, 3.0]


def test_rows_of_a_rank_decode_refuses_are_not_encoded() -> None:
    with pytest.raises(codec.CodecError, match="exceeds rank 32"):
        codec.encode({"a": np.zeros((1,) * 34)})
    assert codec.decode(codec.encode({"a": np.zeros((1,) * 33)}))["a"].shape == (1,) * 33


def test_a_boolean_byte_other_than_0_or_1_is_refused_on_arrows_path() -> None:
    columns = {"arrow_flag": np.array([True, False, True]), "n": np.arange(3)}
    payload = codec.encode(columns)
    base = np.frombuffer(payload, np.uint8).__array_interface__["data"][0]
    flag = codec.decode(payload)["arrow_flag"].__array_interface__["data"][0] - base
    corrupt = bytearray(payload)  # writable: decoded through Arrow's reader, never a learned layout
    corrupt[flag + 1] = 2
    with pytest.raises(codec.CodecError, match="'arrow_flag': boolean bytes must be 0 or 1"):
        codec.decode(corrupt)
    np.testing.assert_array_equal(codec.decode(bytearray(payload))["arrow_flag"], columns["arrow_flag"])


def test_an_arrow_type_that_does_not_match_the_dtype_metadata_is_refused() -> None:
    with pytest.raises(codec.CodecError, match="'x': arrow type int32 does not match dtype float32"):
        codec.decode(_payload(pa.array([1, 2], pa.int32()), b"float32", b"[]"))
    with pytest.raises(codec.CodecError, match="'x': arrow type"):  # row shape [3], but rows of 2 values
        codec.decode(_payload(pa.array([[1.0, 2.0]], type=pa.list_(pa.float32(), 2)), b"float32", b"[3]"))


def test_null_rows_are_a_codec_error() -> None:
    rows = pa.array([None, [1.0, 2.0, 3.0]], type=pa.list_(pa.float32(), 3))
    with pytest.raises(codec.CodecError, match="'x': null values are not allowed"):
        codec.decode(_payload(rows, b"float32", b"[3]"))
    with pytest.raises(codec.CodecError, match="'x': null values are not allowed"):
        codec.decode(_payload(pa.array([1.0, None], pa.float32()), b"float32", b"[]"))


def test_a_field_name_that_appears_twice_is_refused() -> None:
    metadata = {codec._DTYPE_KEY: b"float32", codec._SHAPE_KEY: b"[]"}
    schema = pa.schema([pa.field("x", pa.float32(), metadata=metadata)] * 2)
    values = pa.array([1.0, 2.0], pa.float32())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch([values, values], schema=schema))
    with pytest.raises(codec.CodecError, match="'x' appears twice"):
        codec.decode(sink.getvalue().to_pybytes())


def test_a_negative_dimension_in_shape_metadata_is_refused() -> None:
    array = pa.array([[1.0]], type=pa.list_(pa.float32(), 1))
    with pytest.raises(codec.CodecError, match=r"'x': negative dimension in shape \(-1,\)"):
        codec.decode(_payload(array, b"float32", b"[-1]"))


def test_shape_metadata_of_a_rank_over_32_is_refused_when_decoding() -> None:
    array = pa.array([[1.0]], type=pa.list_(pa.float32(), 1))
    assert codec.decode(_payload(array, b"float32", b"[" + b", ".join([b"1"] * 32) + b"]"))["x"].ndim == 33
    with pytest.raises(codec.CodecError, match=r"'x': row shape .* exceeds rank 32"):
        codec.decode(_payload(array, b"float32", b"[" + b", ".join([b"1"] * 33) + b"]"))


def test_a_batch_claiming_more_rows_than_its_buffers_hold_is_refused() -> None:
    """The IPC reader trusts the lengths in a record batch's metadata: one claiming 6 rows over a buffer of 5
    float32 values would be read past its end."""
    payload = codec.encode({"claims": np.arange(5, dtype=np.float32)})
    reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(payload))
    reader.read_next_message()
    metadata = reader.read_next_message().metadata.to_pybytes()
    at, five = payload.find(metadata), (5).to_bytes(8, "little")
    corrupt = bytearray(payload)
    lengths = [at + i for i in range(len(metadata)) if metadata[i:i + 8] == five]  # the batch's, its field's
    assert len(lengths) == 2
    for offset in lengths:
        corrupt[offset:offset + 8] = (6).to_bytes(8, "little")
    for attempt in (bytes(corrupt), corrupt):
        with pytest.raises(codec.CodecError, match="malformed Arrow IPC payload"):
            codec.decode(attempt)


def test_payload_metadata_past_the_cache_limit_is_decoded_but_not_held() -> None:
    """Every payload is decoded (its metadata cached) before the buffer compares its schema: 20 inserts of
    10 MB of padded field metadata held 657 MB of the server's memory, and 512 would have exhausted it."""
    metadata = {codec._DTYPE_KEY: b"float32", codec._SHAPE_KEY: b"[]", b"pad": b"x" * (1 << 18)}
    padded = pa.schema([pa.field("obs", pa.float32(), nullable=False, metadata=metadata)])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, padded) as writer:
        writer.write_batch(pa.record_batch([pa.array(np.arange(3, dtype=np.float32))], schema=padded))
    payload = sink.getvalue().to_pybytes()
    plans, layouts = len(codec._decode_plans), len(codec._layouts)
    for _ in range(2):
        np.testing.assert_array_equal(codec.decode(payload)["obs"], np.arange(3, dtype=np.float32))
    assert (len(codec._decode_plans), len(codec._layouts)) == (plans, layouts)
    small = codec.encode({"obs": np.arange(3, dtype=np.float32)})
    codec.decode(small)
    codec.decode(small)  # a layout is learned when it comes back
    assert bytes(small[:codec._head_size(memoryview(small))]) in codec._layouts


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_a_compressed_record_batch_is_refused_before_it_is_decompressed(compression: str) -> None:
    """Arrow's reader allocates and inflates every buffer of a compressed body to the size the body claims:
    a 66 KB zstd payload of 2 GiB of zeros made the server allocate 2 GiB, far past the message limit that
    bounds what a call may make it hold. replayd bodies are never compressed (decoding is zero-copy)."""
    batch = pa.ipc.open_stream(codec.encode({"obs": np.zeros((4096, 8), np.float32)})).read_next_batch()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
        writer.write_batch(batch)
    payload = sink.getvalue().to_pybytes()
    assert len(payload) < 4096 * 8 * 4 // 10  # it does inflate
    allocated = pa.total_allocated_bytes()
    with pytest.raises(codec.CodecError, match=f"compressed record batches are not supported.*{compression}"):
        codec.decode(payload)
    assert pa.total_allocated_bytes() == allocated
