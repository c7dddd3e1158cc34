"""Stacked observation fields: one frame stored per row, every batch mode returns the stacks, each checked
against a reference built from the inserted episodes (the episode's first frame repeated before its start),
across ring wrap-around, chunked open episodes and moves, on the writer's path, a lock-free reader's and
over gRPC (streams gathered in place included); and the compiled stacking kernel and the schema's checks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from replayd.client import EpisodeWriter, Frames, Geometric, Hindsight, ReplayClient, Sequences, States, Transitions
from replayd.client.local_reader import LocalReader
from replayd.server import components, kernels
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.schema import Field
from replayd.wire import replay_pb2 as pb
from replayd.wire.components import ModeOptions
from replayd.wire.errors import InvalidArgument
from tests.conftest import rpc_status

FRAME, DEPTH = (6, 5), (3,)
FIELDS = [
    Field("obs", "uint8", FRAME, observation=True, stack=4),  # stacked last: (6, 5, 4)
    Field("depth", "float32", DEPTH, observation=True, stack=2, stack_axis=0),  # stacked first: (2, 3)
    Field("ep", "int64", (), observation=True),  # which episode, and which state of it: the reference's keys
    Field("t", "int64", (), observation=True),
    Field("ag", "float32", (2,), observation=True),
    Field("dg", "float32", (2,), observation=True),
    Field("action", "int64"),
    Field("reward", "float32"),
]
STACKED = {f.name: f for f in FIELDS if f.stack > 1}


@dataclass
class Episodes:
    """The inserted episodes' frames, by episode index: obs (L + 1, 6, 5), depth (L + 1, 3)."""

    frames: dict[int, dict[str, np.ndarray]]

    def stack(self, name: str, ep: int, t: int) -> np.ndarray:
        """The stack field `name` holds at state t of episode ep."""
        field = STACKED[name]
        frames = [self.frames[ep][name][max(t - field.stack + 1 + j, 0)] for j in range(field.stack)]
        return np.stack(frames, axis=field.stack_axis)


def episode_columns(rng: np.random.Generator, ep: int, length: int) -> dict[str, np.ndarray]:
    rows = length + 1
    return {"obs": rng.integers(0, 256, (rows, *FRAME), dtype=np.uint8),
            "depth": rng.normal(size=(rows, *DEPTH)).astype(np.float32),
            "ep": np.full(rows, ep), "t": np.arange(rows), "ag": rng.normal(size=(rows, 2)).astype(np.float32),
            "dg": np.zeros((rows, 2), np.float32), "action": rng.integers(0, 4, rows),
            "reward": rng.normal(size=rows).astype(np.float32)}


def chunk(buffer: EpisodicBuffer, columns: dict[str, np.ndarray], ep: int, lo: int, hi: int) -> None:
    rows = len(columns["t"])
    spans = Spans(np.array([ep], np.uint64), np.array([hi - lo]), np.array([lo == 0]), np.array([hi == rows]),
                  np.array([False]), np.array([lo]))
    buffer.insert({name: column[lo:hi] for name, column in columns.items()}, spans)


def fill(buffer: EpisodicBuffer, rng: np.random.Generator, count: int) -> Episodes:
    """`count` episodes: whole ones, and every third as an open episode whose first two rows land before the next
    episode and the rest after it (so that it outgrows its room and moves to the head)."""
    frames, pending = {}, None
    for ep in range(count):
        length = int(rng.integers(4, 30))
        columns = episode_columns(rng, ep, length)
        frames[ep] = {"obs": columns["obs"], "depth": columns["depth"]}
        if ep % 3 == 0:
            chunk(buffer, columns, ep, 0, 2)
            pending = (columns, ep)
            continue
        buffer.insert(columns, Spans.whole_episodes(np.array([length]), np.array([ep]), np.array([ep % 2 == 0])))
        if pending is not None:
            chunk(buffer, pending[0], pending[1], 2, len(pending[0]["t"]))
            pending = None
    return Episodes(frames)


