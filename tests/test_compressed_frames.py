"""Compressed observation fields: frames compressed by the client, checked at insert, stored in a byte arena
and evicted with their episodes, decompressed into batches; with everything that holds for a buffer:
all-or-nothing inserts (bad frames refused naming the field, every byte left as it was), buffers sized by
bytes, exactly-once retries, checkpoints and restore, crash repair, lock-free readers racing the writer,
sample workers, and the stored bytes and compression ratio in the metrics."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from contextlib import closing

import grpc
import httpx
import numpy as np
import pytest

from replayd.client import EpisodeWriter, Frames, ReplayClient, Sequences, Transitions
from replayd.client.replay_client import Span, spans_request
from replayd.server import checkpoint
from replayd.server.buffers.arena import place
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.buffers.planner import ArenaSnapshot, Extent, FrameLengths, RingSnapshot, check_spans, plan_insert
from replayd.server.buffers.reader import RingReader
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.registry import BufferRegistry
from replayd.server.schema import Field
from replayd.server.server import ReplayServer
from replayd.wire import replay_pb2 as pb
from replayd.wire.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from replayd.wire.frame_fields import CompressedFrames, FrameError, compress, decompress, decompress_many
from replayd.wire.frames import InsertFrame
from tests.conftest import TEST_INSTANCE, rpc_status
from tests.test_crash_recovery import Crash, crash_inside, segments_removed

FRAME = (12, 10)


def frame_of(episode: int, t: int) -> np.ndarray:
    """A frame that names its episode and step (and compresses, as screens do)."""
    frame = np.zeros(FRAME, np.uint8)
    frame[0, :4] = np.frombuffer(np.int32(episode).tobytes(), np.uint8)
    frame[1, :4] = np.frombuffer(np.int32(t).tobytes(), np.uint8)
    frame[2 + t % 10, :] = 200
    return frame


def named(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(episode, t) that each frame of `frames` (N, *FRAME) names, each (N,)."""
    return (np.ascontiguousarray(frames[:, 0, :4]).view(np.int32)[:, 0],
            np.ascontiguousarray(frames[:, 1, :4]).view(np.int32)[:, 0])


def fields(compression: str, stack: int = 1, level: int | None = None) -> list[Field]:
    return [Field("obs", "uint8", FRAME, observation=True, stack=stack, compression=compression,
                  compression_level=level),
            Field("t", "int64", (), observation=True), Field("reward", "float32")]


def rows(episode: int, lo: int, hi: int, length: int, compression: str) -> dict[str, np.ndarray | CompressedFrames]:
    frames = np.stack([frame_of(episode, t) for t in range(lo, hi)])
    return {"obs": compress(compression, 3 if compression == "zstd" else None, frames),
            "t": np.arange(lo, hi), "reward": np.where(np.arange(lo, hi) < length, 1.0, 0.0).astype(np.float32)}


def insert_whole(buffer: EpisodicBuffer, episode: int, length: int, compression: str) -> None:
    buffer.insert(rows(episode, 0, length + 1, length, compression),
                  Spans.whole_episodes(np.array([length]), np.array([episode]), np.array([True])))


def insert_chunk(buffer: EpisodicBuffer, episode: int, lo: int, hi: int, length: int, compression: str) -> None:
    spans = Spans(np.array([episode], np.uint64), np.array([hi - lo]), np.array([lo == 0]),
                  np.array([hi == length + 1]), np.array([False]), np.array([lo]))
    buffer.insert(rows(episode, lo, hi, length, compression), spans)


def check_batch(batch: dict[str, np.ndarray], stack: int = 1) -> None:
    """Every stacked frame names the batch's own episode and the state it stacks (clipped at 0)."""
    for prefix, shift in (("", 0), ("next_", 1)):
        obs = batch[prefix + "obs"]
        frames = obs if stack == 1 else np.moveaxis(obs, -1, 1)  # (B[, stack], *FRAME)
        episode, t = named(frames.reshape(-1, *FRAME))
        expected_t = np.maximum(batch["t"][:, None] + shift + np.arange(1 - stack, 1), 0).reshape(-1)
        np.testing.assert_array_equal(episode.reshape(-1), np.repeat(batch["episode_id"].astype(np.int32), stack))
        np.testing.assert_array_equal(t.reshape(-1), expected_t)


