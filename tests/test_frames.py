import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from replayd.wire import codec
from replayd.wire import replay_pb2 as pb
from replayd.wire.codec import CodecError
from replayd.wire.frames import (
    SAMPLE_RESPONSE_HEAD_BYTES,
    InsertFrame,
    sample_response_batch,
    sample_response_bytes,
    sample_response_head,
    split_bytes_field,
)


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


MALFORMED = [b"\x12\x05abc", b"\x80", b"\x0f\x00", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
             # an 11-byte key (field 1, varint) followed by its value: complete, but longer than any varint
             b"\x88" + b"\x80" * 9 + b"\x00\x01"]


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_frames_raise_codec_error(raw: bytes) -> None:
    with pytest.raises(CodecError):
        split_bytes_field(raw, 2)


@pytest.mark.parametrize(("key", "protobuf_accepts"), [
    (b"\x92\x80\x80\x80\x00", True),  # field 2 (steps), length-delimited, padded to 5 bytes: still 32-bit
    (b"\x92\x80\x80\x80\x80\x00", False),  # the same key in 6 bytes
    (b"\x92\x80\x80\x80\x10", False),  # 5 bytes whose value needs more than 32 bits
    (b"\x02", False),  # field number 0
])
def test_a_steps_key_is_read_as_protobuf_reads_it(key: bytes, protobuf_accepts: bool) -> None:
    """The hand parse takes `steps` without protobuf looking at its key, so it must refuse the keys protobuf
    refuses (and accept the ones it accepts): the same message is valid or invalid to both."""
    raw = pb.InsertRequest(buffer="b", span_rows=[1]).SerializeToString() + key + b"\x02hi"
    if protobuf_accepts:
        assert pb.InsertRequest.FromString(raw).steps == b"hi"
        assert bytes(InsertFrame.parse(raw).steps) == b"hi"
    else:
        with pytest.raises(DecodeError):
            pb.InsertRequest.FromString(raw)
        with pytest.raises(CodecError, match="malformed protobuf"):
            split_bytes_field(raw, pb.InsertRequest.STEPS_FIELD_NUMBER)


def _field(number: int, wire_type: int, body: bytes) -> bytes:
    """A protobuf field: its key as a varint, then `body` (the value, as the wire type lays it out)."""
    key, out = number << 3 | wire_type, bytearray()
    while key > 0x7F:
        out.append(key & 0x7F | 0x80)
        key >>= 7
    return bytes(out) + bytes([key]) + body


def test_unknown_fixed_width_fields_are_skipped_whole() -> None:
    """An InsertRequest from a newer client, with unknown fixed64 and fixed32 fields after its steps: the
    hand parse reads the same steps and fields as protobuf's (the unknown fields' bytes, if skipped short,
    would be read as fields: these look like a `steps` field of their own)."""
    message = pb.InsertRequest(buffer="b", steps=b"arrow", episode_ids=[7], span_rows=[3], begins=[True])
    looks_like_steps = b"\x12\x02hi"  # field 2 (steps), 2 bytes
    raw = (message.SerializeToString() + _field(99, 1, b"\0\0\0\0" + looks_like_steps)
           + _field(98, 5, looks_like_steps) + _field(5, 0, b"\x00"))
    parsed = pb.InsertRequest.FromString(raw)
    assert parsed.steps == b"arrow" and list(parsed.begins) == [True, False]
    frame = InsertFrame.parse(raw)
    assert bytes(frame.steps) == parsed.steps
    assert list(frame.request.begins) == [True, False] and list(frame.request.episode_ids) == [7]
    assert pb.InsertRequest.FromString(frame.serialize()) == parsed


def test_a_message_with_a_group_is_read_as_protobuf_reads_it() -> None:
    """Groups (wire types 3 and 4) are valid protobuf, kept as unknown fields: the scan leaves them to
    protobuf's parser, a group left open included, rather than refuse them (CodecError)."""
    group = _field(5, 3, _field(1, 0, b"\x01")) + _field(5, 4, b"")  # unknown field 5: a group {1: 1}
    raw = pb.InsertRequest(buffer="b", steps=b"arrow", span_rows=[3]).SerializeToString() + group
    assert bytes(InsertFrame.parse(raw).steps) == pb.InsertRequest.FromString(raw).steps == b"arrow"
    assert list(InsertFrame.parse(raw).request.span_rows) == [3]
    response = pb.SampleResponse(batch=b"arrow bytes").SerializeToString() + group
    assert bytes(sample_response_batch(response)) == pb.SampleResponse.FromString(response).batch
    with pytest.raises(DecodeError):
        InsertFrame.parse(raw[:-1])  # the group's end cut off


def test_the_last_steps_field_wins_as_in_protobuf() -> None:
    """Protobuf merges a repeated occurrence of a bytes field by keeping the last: so does the hand parse."""
    raw = (pb.InsertRequest(buffer="b", steps=b"first", span_rows=[1]).SerializeToString()
           + pb.InsertRequest(steps=b"second", span_rows=[2]).SerializeToString())
    parsed = pb.InsertRequest.FromString(raw)
    assert parsed.steps == b"second"
    frame = InsertFrame.parse(raw)
    assert bytes(frame.steps) == b"second" and list(frame.request.span_rows) == [1, 2]
    assert bytes(sample_response_batch(pb.SampleResponse(batch=b"old").SerializeToString()
                                       + pb.SampleResponse(batch=b"new").SerializeToString())) == b"new"


