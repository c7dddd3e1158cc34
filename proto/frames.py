"""Protobuf framing by hand for the messages that carry one large Arrow payload.

Parsing a message with protobuf copies its bytes fields, and reading such a field copies it again;
serializing copies once more. For inserts and samples (up to hundreds of MB) the payload instead stays
where gRPC put it: `parse_with_payload` returns the other fields (parsed by protobuf as usual) and a
memoryview of the payload, and a payload is joined into its serialized message with one copy.
An insert's compressed frames (CompressedFrames messages, each with its own bytes field) stay where gRPC
put them too, and are joined into a request with the payload in one copy; so are the frames a sample ships
compressed (decompress="client"), after its batch.
The bytes on the wire are ordinary protobuf, so any gRPC client or server interoperates.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import Message

from replayd.wire import replay_pb2 as pb
from replayd.wire.codec import CodecError
from replayd.wire.frame_fields import CompressedFrames

_LENGTH_DELIMITED = 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: memoryview, at: int, max_bytes: int = 10) -> tuple[int, int]:
    """(value, the offset after it) of the varint at `at`: at most 10 bytes (64 bits), 5 for a key."""
    value, shift, end = 0, 0, at + max_bytes
    while True:
        if at >= len(data) or at >= end:
            raise CodecError("malformed protobuf: truncated or overlong varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


# Our messages have a dozen fields at most. Past this many the message is unpacked repeated fields (valid
# protobuf, one key per value), which this Python scan reads at ~0.5 µs a field (minutes for a 512 MB
# message): protobuf's compiled parser takes those, at the cost of one copy of the payload.
MANY_FIELDS = 256


class ParseWhole(Exception):
    """split_bytes_field leaves this message to protobuf's own parser: it has more fields than it was allowed
    to scan, or a group (wire types 3 and 4: valid protobuf, kept as unknown fields, never sent by us)."""


def split_bytes_field(raw: bytes, field_number: int, max_fields: int | None = None) -> tuple[bytes, memoryview]:
    """(the message without field `field_number`, a view of that field's last value). ParseWhole after
    `max_fields` fields (None: no limit), or at a group."""
    rest, views = split_fields(raw, (field_number,), max_fields)
    found = views[field_number]
    return rest, found[-1] if found else memoryview(raw)[0:0]


def split_fields(raw: bytes | memoryview, field_numbers: Collection[int],
                 max_fields: int | None = None) -> tuple[bytes, dict[int, list[memoryview]]]:
    """(the message without the length-delimited fields `field_numbers`, views of each one's values in order).
    ParseWhole after `max_fields` fields (None: no limit), or at a group."""
    data = memoryview(raw)
    budget = -1 if max_fields is None else max_fields
    # The message's other fields are copied out between the occurrences of the fields split out (a view per
    # field would hold ~180 bytes for each 2-byte field of an unpacked repeated field: 100 times the message).
    rest = bytearray()
    kept_from = 0
    views: dict[int, list[memoryview]] = {number: [] for number in field_numbers}
    at = 0
    size = len(data)
    while at < size:
        if budget == 0:
            raise ParseWhole(f"more than {max_fields} fields")
        budget -= 1
        start = at
        key, at = _read_varint(data, at, max_bytes=5)
        number, wire_type = key >> 3, key & 7
        if number == 0 or key > 0xFFFFFFFF:  # what protobuf's own parser refuses: keys are 32-bit, fields >= 1
            raise CodecError(f"malformed protobuf: invalid field key {key}")
        if wire_type == 0:
            _, at = _read_varint(data, at)
        elif wire_type == 1:
            at += 8
        elif wire_type == 5:
            at += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, at = _read_varint(data, at)
            at += length
            if at <= size and number in views:
                views[number].append(data[at - length:at])
                rest += data[kept_from:start]
                kept_from = at
        elif wire_type in (3, 4):
            raise ParseWhole(f"field {number} is a group")
        else:
            raise CodecError(f"malformed protobuf: unsupported wire type {wire_type}")
        if at > size:
            raise CodecError("malformed protobuf: field runs past the end of the message")
    rest += data[kept_from:]
    return bytes(rest), views


def parse_with_payload(raw: bytes, message_type: type[Message], field: str) -> tuple[Message, memoryview]:
    """(the message without `field`, parsed; a view of that bytes field's value in `raw`, or of a copy when
    the message has more than MANY_FIELDS fields or a group)."""
    try:
        rest, payload = split_bytes_field(raw, message_type.DESCRIPTOR.fields_by_name[field].number, MANY_FIELDS)
    except ParseWhole:
        message = message_type.FromString(raw)
        payload = memoryview(getattr(message, field))
        message.ClearField(field)
        return message, payload
    return message_type.FromString(rest), payload


def _parts(payload: bytes | memoryview | tuple) -> tuple[tuple, int]:
    """(the buffers of a payload, its size): a tuple of buffers (codec.encode_parts) or one buffer."""
    parts = payload if isinstance(payload, tuple) else (payload,)
    return parts, sum(memoryview(part).nbytes for part in parts)


def _field_head(field_number: int, size: int) -> bytes:
    return _varint(field_number << 3 | _LENGTH_DELIMITED) + _varint(size)


@dataclass(frozen=True)
class InsertFrame:
    """An InsertRequest whose `steps` payload and compressed frames are held apart from the parsed message."""

    request: pb.InsertRequest  # every field but steps and frames
    # The Arrow payload: bytes, a view (parsed), or a tuple of buffers (codec.encode_parts) joined only
    # when serialized, so that a client's columns are copied once into the message.
    payload: bytes | memoryview | tuple
    # The compressed fields' frames by field name: views of the received message, or the client's arrays.
    frames: tuple[tuple[str, CompressedFrames], ...] = ()

    @property
    def steps(self) -> bytes | memoryview:
        return b"".join(self.payload) if isinstance(self.payload, tuple) else self.payload

    @classmethod
    def parse(cls, raw: bytes) -> InsertFrame:
        steps, frames = pb.InsertRequest.STEPS_FIELD_NUMBER, pb.InsertRequest.FRAMES_FIELD_NUMBER
        try:
            rest, views = split_fields(raw, (steps, frames), MANY_FIELDS)
        except ParseWhole:
            request = pb.InsertRequest.FromString(raw)
            parsed = tuple((f.field, _frames(memoryview(f.frames), f.lengths)) for f in request.frames)
            payload = memoryview(request.steps)
            request.ClearField("steps")
            request.ClearField("frames")
            return cls(request, payload, parsed)
        payload = views[steps][-1] if views[steps] else memoryview(raw)[0:0]
        parsed = tuple((message.field, frames) for message, frames in map(_parse_frames, views[frames]))
        return cls(pb.InsertRequest.FromString(rest), payload, parsed)

    def serialize(self) -> bytes:
        parts, size = _parts(self.payload)
        out = [self.request.SerializeToString(), _field_head(pb.InsertRequest.STEPS_FIELD_NUMBER, size), *parts]
        for name, frames in self.frames:
            out += frames_field(pb.InsertRequest.FRAMES_FIELD_NUMBER, pb.CompressedFrames(field=name), frames)
        return b"".join(out)

    def compressed(self) -> dict[str, CompressedFrames]:
        """The frames by field name; CodecError for a field named twice."""
        found: dict[str, CompressedFrames] = {}
        for name, frames in self.frames:
            if name in found:
                raise CodecError(f"insert.frames: field {name!r} appears twice")
            found[name] = frames
        return found


def frames_field(field_number: int, message: pb.CompressedFrames, frames: CompressedFrames) -> list:
    """The parts of a CompressedFrames field holding `message` (its frames and lengths left unset) and `frames`:
    the frames' bytes are joined into the enclosing message by the caller, one copy."""
    head = pb.CompressedFrames()
    head.CopyFrom(message)
    head.lengths[:] = frames.lengths.tolist()
    encoded = head.SerializeToString()
    body = _field_head(pb.CompressedFrames.FRAMES_FIELD_NUMBER, frames.nbytes)
    return [_field_head(field_number, len(encoded) + len(body) + frames.nbytes), encoded, body, frames.data]


def _frames(data: memoryview, lengths: object) -> CompressedFrames:
    return CompressedFrames(np.frombuffer(data, np.uint8), np.array(lengths, dtype=np.int64))


def _parse_frames(raw: memoryview) -> tuple[pb.CompressedFrames, CompressedFrames]:
    """A CompressedFrames message (without its frames) and its frames, whose bytes are left where they are."""
    try:
        rest, views = split_fields(raw, (pb.CompressedFrames.FRAMES_FIELD_NUMBER,), MANY_FIELDS)
    except ParseWhole:  # lengths sent unpacked: protobuf's parser takes them (and copies the frames)
        message = pb.CompressedFrames.FromString(raw)
        frames = _frames(memoryview(message.frames), message.lengths)
        message.ClearField("frames")
        return message, frames
    message = pb.CompressedFrames.FromString(rest)
    found = views[pb.CompressedFrames.FRAMES_FIELD_NUMBER]
    return message, _frames(found[-1] if found else raw[0:0], message.lengths)


def serialize_insert(message: InsertFrame | pb.InsertRequest) -> bytes:
    return message.serialize() if isinstance(message, InsertFrame) else message.SerializeToString()


# A SampleResponse's batch starts this many bytes into the message (see `alignment` in replay.proto).
SAMPLE_RESPONSE_HEAD_BYTES = 8


@functools.lru_cache(maxsize=256)  # a stream's batches are all one size
def sample_response_head(payload_size: int) -> bytes:
    """The SampleResponse bytes before a batch payload of `payload_size` bytes: the `alignment` field's zero
    bytes, then the batch's key and length; SAMPLE_RESPONSE_HEAD_BYTES in all (every encoding is canonical)."""
    batch_key = _varint(pb.SampleResponse.BATCH_FIELD_NUMBER << 3 | _LENGTH_DELIMITED) + _varint(payload_size)
    alignment_key = _varint(pb.SampleResponse.ALIGNMENT_FIELD_NUMBER << 3 | _LENGTH_DELIMITED)
    zeros = SAMPLE_RESPONSE_HEAD_BYTES - len(alignment_key) - 1 - len(batch_key)  # 1: the zeros' length, < 128
    if zeros < 0:
        raise ValueError(f"sample response: a {payload_size}-byte batch does not fit a "
                         f"{SAMPLE_RESPONSE_HEAD_BYTES}-byte head")
    return alignment_key + _varint(zeros) + bytes(zeros) + batch_key


# A sample's shipped frames: each a CompressedFrames message (field, spec, columns) and the frames themselves.
ShippedFrames = tuple[tuple[pb.CompressedFrames, CompressedFrames], ...]


def sample_response_bytes(batch: bytes | memoryview | tuple, frames: ShippedFrames = ()) -> bytes:
    """A serialized SampleResponse around an Arrow payload, and compressed frames after it. `batch` may be the
    payload's parts (codec.encode_parts): they are copied once, straight into the message, which is the only copy
    of the columns between the sampler's gather and gRPC's own copy into its send buffer (a stream
    whose layout the codec knows gathers straight into the message instead: service/grpc_server/in_place.py)."""
    parts, size = _parts(batch)
    out = [sample_response_head(size), *parts]
    for message, shipped in frames:
        out += frames_field(pb.SampleResponse.FRAMES_FIELD_NUMBER, message, shipped)
    return b"".join(out)


def sample_response_batch(raw: bytes) -> memoryview:
    """The Arrow payload of a serialized SampleResponse, without copying it."""
    head = SAMPLE_RESPONSE_HEAD_BYTES
    if len(raw) > head and raw[:head] == sample_response_head(len(raw) - head):  # what replayd sends: no scan
        return memoryview(raw)[head:]
    return parse_with_payload(raw, pb.SampleResponse, "batch")[1]


@dataclass(frozen=True)
class SampledMessage:
    """A SampleResponse's Arrow payload and shipped frames, both views of the received message."""

    batch: memoryview
    frames: ShippedFrames = ()

    @property
    def nbytes(self) -> int:
        return self.batch.nbytes + sum(frames.nbytes for _, frames in self.frames)


def sample_response(raw: bytes) -> SampledMessage:
    """A serialized SampleResponse's payload and frames, without copying them."""
    head = SAMPLE_RESPONSE_HEAD_BYTES
    if len(raw) > head and raw[:head] == sample_response_head(len(raw) - head):  # a batch alone: no scan
        return SampledMessage(memoryview(raw)[head:])
    batch, frames = pb.SampleResponse.BATCH_FIELD_NUMBER, pb.SampleResponse.FRAMES_FIELD_NUMBER
    try:
        _, views = split_fields(raw, (batch, frames), MANY_FIELDS)
    except ParseWhole:
        message = pb.SampleResponse.FromString(raw)
        return SampledMessage(memoryview(message.batch), tuple(
            (shipped, _frames(memoryview(shipped.frames), shipped.lengths)) for shipped in message.frames))
    return SampledMessage(views[batch][-1] if views[batch] else memoryview(raw)[0:0],
                          tuple(map(_parse_frames, views[frames])))
