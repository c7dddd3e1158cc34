import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.wire import codec
from service.wire import replay_pb2 as pb
from service.wire.codec import CodecError
from service.wire.frames import InsertFrame, sample_response_batch, sample_response_bytes, split_bytes_field


@given(steps=st.binary(max_size=3000), ids=st.lists(st.integers(0, 2**64 - 1), max_size=5),
       rows=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5), buffer=st.text(max_size=20))
def test_hand_framing_matches_protobuf(steps: bytes, ids: list[int], rows: list[int], buffer: str) -> None:
    message = pb.InsertRequest(buffer=buffer, steps=steps, episode_ids=ids, span_rows=rows, begins=[True] * len(ids))
    raw = message.SerializeToString()
    frame = InsertFrame.parse(raw)
    assert bytes(frame.steps) == steps
    without_steps = pb.InsertRequest()
    without_steps.CopyFrom(message)
    without_steps.ClearField("steps")
    assert frame.request == without_steps
    assert pb.InsertRequest.FromString(frame.serialize()) == message
    assert bytes(sample_response_batch(pb.SampleResponse(batch=steps).SerializeToString())) == steps
    assert pb.SampleResponse.FromString(sample_response_bytes(steps)).batch == steps


MALFORMED = [b"\x12\x05abc", b"\x80", b"\x0f\x00", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"]


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_frames_raise_codec_error(raw: bytes) -> None:
    with pytest.raises(CodecError):
        split_bytes_field(raw, 2)


@given(parts=st.lists(st.binary(max_size=300), max_size=6))
def test_sample_response_from_parts_is_protobuf(parts: list[bytes]) -> None:
    raw = sample_response_bytes(tuple(parts))
    assert pb.SampleResponse.FromString(raw).batch == b"".join(parts)
    assert bytes(sample_response_batch(raw)) == b"".join(parts)
    if any(parts):  # protobuf itself leaves an empty field out; the hand framing writes it, empty
        assert raw == pb.SampleResponse(batch=b"".join(parts)).SerializeToString()


def test_sample_response_joins_numpy_parts_once() -> None:
    obs = np.arange(200_000, dtype=np.uint32).astype(np.uint8)
    flags = np.array([True, False, True])
    payload = codec.encode_parts({"obs": obs.reshape(4, 50_000), "flag": np.array([True, False, True, True])})
    raw = sample_response_bytes(payload)
    assert pb.SampleResponse.FromString(raw).batch == b"".join(payload)
    decoded = codec.decode(sample_response_batch(raw))
    np.testing.assert_array_equal(decoded["obs"].reshape(-1), obs)
    assert pb.SampleResponse.FromString(sample_response_bytes((b"ab", flags))).batch == b"ab\x01\x00\x01"