@given(parts=st.lists(st.binary(max_size=300), max_size=6))
def test_sample_response_from_parts_is_protobuf(parts: list[bytes]) -> None:
    raw = sample_response_bytes(tuple(parts))
    payload = b"".join(parts)
    parsed = pb.SampleResponse.FromString(raw)
    assert parsed.batch == payload and bytes(sample_response_batch(raw)) == payload
    # The alignment field's zero bytes, then the batch, 8 bytes in: what protobuf writes for each field.
    assert raw[SAMPLE_RESPONSE_HEAD_BYTES:] == payload and not parsed.alignment.strip(b"\0")
    if payload:  # protobuf itself leaves an empty field out; the hand framing writes it, empty
        assert raw == (pb.SampleResponse(alignment=parsed.alignment).SerializeToString()
                       + pb.SampleResponse(batch=payload).SerializeToString())


@pytest.mark.parametrize("payload_size", [1, 127, 128, 2**14 - 1, 2**14, 2**21 - 1, 2**21])
def test_sample_response_head_is_8_bytes_of_canonical_protobuf(payload_size: int) -> None:
    head = sample_response_head(payload_size)
    payload = b"x" * payload_size
    zeros = pb.SampleResponse.FromString(head + payload).alignment
    assert len(head) == SAMPLE_RESPONSE_HEAD_BYTES and zeros and not zeros.strip(b"\0")
    assert head + payload == (pb.SampleResponse(alignment=zeros).SerializeToString()
                              + pb.SampleResponse(batch=payload).SerializeToString())


def test_a_sample_response_that_goes_on_past_a_head_like_ours_is_parsed_whole() -> None:
    """replayd's own messages are read without a scan (head + batch, nothing else); any other message that
    starts the same way is parsed as protobuf does: the last batch wins."""
    ours = sample_response_bytes(b"payload")
    view = sample_response_batch(ours)
    assert bytes(view) == b"payload" and view.obj is ours
    longer = sample_response_head(3) + b"abc" + pb.SampleResponse(batch=b"new").SerializeToString()
    assert bytes(sample_response_batch(longer)) == pb.SampleResponse.FromString(longer).batch == b"new"
    shorter = sample_response_head(9) + b"abc"  # truncated: protobuf refuses it, so does the scan
    with pytest.raises(DecodeError):
        pb.SampleResponse.FromString(shorter)
    with pytest.raises(CodecError):
        sample_response_batch(shorter)


def test_sample_response_head_fits_payloads_up_to_32_gib() -> None:
    for payload_size in (2**28, 2**35 - 1):
        assert len(sample_response_head(payload_size)) == SAMPLE_RESPONSE_HEAD_BYTES
    with pytest.raises(ValueError, match="does not fit"):
        sample_response_head(2**35)


def test_sample_response_joins_numpy_parts_once() -> None:
    obs = np.arange(200_000, dtype=np.uint32).astype(np.uint8)
    flags = np.array([True, False, True])
    payload = codec.encode_parts({"obs": obs.reshape(4, 50_000), "flag": np.array([True, False, True, True])})
    raw = sample_response_bytes(payload)
    assert pb.SampleResponse.FromString(raw).batch == b"".join(payload)
    decoded = codec.decode(sample_response_batch(raw))
    np.testing.assert_array_equal(decoded["obs"].reshape(-1), obs)
    assert pb.SampleResponse.FromString(sample_response_bytes((b"ab", flags))).batch == b"ab\x01\x00\x01"


def test_splitting_many_small_fields_holds_no_more_than_the_message() -> None:
    """Repeated fields may travel unpacked, one key per value: 8 MB of them (4 M fields of 2 bytes) made the
    split hold a memoryview per field, 1.1 GB; at the default 512 MB message limit, far more than the server
    has. What the split holds must stay within a few times the message, whatever its fields."""
    import tracemalloc

    fields = 1 << 18
    raw = (pb.InsertRequest(buffer="b").SerializeToString() + b"\x18\x01" * fields  # episode_ids, unpacked
           + _field(2, 2, b"\x05arrow"))
    tracemalloc.start()
    try:
        rest, steps = split_bytes_field(raw, pb.InsertRequest.STEPS_FIELD_NUMBER)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert bytes(steps) == b"arrow"
    assert list(pb.InsertRequest.FromString(rest).episode_ids) == [1] * fields
    assert peak < 4 * len(raw), f"{peak} bytes held to split {len(raw)}"


def test_a_message_of_many_fields_is_parsed_by_protobuf_itself() -> None:
    """Unpacked repeated fields cost the hand scan ~0.25 µs each (a minute for a 512 MB request): past
    MANY_FIELDS fields the scan stops and protobuf's compiled parser reads the message, payload included."""
    from replayd.wire import frames

    raw = (pb.InsertRequest(buffer="b").SerializeToString() + b"\x18\x07" * (4 * frames.MANY_FIELDS)
           + _field(2, 2, b"\x05arrow") + b"\x20\x01")  # episode_ids unpacked, the steps, a span_rows
    with pytest.raises(frames.ParseWhole):
        split_bytes_field(raw, pb.InsertRequest.STEPS_FIELD_NUMBER, frames.MANY_FIELDS)
    frame = InsertFrame.parse(raw)
    assert bytes(frame.steps) == b"arrow"
    expected = pb.InsertRequest.FromString(raw)
    expected.ClearField("steps")
    assert frame.request == expected and list(frame.request.episode_ids) == [7] * (4 * frames.MANY_FIELDS)
    few = pb.InsertRequest(buffer="b", episode_ids=[7], steps=b"arrow").SerializeToString()
    assert split_bytes_field(few, pb.InsertRequest.STEPS_FIELD_NUMBER, frames.MANY_FIELDS)[0]  # within the budget
    with pytest.raises(DecodeError):  # a malformed message of many fields: protobuf's error, as from the scan
        InsertFrame.parse(raw[:-1])  # the last field's value cut off
