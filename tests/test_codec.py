import numpy as np
import pyarrow as pa
import pytest

from service.wire import codec


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