def check_stacks(batch: dict[str, np.ndarray], episodes: Episodes, prefix: str,
                 valid: np.ndarray | None = None) -> int:
    """Every stack of `prefix` columns equals the reference at the batch's own ep and t (where `valid`); returns
    the items checked at an episode's first states (where the first frame is repeated)."""
    eps, ts = batch[prefix + "ep"], batch[prefix + "t"]
    near_start = 0
    for index in zip(*np.nonzero(np.ones(eps.shape, bool) if valid is None else valid), strict=True):
        for name in STACKED:
            np.testing.assert_array_equal(batch[prefix + name][index], episodes.stack(name, int(eps[index]),
                                                                                       int(ts[index])))
        near_start += int(ts[index]) < 3
    return near_start


@pytest.fixture
def filled() -> Iterator[tuple[EpisodicBuffer, Episodes]]:
    buffer = EpisodicBuffer("stacks", f"test{os.getpid()}", FIELDS, 400, goal_fields=("ag", "dg"))
    try:
        episodes = fill(buffer, np.random.default_rng(0), 60)
        assert buffer.head > buffer.capacity and buffer.counters["moved_open_episodes"] > 0
        yield buffer, episodes
    finally:
        buffer.close()


MODES = [Transitions(1), Transitions(3, 0.9), Geometric(0.7), States(), Hindsight("future", 0.5),
         Sequences(6, burn_in=2)]


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: f"{mode.kind}-{mode.params()}")
def test_every_mode_returns_the_stacks_of_its_states(filled: tuple[EpisodicBuffer, Episodes],
                                                     mode: ModeOptions) -> None:
    buffer, episodes = filled
    batch = buffer.sample(256, components.build(mode), np.random.default_rng(1))
    prefixes = {"transitions": ["", "next_", "bootstrap_"], "geometric": ["", "future_"], "states": [""],
                "hindsight": ["", "next_"], "sequences": [""]}[mode.kind]
    near_start, held = 0, None
    for prefix in prefixes:
        assert batch[prefix + "obs"].shape[-3:] == (*FRAME, 4) and batch[prefix + "depth"].shape[-2:] == (2, *DEPTH)
        if mode.kind == "sequences":  # rows past the episode's final observation are zeros
            held = np.arange(mode.steps) <= (batch["t"].max(axis=1, keepdims=True) - batch["t"][:, :1])
            for name in STACKED:
                assert not batch[name][~held].any()
            assert not held.all()
        near_start += check_stacks(batch, episodes, prefix, held)
    assert near_start > 0, "some stacks lie at an episode's start"
    if mode == Transitions(1):
        assert batch["bootstrap_obs"] is batch["next_obs"]  # aliased, sent once


def test_a_lock_free_reader_returns_the_stacks(filled: tuple[EpisodicBuffer, Episodes]) -> None:
    from replayd.server.buffers.reader import RingReader

    buffer, episodes = filled
    reader = RingReader.attach(buffer.storage.header_name)
    try:
        batch, _ = reader.sample_shared(128, components.build(Transitions(2)), np.random.default_rng(2))
    finally:
        reader.close()
    for prefix in ("", "next_", "bootstrap_"):
        check_stacks(batch, episodes, prefix)


