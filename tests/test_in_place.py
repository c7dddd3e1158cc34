"""A sample stream's batches gathered straight into their messages: the very bytes of the usual encoding,
for every batch mode and for columns that Python code sets after the kernels ran (keys, importance weights)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from replayd.server import kernels
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.grpc_server.in_place import IN_PLACE_MIN_BYTES, InPlaceMessages
from replayd.server.grpc_server.servicer import sample_message
from replayd.server.modes.base import BatchMode
from replayd.server.modes.geometric import GeometricMode
from replayd.server.modes.states import StatesMode
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.server.samplers.uniform import UniformSampler
from replayd.server.schema import Field
from replayd.wire import codec
from replayd.wire.frames import sample_response_batch

FIELDS = [
    Field("frame", "uint8", (32, 32, 4), observation=True),
    Field("position", "float32", (3,), observation=True),
    Field("action", "int64"),
    Field("reward", "float32"),
    Field("flag", "bool"),
]
BATCH = 96  # 96 frames of 4 KiB: every mode's batch is over IN_PLACE_MIN_BYTES
MESSAGES = 6


@pytest.fixture(params=["uniform", "prioritized"])
def buffer(request: pytest.FixtureRequest) -> Iterator[EpisodicBuffer]:
    sampler = PrioritizedSampler(0.6) if request.param == "prioritized" else UniformSampler()
    buffer = EpisodicBuffer("in_place", f"test{os.getpid()}", FIELDS, 1500, reward_field="reward", sampler=sampler)
    rng = np.random.default_rng(0)
    try:
        for first_id in (0, 40):
            lengths = rng.integers(5, 60, 40)
            rows = int((lengths + 1).sum())
            columns = {"frame": rng.integers(0, 256, (rows, 32, 32, 4), dtype=np.uint8),
                       "position": rng.normal(size=(rows, 3)).astype(np.float32), "action": rng.integers(0, 6, rows),
                       "reward": rng.normal(size=rows).astype(np.float32), "flag": rng.random(rows) < 0.5}
            buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(first_id, first_id + lengths.size),
                                                        rng.random(lengths.size) < 0.5))
        assert buffer.head > buffer.capacity  # wrapped: rows of evicted episodes are holes
        yield buffer
    finally:
        buffer.close()


def encode(batch: dict[str, np.ndarray]) -> bytes:
    return sample_message(batch, 2**30)


def sampler(buffer: EpisodicBuffer, seed: int, **options: object) -> Callable[[BatchMode], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return lambda mode: buffer.sample(BATCH, mode, rng, **options)


@pytest.mark.parametrize(("mode", "options"), [
    (TransitionsMode(1, 0.9), {}),
    (TransitionsMode(3, 0.9), {"include_keys": True, "importance_beta": 0.4}),
    (GeometricMode(0.8), {"include_keys": True}),
    (StatesMode(), {"importance_beta": 1.0}),
], ids=["1-step", "3-step with keys and weights", "geometric with keys", "states with weights"])
def test_messages_written_in_place_are_the_usual_encoding_byte_for_byte(buffer: EpisodicBuffer, mode: BatchMode,
                                                                        options: dict) -> None:
    sample = sampler(buffer, 7, **options)
    usual = [encode(sample(mode)) for _ in range(MESSAGES)]
    stream = InPlaceMessages(mode, encode)
    drawn = sampler(buffer, 7, **options)
    batches = []
    messages = [stream.next(lambda m: batches.append(drawn(m)) or batches[-1]) for _ in range(MESSAGES)]
    assert stream.in_place >= MESSAGES - 2  # from the stream's second or third batch on (the codec learns a layout)
    for got, expected in zip(messages, usual, strict=True):
        assert type(got) is bytes and got == expected
    # The kernels gathered the frames straight into the last message (no copy into it afterwards).
    frames = [name for name in batches[-1] if name.endswith("frame")]
    assert frames and all(np.shares_memory(batches[-1][name], np.frombuffer(messages[-1], np.uint8))
                          for name in frames)
    batch = codec.decode(sample_response_batch(messages[-1]))
    assert all(array.flags.aligned for array in batch.values())  # the alignment field puts the batch 8 bytes in


@pytest.mark.parametrize("change", ["gains", "loses"])
def test_a_stream_whose_layout_changes_learns_the_new_one(buffer: EpisodicBuffer, change: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A column a batch gains, or one it loses, makes the stream learn the new layout (a column gone must not
    go out as the new message's uninitialized memory: a message is allocated before its batch is drawn, here
    filled with 0xAB to show it)."""
    new_bytes = kernels.new_bytes

    def dirty_bytes(size: int) -> tuple[bytes, np.ndarray]:
        message, buffer = new_bytes(size)
        buffer[...] = 0xAB
        return message, buffer

    monkeypatch.setattr(kernels, "new_bytes", dirty_bytes)

    def changing(sample: Callable[[BatchMode], dict[str, np.ndarray]]) -> Callable[[BatchMode], dict[str, np.ndarray]]:
        calls = [0]

        def changed(mode: BatchMode) -> dict[str, np.ndarray]:
            batch = sample(mode)
            calls[0] += 1
            if (calls[0] > 3) == (change == "gains"):  # set on batches 4 on, or on the first 3 only
                batch["extra"] = np.full(BATCH, 7, np.int32)
            return batch
        return changed

    mode = TransitionsMode(1, 0.9)
    sample = changing(sampler(buffer, 3))
    usual = [encode(sample(mode)) for _ in range(9)]
    stream = InPlaceMessages(mode, encode)
    sample = changing(sampler(buffer, 3))
    assert [stream.next(sample) for _ in range(9)] == usual
    assert stream.in_place >= 4  # at most 3 before the change, and in place again 2 batches after it


def test_small_batches_are_encoded_the_usual_way(buffer: EpisodicBuffer) -> None:
    mode = TransitionsMode(1, 0.9)
    small = codec.in_place(buffer.sample(4, mode, np.random.default_rng(0)))
    assert small is None or small.size < IN_PLACE_MIN_BYTES
    stream = InPlaceMessages(mode, encode)
    rng = np.random.default_rng(5)
    messages = [stream.next(lambda m: buffer.sample(4, m, rng)) for _ in range(5)]
    assert stream.in_place == 0 and stream.layout is None
    assert stream.tries == 0  # the codec knew the layout: the stream stopped asking (it costs ~10 µs a batch)
    rng = np.random.default_rng(5)
    assert messages == [encode(buffer.sample(4, mode, rng)) for _ in range(5)]