# ---------------------------------------------------------------------------------------------- codecs
@pytest.mark.parametrize(("compression", "level"), [("zstd", 3), ("lz4", None), ("lz4", 9)])
def test_codecs_round_trip_and_refuse_frames_not_whole(compression: str, level: int | None) -> None:
    frames = np.stack([frame_of(3, t) for t in range(5)])
    packed = compress(compression, level, frames)  # lz4 with a level: LZ4 HC, the same block format
    assert len(packed) == 5 and packed.nbytes < frames.nbytes
    for i in range(5):
        assert decompress(compression, packed.frame(i), frames[0].nbytes) == frames[i].tobytes()
    one = packed.frame(1).tobytes()
    garbage = np.random.default_rng(0).integers(0, 256, len(one), dtype=np.uint8).tobytes()
    for bad in (garbage, one[:-2], one + one):
        with pytest.raises(FrameError):
            decompress(compression, bad, frames[0].nbytes)
    with pytest.raises(FrameError):
        decompress(compression, one, frames[0].nbytes + 1)  # another frame size
    if compression == "zstd":  # a flipped byte that still decodes to the size: the frame's checksum differs
        flipped = bytearray(one)
        flipped[len(flipped) // 2] ^= 0x01
        with pytest.raises(FrameError):
            decompress(compression, bytes(flipped), frames[0].nbytes)
    np.testing.assert_array_equal(decompress_many(compression, packed, frames[0].nbytes),
                                  frames.reshape(5, -1))  # the batch call (zstd's in one)
    with pytest.raises(FrameError):
        decompress_many(compression, CompressedFrames(np.frombuffer(garbage * 2, np.uint8),
                                                      np.array([len(garbage)] * 2)), frames[0].nbytes)
    taken = packed[np.array([True, False, True, True, False])]
    assert [taken.frame(i).tobytes() for i in range(3)] == [packed.frame(i).tobytes() for i in (0, 2, 3)]


def test_a_zstd_frame_that_declares_another_size_is_refused_before_it_is_inflated() -> None:
    import zstandard

    huge = zstandard.ZstdCompressor().compress(bytes(50_000_000))  # 50 MB of zeros in a few KB
    with pytest.raises(FrameError, match="declares 50000000 bytes"):
        decompress("zstd", huge, 120)


def test_frames_are_placed_back_to_back_but_never_across_the_arena_end() -> None:
    offsets, head = place(90, np.array([5, 5, 8, 3]), 100)
    assert offsets.tolist() == [90, 95, 100, 108] and head == 111
    offsets, head = place(96, np.array([5, 2]), 100)
    assert offsets.tolist() == [100, 105] and head == 107  # the 4 bytes before the end are slack


# ---------------------------------------------------------------------------------------------- planner
def arena_ring(head: int = 0, arena_head: int = 0, size: int = 100) -> RingSnapshot:
    return RingSnapshot(head, 0, 1000, (ArenaSnapshot("obs", size, arena_head),),
                        lambda start, count: (np.full(count, 10, np.int64),))


def test_the_planner_gives_frames_their_offsets_and_refuses_what_no_arena_holds() -> None:
    spans = Spans.whole_episodes(np.array([3, 3, 3]), np.arange(3), np.ones(3, bool))  # 4 rows each
    lengths = FrameLengths((np.full(12, 10, np.int64),))
    ops = plan_insert(arena_ring(), {}, spans, np.arange(3), lengths)
    # 40 bytes an episode: two fit the arena of 100 bytes with a frame's slack, the third goes in its own block
    assert [(op.span_lo, op.span_hi) for op in ops] == [(0, 2), (2, 3)]
    assert ops[1].frame_offsets[0].tolist() == [80, 90, 100, 110] and ops[1].arena_after == (120,)
    from replayd.server.buffers.planner import check_frames_fit

    big = Spans.whole_episodes(np.array([9]), np.array([7]), np.array([True]))
    with pytest.raises(InvalidArgument, match="episode 7: its frames of field 'obs' take 100 bytes"):
        check_frames_fit(arena_ring().arenas, big, FrameLengths((np.full(10, 10, np.int64),)))


def test_an_open_episode_whose_frames_the_request_would_overwrite_is_refused() -> None:
    opened = Extent(7, 0, 0, 1, 4, arena_first=(0,), arena_bytes=(20,))
    chunk = Spans(np.array([7], np.uint64), np.array([2]), np.array([False]), np.array([False]),
                  np.array([False]), np.array([2]))
    check_spans(chunk, 2, 1000)
    # Other episodes wrote 75 bytes after its first 20: 20 more would overwrite them.
    with pytest.raises(ResourceExhausted, match="open episode 7 would overwrite its own frames of field 'obs'"):
        plan_insert(arena_ring(head=40, arena_head=95), {7: opened}, chunk, np.arange(1),
                    FrameLengths((np.full(2, 10, np.int64),)))


# ---------------------------------------------------------------------------------------------- buffer
@pytest.fixture(params=["zstd", "lz4"])
def compression(request: pytest.FixtureRequest) -> str:
    return request.param


def test_frames_evicted_with_their_episodes_when_the_arena_fills(compression: str) -> None:
    buffer = EpisodicBuffer("pix", TEST_INSTANCE, fields(compression, stack=3), 2000, capacity_bytes=130_000)
    try:
        arena = buffer.ring.arenas["obs"]
        rng = np.random.default_rng(0)
        for episode in range(60):
            length = int(rng.integers(5, 40))
            if episode % 4 == 0:  # an open episode outgrowing its room moves to the head, frames and all
                insert_chunk(buffer, episode, 0, 2, length, compression)
                insert_whole(buffer, 1000 + episode, int(rng.integers(5, 20)), compression)
                insert_chunk(buffer, episode, 2, length + 1, length, compression)
            else:
                insert_whole(buffer, episode, length, compression)
        counters = buffer.counters
        assert counters["evicted_episodes"] > 10 and counters["moved_open_episodes"] > 5
        assert buffer.stored_steps < buffer.capacity  # the bytes bound, not the rows
        live = np.flatnonzero(buffer.ring.row_seq >= 0)
        assert int(arena.state[1]) == int(arena.length[live].sum())  # stored bytes follow the live rows
        stats = buffer.frame_stats()["obs"]
        assert stats["compression_ratio"] == pytest.approx(buffer.stored_steps * 120 / stats["stored_bytes"])
        for mode in (TransitionsMode(1, 0.9), TransitionsMode(3, 0.9)):
            check_batch(buffer.sample(256, mode, np.random.default_rng(1), include_keys=True), stack=3)
        reader = RingReader.attach(buffer.storage.header_name)
        try:
            check_batch(reader.sample_shared(256, TransitionsMode(1, 0.9), np.random.default_rng(2), True)[0], 3)
        finally:
            reader.close()
    finally:
        buffer.close()


def test_sizing_by_bytes(compression: str) -> None:
    by_bytes = EpisodicBuffer("a", TEST_INSTANCE, fields(compression), 0, capacity_bytes=1_000_000)
    both = EpisodicBuffer("b", TEST_INSTANCE, fields(compression), 5000, capacity_bytes=1_000_000)
    by_rows = EpisodicBuffer("c", TEST_INSTANCE, fields(compression), 5000)
    try:
        for buffer in (by_bytes, both):
            assert 0.95e6 < buffer.storage.nbytes <= 1_000_000
        # Rows sized from bytes: 40-60 bytes of tables a row, and a 64th of a 120-byte frame.
        assert 1_000_000 // 62 < by_bytes.capacity < 1_000_000 // 41
        assert both.capacity == by_rows.capacity == 5000
        assert by_rows.ring.arenas["obs"].size == 5000 * 120 // 8
        raw = EpisodicBuffer("d", TEST_INSTANCE, [Field("obs", "float32", (4,), observation=True)], 0,
                             capacity_bytes=100_000)
        assert 0.95e5 < raw.storage.nbytes <= 100_000
        raw.close()
        with pytest.raises(InvalidArgument, match="capacity_bytes=10000: 5000 rows take"):
            EpisodicBuffer("e", TEST_INSTANCE, fields(compression), 5000, capacity_bytes=10_000)
        with pytest.raises(InvalidArgument, match=r"capacity_steps must be an integer >= 2 \(or 0 with capacity_bytes"):
            EpisodicBuffer("e", TEST_INSTANCE, fields(compression), 0)
    finally:
        for buffer in (by_bytes, both, by_rows):
            buffer.close()


@pytest.mark.parametrize(("field", "message"), [
    (Field("obs", "uint8", FRAME, observation=True, compression="gzip"),
     "field 'obs': compression must be one of 'zstd', 'lz4' or none, got 'gzip'"),
    (Field("act", "uint8", FRAME, compression="zstd"), "field 'act': compression='zstd', expected none"),
    (Field("obs", "uint8", FRAME, observation=True, compression_level=3),
     "field 'obs': compression_level=3 applies to a compressed field"),
    (Field("obs", "uint8", FRAME, observation=True, compression="lz4", compression_level=13),
     "field 'obs': compression_level must be an integer in 1..12 for lz4, got 13"),
    (Field("obs", "uint8", FRAME, observation=True, compression="zstd", compression_level=0),
     "field 'obs': compression_level must be an integer in 1..22 for zstd, got 0"),
])
def test_bad_compression_options_are_refused_naming_the_field(field: Field, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        EpisodicBuffer("bad", TEST_INSTANCE, [field, Field("x", "float32", (), observation=True)], 100)


# ---------------------------------------------------------------------------------------------- over gRPC
SCHEMA = {"obs": ("uint8", FRAME, Frames(stack=4, stack_axis=0, compression="zstd")), "t": ("int64", ()),
          "reward": ("float32", ())}


def request_of(episode: int, length: int, **change: object) -> InsertFrame:
    frames = np.stack([frame_of(episode, t) for t in range(length + 1)])
    columns = {"obs": compress("zstd", 3, frames), "t": np.arange(length + 1),
               "reward": np.ones(length + 1, np.float32)}
    frame = spans_request("pix", [Span(columns, episode)])
    return InsertFrame(frame.request, frame.payload, change.get("frames", frame.frames)) if change else frame


def shared_bytes(server: ReplayServer) -> bytes:
    return bytes(server.registry.get("pix").storage._data.buf)


def test_bad_frames_are_refused_naming_the_field_and_nothing_is_stored(client: ReplayClient, server) -> None:
    client.create_buffer("pix", 500, SCHEMA, capacity_bytes=200_000)
    client.insert([request_of(1, 10)])
    before = shared_bytes(server)
    good = request_of(2, 6).frames[0][1]
    flipped = good.data.copy()
    flipped[good.starts[3] + 5] ^= 0x5A
    small = compress("zstd", 3, np.zeros((7, 11, 10), np.uint8))
    cases = {
        "row 3: expected a zstd frame of 120 bytes": CompressedFrames(flipped, good.lengths),
        "row 0: expected a zstd frame of 120 bytes, but the frame declares 110 bytes": small,
        "has 6 compressed frames, other fields have 7 rows": good[0:6],
        "frame lengths must be >= 1 and sum to": CompressedFrames(good.data, good.lengths + 1),
    }
    for message, frames in cases.items():
        code, details = rpc_status(client.insert, [request_of(2, 6, frames=(("obs", frames),))], retry=False)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "field 'obs'" in details and message in details, details
    code, details = rpc_status(client.insert, [request_of(2, 6, frames=())], retry=False)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "field 'obs' is missing" in details
    as_column = request_of(2, 6)
    columns = {"obs": np.zeros((7, *FRAME), np.uint8), "t": np.arange(7), "reward": np.ones(7, np.float32)}
    from replayd.wire import codec

    code, details = rpc_status(client.insert, [InsertFrame(as_column.request, codec.encode(columns))], retry=False)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "field 'obs' is compressed (zstd): expected its frames" in details
    code, details = rpc_status(client.insert, [request_of(2, 6, frames=(("t", good),))], retry=False)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "field 't' is sent twice" in details
    with pytest.raises(ValueError, match=r"field 'obs' is compressed \(zstd\): expected frames of uint8\[12, 10\], "
                                         r"got uint8\[12, 12\]"):
        client.insert_episode("pix", True, obs=np.zeros((3, 12, 12), np.uint8), t=np.arange(2), reward=np.ones(2))
    assert shared_bytes(server) == before  # every refused request left every byte as it was


def test_compressed_frames_travel_compressed_and_a_retried_request_stores_once(client: ReplayClient) -> None:
    client.create_buffer("pix", 500, SCHEMA, capacity_bytes=200_000)
    request = request_of(5, 40)
    serialized = request.serialize()
    assert len(serialized) < 40 * 120 / 2  # the frames went compressed
    parsed = InsertFrame.parse(serialized)
    assert parsed.frames[0][0] == "obs" and parsed.frames[0][1].data.tobytes() == request.frames[0][1].data.tobytes()
    assert client.insert([request]).duplicate_spans == 0
    stored = client.describe("pix")["counters"]["frames.obs.stored_bytes"]
    assert client.insert([request]).duplicate_spans == 1  # the retry of an acknowledged request
    info = client.describe("pix")
    assert info["stored_steps"] == 41 and info["counters"]["frames.obs.stored_bytes"] == stored
    assert info["counters"]["frames.obs.compression_ratio"] == pytest.approx(41 * 120 / stored)
    batch = client.sample("pix", 64, Sequences(8), include_keys=True, seed=0)
    assert batch["obs"].shape == (64, 8, 4, *FRAME)


def test_the_writer_compresses_frames_of_stacked_observations(client: ReplayClient) -> None:
    client.create_buffer("pix", 2000, SCHEMA, capacity_bytes=300_000)
    with EpisodeWriter(client, "pix", chunk_rows=16) as writer:
        for episode in range(12):
            first = writer._episode_id
            for t in range(30):
                stack = np.stack([frame_of(episode, max(t - 3 + j, 0)) for j in range(4)])
                writer.append(obs=stack, t=t, reward=1.0)
            writer.end_episode(terminated=True, obs=frame_of(episode, 30))
            assert first != writer._episode_id
    batch = client.sample("pix", 128, Transitions(2), include_keys=True, seed=1)
    for prefix, shift in (("", 0), ("next_", 1)):
        episodes, steps = named(batch[prefix + "obs"].reshape(-1, *FRAME))
        assert len(np.unique(episodes.reshape(128, 4), axis=1)[0]) == 1  # one episode per stack
        np.testing.assert_array_equal(steps.reshape(128, 4), np.maximum(
            batch["t"][:, None] + shift + np.arange(-3, 1), 0))


# ---------------------------------------------------------------------------------------------- durability
def test_a_checkpoint_racing_inserts_restores_whole_frames(tmp_path, compression: str) -> None:
    registry = BufferRegistry(f"{TEST_INSTANCE}ck")
    restored = BufferRegistry(f"{TEST_INSTANCE}rs")
    try:
        buffer = EpisodicBuffer("pix", registry.instance, fields(compression, stack=2), 400, capacity_bytes=30_000)
        registry.add("pix", buffer)
        next_episode = iter(range(10_000))
        for _ in range(20):
            insert_whole(buffer, next(next_episode), 15, compression)
        # Each chunk written lets 3 episodes in: the arena turns over under the checkpoint.
        manifest = checkpoint.write_checkpoint(registry, tmp_path, chunk_bytes=2048, on_chunk=lambda: [
            insert_whole(buffer, next(next_episode), 15, compression) for _ in range(3)])
        assert json.loads(manifest.read_text())["buffers"][0]["snapshot_attempts"] > 1  # a torn chunk was seen
        checkpoint.restore_checkpoint(manifest.parent, restored)
        copy = restored.get("pix")
        assert copy.stored_steps > 0
        for _ in range(3):
            check_batch(copy.sample(128, TransitionsMode(3, 0.9), np.random.default_rng(3), include_keys=True), 2)
        live = np.flatnonzero(copy.ring.row_seq >= 0)
        arena = copy.ring.arenas["obs"]
        assert int(arena.state[1]) == int(arena.length[live].sum())
    finally:
        registry.close()
        restored.close()


@pytest.mark.parametrize(("method", "after"), [("_write_frames", False), ("_write_frames", True),
                                              ("evict_before", True), ("_kill_extent", False),
                                              ("_write_extent_rows", True), ("_write_block", True)])
def test_a_writer_killed_mid_insert_is_repaired_frames_and_all(method: str, after: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with segments_removed(f"rpd_{TEST_INSTANCE}_crash"):
        buffer = EpisodicBuffer("crash", TEST_INSTANCE, fields("zstd", stack=2), 400, capacity_bytes=30_000)
        header = buffer.storage.header_name
        for episode in range(8):
            insert_whole(buffer, episode, 20, "zstd")
        insert_chunk(buffer, 100, 0, 5, 60, "zstd")  # an open episode with a small room
        insert_whole(buffer, 50, 10, "zstd")
        crash_inside(buffer, method, monkeypatch, after)
        with pytest.raises(Crash):
            if method in ("_kill_extent", "_write_extent_rows"):  # the open episode outgrows its room: a move
                insert_chunk(buffer, 100, 5, 45, 60, "zstd")
            else:
                insert_whole(buffer, 60, 150, "zstd")  # evicts the oldest episodes, by rows and bytes
        monkeypatch.undo()
        buffer.storage.close()  # the process is gone; the segments stay
        with closing(EpisodicBuffer.recover(header)) as recovered:
            arena = recovered.ring.arenas["obs"]
            live = np.flatnonzero(recovered.ring.row_seq >= 0)
            assert int(arena.state[1]) == int(arena.length[live].sum())
            assert int(arena.state[0]) == int((arena.offset[live] + arena.length[live]).max())
            landed = recovered.writer.open[100].landed
            insert_chunk(recovered, 100, landed, 61, 60, "zstd")  # the open episode goes on and closes
            for _ in range(3):
                check_batch(recovered.sample(128, TransitionsMode(2, 0.9), np.random.default_rng(0), True), 2)
            insert_whole(recovered, 70, 100, "zstd")  # and the repaired arena takes new frames
            check_batch(recovered.sample(128, TransitionsMode(1, 0.9), np.random.default_rng(1), True), 2)


# ---------------------------------------------------------------------------------------------- lock-free readers
OPEN_EPISODES, SECONDS = 10, 3.0


def read(header_name: str, seconds: float, results: multiprocessing.Queue) -> None:
    """A reader process: samples without the lock; reports (items, wrong items, error)."""
    ring = RingReader.attach(header_name)
    rng, mode = np.random.default_rng(os.getpid()), TransitionsMode(3, 0.9)
    items, wrong, error = 0, 0, None
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                batch, _ = ring.sample_shared(64, mode, rng, include_keys=True)
            except FailedPrecondition as exc:
                if "no sampleable step" in str(exc) or "raced with the writer" in str(exc):
                    continue  # liveness on 2 busy cores, not a torn batch (tests/test_lock_free_reads.py)
                raise
            try:
                check_batch(batch, stack=2)
            except AssertionError:
                wrong += 1
            items += 64
    except Exception as exc:  # reported to the test, which fails on it
        error = repr(exc)
    finally:
        ring.close()
    results.put((items, wrong, error))


def write(buffer: EpisodicBuffer, stop: threading.Event, failures: list[BaseException]) -> None:
    """Chunks of interleaved open episodes into a small arena: episodes move, close and are evicted by bytes."""
    try:
        insert_chunks(buffer, stop)
    except BaseException as exc:  # the test fails on it
        failures.append(exc)


def insert_chunks(buffer: EpisodicBuffer, stop: threading.Event) -> None:
    rng = np.random.default_rng(1)
    sent, lengths, next_episode = {}, {}, 0
    while not stop.is_set():
        while len(sent) < OPEN_EPISODES:
            sent[next_episode], lengths[next_episode] = 0, int(rng.integers(4, 50))
            next_episode += 1
        episode = int(rng.choice(list(sent)))
        k = min(int(rng.integers(2 if sent[episode] == 0 else 1, 6)), lengths[episode] + 1 - sent[episode])
        try:
            insert_chunk(buffer, episode, sent[episode], sent[episode] + k, lengths[episode], "lz4")
            sent[episode] += k
            done = sent[episode] == lengths[episode] + 1
        except (FailedPrecondition, ResourceExhausted):  # evicted (or about to be) while open: start another
            done = True
        if done:
            del sent[episode]


def test_lock_free_samples_of_compressed_frames_are_whole_while_the_arena_turns_over() -> None:
    buffer = EpisodicBuffer("race", f"{TEST_INSTANCE}race", fields("lz4", stack=2), 2000, capacity_bytes=125_000)
    stop, failures = threading.Event(), []
    writer = threading.Thread(target=write, args=(buffer, stop, failures))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    reader = context.Process(target=read, args=(buffer.storage.header_name, SECONDS, results))
    try:
        insert_whole(buffer, 100_000, 30, "lz4")
        writer.start()
        reader.start()
        items, wrong, error = results.get(timeout=SECONDS + 120)
    finally:
        stop.set()
        reader.join(timeout=30)
        if reader.is_alive():
            reader.kill()
        writer.join()
        counters = buffer.counters
        buffer.close()
    assert error is None and failures == []
    assert counters["evicted_episodes"] > 50 and counters["moved_open_episodes"] > 50  # the races happened
    assert items > 5_000 and wrong == 0


# ---------------------------------------------------------------------------------------------- server sides
def test_sample_workers_and_metrics_serve_compressed_buffers(tmp_path) -> None:
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}pw", sample_workers=1,
                          http_address="127.0.0.1:0").start()
    try:
        with ReplayClient(server.address) as client:
            client.create_buffer("pix", 1000, SCHEMA, capacity_bytes=100_000)
            for episode in range(10):
                client.insert([request_of(episode, 30)])
            assert client.describe("pix")["sample_endpoints"]
            for decompress in ("server", "client"):  # the workers ship frames too
                for batch in client.sample_stream("pix", 32, Transitions(), num_batches=3, include_keys=True,
                                                  decompress=decompress):
                    episodes, _ = named(batch["obs"].reshape(-1, *FRAME))
                    np.testing.assert_array_equal(episodes.reshape(32, 4)[:, -1], batch["episode_id"])
            base = f"http://127.0.0.1:{server.http.port}"
            [stats] = httpx.get(f"{base}/api/buffers").json()["buffers"]
            assert stats["frames"]["obs"]["stored_bytes"] > 0 and stats["frames"]["obs"]["compression_ratio"] > 2
            metrics = httpx.get(f"{base}/metrics").text
            assert 'replayd_buffer_frames_stored_bytes{buffer="pix",field="obs"}' in metrics
            assert 'replayd_buffer_frames_compression_ratio{buffer="pix",field="obs"}' in metrics
    finally:
        server.stop(grace=0)


def test_the_wire_carries_compression_options_and_refuses_bad_ones(client: ReplayClient) -> None:
    info = client.create_buffer("pix", 0, {"obs": ("uint8", FRAME, Frames(compression="lz4")), "a": ("int64", ())},
                                capacity_bytes=500_000)
    assert info["frames"] == {"obs": Frames(compression="lz4")} and info["capacity_bytes"] == 500_000
    assert info["capacity_steps"] > 1000
    bad = pb.CreateBufferRequest(name="bad", episodic=pb.EpisodicConfig(capacity_steps=100, fields=[
        pb.FieldSpec(name="obs", dtype="uint8", shape=[4], observation=True, compression="brotli")]))
    code, details = rpc_status(client._stub.CreateBuffer, bad)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "field 'obs': compression must be one of" in details
    with pytest.raises(InvalidArgument, match="frames: compression must be one of 'zstd', 'lz4' or none"):
        Frames(compression="snappy")


# ---------------------------------------------------------------------------------------------- decompress="client"
@pytest.mark.parametrize("mode", [Transitions(1), Transitions(3), Sequences(6, burn_in=2)],
                         ids=["1-step", "3-step", "sequences"])
def test_frames_decompressed_by_the_client_are_the_servers_batch(client: ReplayClient, mode: object) -> None:
    client.create_buffer("pix", 1000, SCHEMA, capacity_bytes=150_000)
    client.insert([request_of(episode, int(length)) for episode, length in enumerate(
        np.random.default_rng(0).integers(5, 40, 25))])
    server_side = client.sample("pix", 64, mode, seed=4, include_keys=True)
    client_side = client.sample("pix", 64, mode, seed=4, include_keys=True, decompress="client")
    assert server_side.keys() == client_side.keys()
    for name in server_side:
        np.testing.assert_array_equal(client_side[name], server_side[name], err_msg=name)
    if mode == Transitions(1):
        assert client_side["bootstrap_obs"] is client_side["next_obs"]
    streamed = list(client.sample_stream("pix", 64, mode, num_batches=3, seed=4, include_keys=True,
                                         decompress="client"))
    np.testing.assert_array_equal(streamed[0]["obs"], server_side["obs"])


def test_shipped_frames_cross_the_wire_compressed(client: ReplayClient, server) -> None:
    from replayd.server.grpc_server.servicer import sample_message
    from replayd.wire.frames import sample_response

    client.create_buffer("pix", 1000, SCHEMA, capacity_bytes=150_000)
    client.insert([request_of(episode, 30) for episode in range(10)])
    buffer = server.registry.get("pix")
    shipped: list = []
    batch = buffer.sample(32, TransitionsMode(1, 0.9), np.random.default_rng(0), shipped=shipped)
    assert batch["obs"].dtype == np.int32 and batch["obs"].shape == (32, 4)  # indices of each stacked frame
    message = sample_message(batch, 2**30, shipped)
    whole = sample_message(buffer.sample(32, TransitionsMode(1, 0.9), np.random.default_rng(0)), 2**30)
    assert len(message) * 3 < len(whole)  # small test frames; Atari frames: see bench/bench_pixels.py
    parsed = sample_response(message)
    [(metadata, frames)] = parsed.frames
    assert metadata.field == "obs" and list(metadata.columns) == ["obs", "next_obs", "bootstrap_obs"]
    assert metadata.spec.stack == 4 and metadata.spec.compression == "zstd"
    assert len(frames) == len(np.unique(batch["obs"].tolist() + batch["next_obs"].tolist()))
    code, details = rpc_status(client._server_sampling.sample, pb.SampleRequest(
        buffer="pix", batch_size=4, mode=Transitions().to_proto(), decompress="gpu"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sample.decompress: expected 'server' or 'client'" in details
    with pytest.raises(ValueError, match="decompress: expected 'server' or 'client', got 'gpu'"):
        client.sample("pix", 4, decompress="gpu")


def test_the_loader_decompresses_shipped_frames_on_its_thread(client: ReplayClient) -> None:
    import torch

    from replayd.client.loader import Loader

    client.create_buffer("pix", 1000, SCHEMA, capacity_bytes=150_000)
    client.insert([request_of(episode, 30) for episode in range(10)])
    reference = list(client.sample_stream("pix", 16, Transitions(2), num_batches=3, seed=9))
    threads = set()
    decode = __import__("replayd.client.batch_stream", fromlist=["decode_sample"]).decode_sample

    def recording(message: object) -> dict:
        threads.add(threading.current_thread().name)
        return decode(message)

    stream = client.sample_stream("pix", 16, Transitions(2), num_batches=3, seed=9, decompress="client")
    stream._decode = recording
    with Loader(stream, prefetch=2) as loader:
        batches = list(loader)
    assert threads == {"replayd-loader"}
    for got, expected in zip(batches, reference, strict=True):
        assert torch.equal(got["bootstrap_obs"], torch.from_numpy(expected["bootstrap_obs"]))


def test_an_episode_whose_frames_outgrow_the_arena_is_refused_before_any_chunk_is_sent(server) -> None:
    with ReplayClient(server.address, max_request_bytes=2000) as small_requests:
        small_requests.create_buffer("pix", 1000, SCHEMA, capacity_bytes=62_000)
        arena = small_requests.describe("pix")["counters"]["frames.obs.arena_bytes"]
        frames = np.random.default_rng(0).integers(0, 256, (201, *FRAME), dtype=np.uint8)  # hardly compress
        with pytest.raises(ValueError, match=f"its arena of {int(arena)} bytes in buffer 'pix'"):
            small_requests.insert_episode("pix", True, obs=frames, t=np.arange(200), reward=np.ones(200, np.float32))
        assert small_requests.describe("pix")["stored_steps"] == 0