def test_stack_frames_kernel_copies_interleaves_and_zeros() -> None:
    source = np.arange(5 * 3 * 2, dtype=np.int16).reshape(5, 3, 2)
    rows = np.array([[0, 0, 2], [4, -1, 1]])
    first = np.empty((2, 3, 3, 2), np.int16)
    kernels.stack_frames(first, source, rows, 1)
    last = np.empty((2, 3, 2, 3), np.int16)
    kernels.stack_frames(last, source, rows, 0)
    for n in range(2):
        expected = [source[r] if r >= 0 else np.zeros((3, 2), np.int16) for r in rows[n]]
        np.testing.assert_array_equal(first[n], np.stack(expected, 0))
        np.testing.assert_array_equal(last[n], np.stack(expected, -1))
    frames = np.random.default_rng(0).integers(0, 256, (6, 4, 7), dtype=np.uint8)  # the 4-byte-word path
    out = np.empty((1, 4, 7, 4), np.uint8)
    kernels.stack_frames(out, frames, np.array([[5, 1, 1, 3]]), 0)
    np.testing.assert_array_equal(out[0], np.stack([frames[i] for i in (5, 1, 1, 3)], -1))
    with pytest.raises(IndexError, match="row 5 is off a column of 5 rows"):
        kernels.stack_frames(first, source, np.array([[0, 0, 5], [0, 0, 0]]), 1)
    with pytest.raises(ValueError, match="out expected"):
        kernels.stack_frames(np.empty((2, 3, 3, 2), np.int32), source, rows, 1)


@pytest.mark.parametrize(("frames", "message"), [
    ({"stack": 0}, "stack must be an integer in 1..64, got 0"),
    ({"stack": 2, "stack_axis": 1}, "stack_axis must be -1 (last) or 0 (first), got 1"),
])
def test_frames_options_are_checked_where_constructed(frames: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        Frames(**frames)


def create_request(field: pb.FieldSpec, goal: bool = False) -> pb.CreateBufferRequest:
    fields = [field, pb.FieldSpec(name="pos", dtype="float32", shape=[2], observation=True),
              pb.FieldSpec(name="goal", dtype="float32", shape=[2], observation=True),
              pb.FieldSpec(name="action", dtype="int64")]
    config = pb.EpisodicConfig(fields=fields, capacity_steps=100)
    if goal:
        config.achieved_goal_field, config.desired_goal_field = field.name, "goal"
    return pb.CreateBufferRequest(name="bad", episodic=config)


@pytest.mark.parametrize(("request_", "message"), [
    (create_request(pb.FieldSpec(name="obs", dtype="uint8", shape=[4], observation=True, stack=0)),
     "field 'obs': stack must be an integer in 1..64, got 0"),
    (create_request(pb.FieldSpec(name="obs", dtype="uint8", shape=[4], observation=True, stack=2, stack_axis=2)),
     "field 'obs': stack_axis must be -1 (last) or 0 (first), got 2"),
    (create_request(pb.FieldSpec(name="act", dtype="int64", stack=4)),
     "field 'act': stack=4, expected 1: only observation fields are stacked"),
    (create_request(pb.FieldSpec(name="ach", dtype="float32", shape=[2], observation=True, stack=2), goal=True),
     "goal_fields: goal field 'ach' has stack=2 and compression=None"),
], ids=["stack 0", "axis 2", "step field", "goal field"])
def test_the_server_refuses_bad_stacks_naming_the_field(client: ReplayClient, request_: pb.CreateBufferRequest,
                                                        message: str) -> None:
    code, details = rpc_status(client._stub.CreateBuffer, request_)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details
    assert client.list_buffers() == []


SCHEMA = {"obs": ("uint8", (84, 84), Frames(stack=4, stack_axis=0)), "t": ("int64", ()),
          "action": ("int64", ()), "reward": ("float32", ())}


def write_episodes(client: ReplayClient, rng: np.random.Generator, count: int) -> dict[tuple[int, int], np.ndarray]:
    """Episodes written step by step as stacked observations (each a stack as a frame-stacking wrapper builds
    it); returns each state's stack by (episode id, t)."""
    stacks: dict[tuple[int, int], np.ndarray] = {}
    with EpisodeWriter(client, "pixels", chunk_rows=7) as writer:
        for _ in range(count):
            length = int(rng.integers(3, 20))
            frames = rng.integers(0, 256, (length + 1, 84, 84), dtype=np.uint8)
            for t in range(length + 1):
                stack = np.stack([frames[max(t - 3 + j, 0)] for j in range(4)])
                stacks[(writer._episode_id, t)] = stack
                if t < length:
                    writer.append(obs=stack, t=t, action=int(rng.integers(4)), reward=1.0)
                else:
                    writer.end_episode(terminated=True, obs=stack)
    return stacks


def test_grpc_samples_and_streams_gathered_in_place_hold_the_stacks(client: ReplayClient) -> None:
    client.create_buffer("pixels", 600, SCHEMA, observation_fields=("obs",))
    assert client.describe("pixels")["frames"] == {"obs": Frames(4, 0)}
    stacks = write_episodes(client, np.random.default_rng(3), 50)

    def check(batch: dict[str, np.ndarray]) -> None:
        assert batch["obs"].shape == (len(batch["t"]), 4, 84, 84)
        for i, (episode_id, t) in enumerate(zip(batch["episode_id"], batch["t"], strict=True)):
            np.testing.assert_array_equal(batch["obs"][i], stacks[(int(episode_id), int(t))])
            np.testing.assert_array_equal(batch["next_obs"][i], stacks[(int(episode_id), int(t) + 1)])

    check(client.sample("pixels", 16, Transitions(), include_keys=True))
    for batch in client.sample_stream("pixels", 16, Transitions(), num_batches=5, include_keys=True):
        check(batch)  # 16 items of 2 x 28 KB: the stream gathers its later batches straight into their messages
    with LocalReader(client, "pixels") as reader:
        check(reader.sample(32, Transitions(), include_keys=True))


def test_the_writer_takes_frames_or_stacks_and_refuses_other_shapes(client: ReplayClient) -> None:
    client.create_buffer("pixels", 100, SCHEMA, observation_fields=("obs",))
    frame = np.full((84, 84), 7, np.uint8)
    with EpisodeWriter(client, "pixels") as writer:
        writer.append(obs=frame, t=0, action=0, reward=0.0)
        writer.append(obs=np.stack([frame, frame, frame, frame + 1]), t=1, action=0, reward=0.0)
        with pytest.raises(ValueError, match=r"field 'obs' expected a frame of shape \(84, 84\) or a stack of shape "
                                             r"\(4, 84, 84\), got \(84, 84, 4\)"):
            writer.append(obs=np.zeros((84, 84, 4), np.uint8), t=2, action=0, reward=0.0)
        writer.end_episode(terminated=True, obs=frame)
    batch = client.sample("pixels", 64, States(), seed=0)
    newest = batch["obs"][:, -1]  # the stored frames: 7, 8 (the stack's newest), 7
    assert set(np.unique(newest)) == {7, 8}


@pytest.mark.parametrize("mode", [Transitions(3, 0.9), Sequences(5)], ids=["3-step", "sequences"])
def test_a_stream_stacks_frames_straight_into_its_messages(filled: tuple[EpisodicBuffer, Episodes],
                                                           mode: ModeOptions) -> None:
    """In-place messages are the usual encoding byte for byte, and the stacks are written into the message."""
    from replayd.server.grpc_server.in_place import InPlaceMessages
    from replayd.server.grpc_server.servicer import sample_message

    buffer, _ = filled
    built = components.build(mode)

    def encode(batch: dict[str, np.ndarray]) -> bytes:
        return sample_message(batch, 2**30)

    rng = np.random.default_rng(4)
    usual = [encode(buffer.sample(512, built, rng)) for _ in range(5)]
    stream, batches, rng = InPlaceMessages(built, encode), [], np.random.default_rng(4)
    messages = [stream.next(lambda m: batches.append(buffer.sample(512, m, rng)) or batches[-1]) for _ in range(5)]
    assert messages == usual and stream.in_place >= 3
    assert np.shares_memory(batches[-1]["obs"], np.frombuffer(messages[-1], np.uint8))
