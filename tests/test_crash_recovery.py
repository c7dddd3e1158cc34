"""Crash recovery: a writer killed mid-insert leaves segments a new writer reattaches to and repairs;
a server SIGKILLed twice while actors insert loses no acknowledged episode and tears none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager

import numpy as np
import pytest

from replayd.client import ReplayClient
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.buffers.reader import RingReader
from replayd.server.buffers.ring import ALIVE, IS_OPEN, EpisodicRing
from replayd.server.dedup import RECOVERED_WHOLE
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.removers import MaxTimesSampledRemover
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.server.schema import Field
from replayd.server.storage.shared_arrays import remove_segment, segments
from replayd.wire.errors import FailedPrecondition
from tests.conftest import TEST_INSTANCE, free_port

FIELDS = [Field("obs", "float64", (2,), observation=True), Field("reward", "float32")]


@contextmanager
def segments_removed(prefix: str) -> Iterator[None]:
    """Removes the segments named `prefix`... at the end: a writer that "died" leaves them behind."""
    try:
        yield
    finally:
        for name in segments(prefix):
            os.unlink(f"/dev/shm/{name}")


class Crash(BaseException):
    """Stands for SIGKILL in the middle of an operation: nothing after it runs."""


def episode(episode_id: int, length: int) -> dict[str, np.ndarray]:
    t = np.arange(length + 1, dtype=np.float64)
    obs = np.stack([np.full(length + 1, episode_id, np.float64), np.cos(episode_id + t)], axis=1)
    return {"obs": obs, "reward": np.ones(length + 1, np.float32)}


def whole(episode_id: int, length: int) -> tuple[dict[str, np.ndarray], Spans]:
    return episode(episode_id, length), Spans.whole_episodes(np.array([length]), [episode_id], [True])


def chunk(episode_id: int, rows: int, begins: bool, ends: bool, first_t: int = 0) -> tuple[dict, Spans]:
    data = episode(episode_id, first_t + rows - 1)
    columns = {name: array[first_t:first_t + rows] for name, array in data.items()}
    return columns, Spans(np.array([episode_id], np.uint64), np.array([rows]), np.array([begins]), np.array([ends]),
                          np.array([False]))


def live_episodes(ring: EpisodicRing) -> dict[int, tuple[int, int, bool]]:
    """episode id -> (start, last, open) of every live extent (fails on an id stored twice)."""
    tail_seq, next_seq = int(ring.state[1]), int(ring.state[2])
    found: dict[int, tuple[int, int, bool]] = {}
    for seq in range(tail_seq, next_seq):
        slot = seq % ring.extent_slots
        flags = int(ring.extent_flags[slot])
        if flags & ALIVE:
            episode_id = int(ring.extent_episode_id[slot])
            assert episode_id not in found, f"episode {episode_id} stored twice"
            found[episode_id] = (int(ring.extent_start[slot]), int(ring.extent_last[slot]), bool(flags & IS_OPEN))
    return found


def assert_untorn(ring: EpisodicRing, episodes: dict[int, tuple[int, int, bool]]) -> None:
    for episode_id, (start, last, _) in episodes.items():
        rows = np.arange(start, last + 1) % ring.capacity
        expected = episode(episode_id, last - start)["obs"]
        np.testing.assert_array_equal(ring.columns["obs"][rows], expected, err_msg=f"episode {episode_id} torn")


def crash_inside(buffer: EpisodicBuffer, method: str, monkeypatch: pytest.MonkeyPatch, after: bool = False) -> None:
    original = getattr(buffer.writer, method)

    def dies(*args, **kwargs):
        if after:
            original(*args, **kwargs)
        raise Crash(method)

    monkeypatch.setattr(buffer.writer, method, dies)


@pytest.mark.parametrize(("method", "after"), [("_write_block", False), ("_write_block", True),
                                              ("write_rows", False), ("evict_before", True),
                                              ("_kill_extent", False), ("_write_extent_rows", True)])
def test_writer_killed_mid_insert_is_repaired(method: str, after: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    with segments_removed(f"rpd_{TEST_INSTANCE}_crash"):
        buffer = EpisodicBuffer("crash", TEST_INSTANCE, FIELDS, 200, sampler=PrioritizedSampler(0.5))
        header = buffer.storage.header_name
        committed = {}
        for episode_id in range(4):
            buffer.insert(*whole(episode_id, 20))
            committed[episode_id] = 21
        buffer.insert(*chunk(100, 5, True, False))  # an open episode with a small reservation
        buffer.insert(*whole(50, 10))
        committed[50] = 11
        crash_inside(buffer, method, monkeypatch, after)
        with pytest.raises(Crash):
            if method in ("_kill_extent", "_write_extent_rows"):  # the open episode outgrows its room: a move
                buffer.insert(*chunk(100, 40, False, False, 5))
            else:
                buffer.insert(*whole(60, 70))  # evicts the oldest episodes to make room
        monkeypatch.undo()
        buffer.storage.close()  # the process is gone; the segments stay

        with closing(EpisodicBuffer.recover(header)) as recovered:
            ring_episodes = live_episodes(recovered.ring)
            assert_untorn(recovered.ring, {k: v for k, v in ring_episodes.items() if not v[2]})
            assert 100 in ring_episodes and ring_episodes[100][2]  # the open episode survived, once
            start, last, _ = ring_episodes[100]
            np.testing.assert_array_equal(recovered.ring.columns["obs"][np.arange(start, last + 1) % 200][:, 0], 100)
            assert recovered.stored_steps == sum(last - start + 1 for start, last, _ in ring_episodes.values())
            # Whatever the interrupted insert did not commit is gone; everything older is intact or evicted whole.
            for episode_id in set(ring_episodes) - {100}:
                assert episode_id in committed or episode_id == 60
            # The recovered writer carries on: the open episode continues, samples are whole.
            landed = last - start + 1
            recovered.insert(*chunk(100, 3, False, True, landed))
            batch = recovered.sample(64, TransitionsMode(3, 0.9), np.random.default_rng(0), include_keys=True)
            np.testing.assert_array_equal(batch["obs"][:, 0], batch["episode_id"].astype(np.float64))
            np.testing.assert_array_equal(batch["bootstrap_obs"][:, 0], batch["episode_id"].astype(np.float64))
            assert np.all(batch["probability"] > 0)


def test_server_killed_twice_loses_no_acknowledged_episode() -> None:
    instance = f"{TEST_INSTANCE}fault"
    port = free_port()
    address = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "replayd.server.cli", "serve", "--port", str(port), "--instance", instance,
               "--http-port", "-1", "--log-level", "WARNING", "--recover"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    acknowledged: list[list[int]] = [[] for _ in range(3)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def actor(index: int) -> None:
        try:
            with ReplayClient(address, timeout=20, retries=12) as client:
                episode_id = index * 1_000_000
                while not stop.is_set():
                    batch = [episode(episode_id + k, 5 + (episode_id + k) % 30) for k in range(4)]
                    episodes = [{"obs": e["obs"], "reward": e["reward"][:-1]} for e in batch]
                    client.insert_episodes("fault", episodes, [True] * 4, episode_ids=list(range(episode_id,
                                                                                                    episode_id + 4)))
                    acknowledged[index].extend(range(episode_id, episode_id + 4))
                    episode_id += 4
        except BaseException as exc:
            errors.append(exc)

    try:
        with ReplayClient(address, timeout=30) as client:
            client.wait_ready(timeout=60)
            # 500k rows, about 25 MB: fits Docker's 64 MB /dev/shm and is never evicted here
            client.create_buffer("fault", 500_000, {"obs": ("float64", (2,)), "reward": ("float32", ())})
        actors = [threading.Thread(target=actor, args=(i,)) for i in range(3)]
        for thread in actors:
            thread.start()
        for _ in range(2):
            deadline = time.monotonic() + 60
            before = sum(len(a) for a in acknowledged)
            while sum(len(a) for a in acknowledged) < before + 200:  # inserts are flowing
                assert time.monotonic() < deadline and not errors, errors
                time.sleep(0.02)
            os.kill(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
            server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        before = sum(len(a) for a in acknowledged)
        while sum(len(a) for a in acknowledged) < before + 200:  # and flow again after the second restart
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.02)
        stop.set()
        for thread in actors:
            thread.join(timeout=120)
        assert not errors, errors
        ring = RingReader.attach(f"rpd_{instance}_fault")
        try:
            stored = live_episodes(ring.ring)  # fails if any episode is stored twice
            acked = {e for ids in acknowledged for e in ids}
            assert acked <= set(stored), f"{len(acked - set(stored))} acknowledged episodes lost"
            assert_untorn(ring.ring, stored)
            assert not any(is_open for _, _, is_open in stored.values())
        finally:
            ring.close()
    finally:
        stop.set()
        server.terminate()
        server.wait(timeout=30)
        for name in segments(f"rpd_{instance}_"):
            os.unlink(f"/dev/shm/{name}")


def test_inconsistent_segments_fall_back_to_the_latest_checkpoint(tmp_path) -> None:
    from replayd.server.server import ReplayServer
    from replayd.server.storage.shared_arrays import SharedArrays

    instance = f"{TEST_INSTANCE}fallback"
    schema = {"obs": ("float64", (2,)), "reward": ("float32", ())}
    first = ReplayServer("127.0.0.1:0", instance=instance, checkpoint_dir=str(tmp_path)).start()
    try:
        died = False
        try:
            with ReplayClient(first.address) as client:
                client.create_buffer("b", 1000, schema)
                client.insert_episodes("b", [{"obs": episode(7, 10)["obs"], "reward": np.ones(10, np.float32)}],
                                       [True], episode_ids=[7])
                client.checkpoint()
                client.insert_episodes("b", [{"obs": episode(8, 10)["obs"], "reward": np.ones(10, np.float32)}],
                                       [True], episode_ids=[8])
            # The server dies without unlinking, and its ring state is left corrupt.
            first._server.stop(0).wait()
            first.registry.get("b").storage.close()
            first._instance_lock.release()  # as the kernel does when the process dies
            died = True
        finally:
            if not died:  # something above failed: stop the server for real
                first.stop(grace=0)
        corrupt = SharedArrays.attach(f"rpd_{instance}_b", readonly=False)
        corrupt.arrays["state"][0] = -5  # head
        corrupt.close()

        second = ReplayServer("127.0.0.1:0", instance=instance, checkpoint_dir=str(tmp_path), recover=True).start()
        try:
            with ReplayClient(second.address) as client:
                info = client.describe("b")
                assert info["episodes"] == 1  # the checkpoint's content: episode 8 came after it
                batch = client.sample("b", 32, include_keys=True)
                assert set(batch["episode_id"].tolist()) == {7}
        finally:
            second.stop(grace=0)
    finally:
        for name in segments(f"rpd_{instance}_"):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize(("method", "after"), [("write_rows", False), ("write_rows", True),
                                              ("_rows_written", False)])
def test_writer_killed_while_the_head_episode_grows_in_place(method: str, after: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The open episode at the head grows its room without moving; a crash there must not leave its last
    row past the head (recovery refused the whole buffer)."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_grow"):
        buffer = EpisodicBuffer("grow", TEST_INSTANCE, FIELDS, 200)
        header = buffer.storage.header_name
        buffer.insert(*whole(1, 20))
        buffer.insert(*chunk(100, 5, True, False))  # the head extent, with a small room
        crash_inside(buffer, method, monkeypatch, after)
        with pytest.raises(Crash):
            buffer.insert(*chunk(100, 30, False, False, 5))  # outgrows the room in place
        monkeypatch.undo()
        buffer.storage.close()

        with closing(EpisodicBuffer.recover(header)) as recovered:
            ring_episodes = live_episodes(recovered.ring)
            assert set(ring_episodes) == {1, 100} and ring_episodes[100][2]
            assert_untorn(recovered.ring, {1: ring_episodes[1]})
            start, last, _ = ring_episodes[100]
            assert last - start + 1 in (5, 35)  # the chunk landed whole or not at all
            np.testing.assert_array_equal(recovered.ring.columns["obs"][np.arange(start, last + 1) % 200][:, 0], 100)
            recovered.insert(*chunk(100, 3, False, True, last - start + 1))
            assert recovered.sample(16, TransitionsMode(1, 0.9), np.random.default_rng(0))["obs"].shape == (16, 2)


def span_at(episode_id: int, rows: int, begins: bool, ends: bool, offset: int) -> tuple[dict, Spans]:
    """A chunk that names its offset in the episode, as clients send them (for exactly-once retries)."""
    columns, spans = chunk(episode_id, rows, begins, ends, offset)
    return columns, Spans(spans.episode_ids, spans.rows, spans.begins, spans.ends, spans.terminated,
                          np.array([offset]))


@pytest.mark.parametrize("bounds_written", [False, True])
def test_writer_killed_while_closing_an_episode_in_place(bounds_written: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A close sets how the episode ended, then its rows' bounds, then its last row. Killed before the last
    row moves, recovery opens the episode again and the client's retry closes it (keeping it closed at its
    old last row would store an episode that never ended, cut short, and refuse the retry)."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_close"):
        buffer = EpisodicBuffer("close", TEST_INSTANCE, FIELDS, 200)
        header = buffer.storage.header_name
        buffer.insert(*span_at(100, 5, True, False, 0))  # open, with room for 10 rows
        buffer.insert(*whole(1, 10))
        original = buffer.writer.set_ring

        def dies(array: np.ndarray, pos: int, values: np.ndarray) -> None:
            if array is buffer.ring.row_end and values[0] >= 0:  # the closing bounds
                if bounds_written:
                    original(array, pos, values)
                raise Crash("close")
            original(array, pos, values)

        monkeypatch.setattr(buffer.writer, "set_ring", dies)
        with pytest.raises(Crash):
            buffer.insert(*span_at(100, 3, False, True, 5))
        monkeypatch.undo()
        buffer.storage.close()

        with closing(EpisodicBuffer.recover(header)) as recovered:
            assert live_episodes(recovered.ring) == {100: (0, 4, True), 1: (10, 20, False)}
            assert recovered.episodes == 1 and recovered.stored_steps == 16
            assert recovered.insert_result(*span_at(100, 3, False, True, 5)).completed == 1
            ring_episodes = live_episodes(recovered.ring)
            assert ring_episodes[100] == (0, 7, False)
            assert_untorn(recovered.ring, ring_episodes)


def test_writer_killed_after_a_closing_move_keeps_the_episode_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A closing chunk that moves the episode to the head, killed after the new place is committed and before
    the old one is retired: recovery keeps the new copy only (keeping both, the old one open, would let the
    retry store a third copy), and the retry is acknowledged as a duplicate."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_move"):
        buffer = EpisodicBuffer("move", TEST_INSTANCE, FIELDS, 200)
        header = buffer.storage.header_name
        buffer.insert(*span_at(100, 5, True, False, 0))
        buffer.insert(*whole(1, 10))
        crash_inside(buffer, "_kill_extent", monkeypatch)
        with pytest.raises(Crash):
            buffer.insert(*span_at(100, 20, False, True, 5))  # outgrows its room of 10: moves to the head
        monkeypatch.undo()
        buffer.storage.close()

        with closing(EpisodicBuffer.recover(header)) as recovered:
            assert live_episodes(recovered.ring) == {1: (10, 20, False), 100: (21, 45, False)}  # fails on a second copy
            assert recovered.episodes == 2 and recovered.stored_steps == 36 and recovered.open_episodes == 0
            result = recovered.insert_result(*span_at(100, 20, False, True, 5))  # the unacknowledged retry
            assert (result.completed, result.duplicate_spans) == (1, 1)
            assert live_episodes(recovered.ring) == {1: (10, 20, False), 100: (21, 45, False)}
            assert_untorn(recovered.ring, live_episodes(recovered.ring))


def test_writer_killed_between_the_two_tail_stores_of_an_eviction() -> None:
    """An eviction publishes the tail position, then the first live extent: killed in between, the oldest
    extents start below the tail. Recovery finishes the eviction rather than refusing the segments (and
    losing the buffer)."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_evict"):
        buffer = EpisodicBuffer("evict", TEST_INSTANCE, FIELDS, 60)
        header = buffer.storage.header_name
        for episode_id in range(3):
            buffer.insert(*whole(episode_id, 15))  # rows 0..47
        state = buffer.ring.state
        ring = buffer.ring
        state[6] = ring.extent_start[(int(state[1]) + 1) % ring.extent_slots]  # TAIL_POS past episode 0 only
        buffer.storage.close()

        with closing(EpisodicBuffer.recover(header)) as recovered:
            assert live_episodes(recovered.ring) == {1: (16, 31, False), 2: (32, 47, False)}
            assert recovered.episodes == 2 and recovered.stored_steps == 32 and recovered.sampleable_steps == 30
            recovered.insert(*whole(9, 30))  # rows 48..78: evicts episode 1 (rows 16..31) to make room
            assert set(live_episodes(recovered.ring)) == {2, 9}
            batch = recovered.sample(64, TransitionsMode(1, 0.9), np.random.default_rng(0), include_keys=True)
            np.testing.assert_array_equal(batch["obs"][:, 0], batch["episode_id"].astype(np.float64))


def test_a_retried_closing_chunk_is_acknowledged_after_recovery() -> None:
    """The server stores a closing chunk and dies before acknowledging it: after recovery, which remembers
    closed episodes whole, not by chunk, the client's retry is acknowledged as stored, not refused as "not
    open"."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_dedup"):
        buffer = EpisodicBuffer("dedup", TEST_INSTANCE, FIELDS, 200)
        header = buffer.storage.header_name
        buffer.insert(*span_at(100, 5, True, False, 0))
        buffer.insert(*span_at(100, 3, False, True, 5))
        buffer.storage.close()
        with closing(EpisodicBuffer.recover(header)) as recovered:
            result = recovered.insert_result(*span_at(100, 3, False, True, 5))
            assert (result.completed, result.duplicate_spans) == (1, 1)
            assert recovered.episodes == 1 and recovered.stored_steps == 8


def test_a_retried_request_of_a_whole_episode_in_chunks_is_acknowledged_after_recovery() -> None:
    """A request holding an episode's first chunk and its closing chunk (a large episode the client split) is
    stored, then the server dies before acknowledging it: the retry's first chunk (offset 0, fewer rows than
    the episode) is acknowledged, not refused as overlapping the episode that recovery remembers whole."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_first"):
        buffer = EpisodicBuffer("first", TEST_INSTANCE, FIELDS, 200)
        header = buffer.storage.header_name

        def request() -> tuple[dict, Spans]:
            first, _ = span_at(100, 5, True, False, 0)
            closing_rows, _ = span_at(100, 3, False, True, 5)
            columns = {name: np.concatenate([first[name], closing_rows[name]]) for name in first}
            return columns, Spans(np.array([100, 100], np.uint64), np.array([5, 3]), np.array([True, False]),
                                  np.array([False, True]), np.array([False, True]), np.array([0, 5]))

        buffer.insert(*request())
        buffer.storage.close()
        with closing(EpisodicBuffer.recover(header)) as recovered:
            result = recovered.insert_result(*request())
            assert (result.completed, result.duplicate_spans) == (1, 2)
            assert recovered.episodes == 1 and recovered.stored_steps == 8


def test_recovery_clears_the_draw_counts_of_rows_that_hold_no_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_times_sampled: a writer killed after an open episode's move commits, before its old rows are
    retired, leaves their draw counts, and recovery clears them: evicting those rows later would give their
    retired steps back to sampleable_steps, which would stay too high for good."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_counts"):
        buffer = EpisodicBuffer("counts", TEST_INSTANCE, FIELDS, 40, remover=MaxTimesSampledRemover(1))
        header = buffer.storage.header_name
        buffer.insert(*chunk(100, 4, True, False))  # open episode 100: rows 0..3, room 0..7
        buffer.insert(*whole(1, 5))  # rows 8..13: episode 100 cannot grow in place
        buffer.sample(3, TransitionsMode(1, 0.9), np.random.default_rng(0))  # retires 3 steps
        crash_inside(buffer, "_kill_extent", monkeypatch)
        with pytest.raises(Crash):
            buffer.insert(*chunk(100, 6, False, False, 4))  # 100 moves to the head; killed before rows 0..3 go
        buffer.storage.close()
        with closing(EpisodicBuffer.recover(header)) as recovered:
            for episode_id in range(2, 6):  # the ring turns over: rows 0..3 are evicted
                recovered.insert(*whole(episode_id, 6))
                counts = recovered.remover.times_sampled
                steps = sum(int(np.count_nonzero(counts[np.arange(start, last) % 40] < 1))
                            for start, last, _ in live_episodes(recovered.ring).values())
                assert recovered.sampleable_steps == steps


def test_a_chunk_running_past_a_recovered_closed_episode_is_refused() -> None:
    """Recovery remembers closed episodes whole: a chunk within their rows is a retry, one that runs past
    their last row is not, and must not be acknowledged with its rows dropped."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_past"):
        buffer = EpisodicBuffer("past", TEST_INSTANCE, FIELDS, 200)
        header = buffer.storage.header_name
        buffer.insert(*span_at(100, 5, True, False, 0))
        buffer.insert(*span_at(100, 3, False, True, 5))  # episode 100: rows 0..7, closed
        buffer.storage.close()
        with closing(EpisodicBuffer.recover(header)) as recovered:
            before = dict(recovered.counters)
            with pytest.raises(FailedPrecondition, match="span 0 continues episode 100"):
                recovered.insert(*span_at(100, 3, False, True, 7))  # rows 7..9: two rows past its end
            assert dict(recovered.counters) == before
            assert recovered.episodes == 1 and recovered.stored_steps == 8


def test_recovery_remembers_no_more_closed_episodes_than_the_dedup_window() -> None:
    with segments_removed(f"rpd_{TEST_INSTANCE}_window"):
        buffer = EpisodicBuffer("window", TEST_INSTANCE, FIELDS, 200, dedup_window=2)
        header = buffer.storage.header_name
        for episode_id in range(5):
            buffer.insert(*whole(episode_id, 4))
        buffer.storage.close()
        with closing(EpisodicBuffer.recover(header)) as recovered:
            assert recovered.episodes == 5
            assert len(recovered.dedup) == 2  # the newest two: 3 and 4
            assert recovered.dedup.snapshot() == [[3, RECOVERED_WHOLE, 5], [4, RECOVERED_WHOLE, 5]]


def test_a_failed_restore_after_recovery_keeps_the_recovered_buffers(tmp_path) -> None:
    """--recover --restore DIR where DIR holds no checkpoint (a mistyped path, or a kill before the first
    one): the start fails and keeps the buffers it has just reattached, their only copy."""
    from replayd.server.server import ReplayServer
    from replayd.server.storage.shared_arrays import SharedArrays

    instance = f"{TEST_INSTANCE}keep"
    with segments_removed(f"rpd_{instance}_"):
        for name in ("good", "bad"):
            buffer = EpisodicBuffer(name, instance, FIELDS, 200)
            buffer.insert(*whole(7, 10))
            buffer.storage.close()  # the server died; the segments stay
        corrupt = SharedArrays.attach(f"rpd_{instance}_bad", readonly=False)
        corrupt.arrays["state"][0] = -5  # head: "bad" is lost, and would come from the checkpoint
        corrupt.close()
        with pytest.raises(FailedPrecondition, match="no complete checkpoint"):
            ReplayServer("127.0.0.1:0", instance=instance, recover=True, restore_from=str(tmp_path)).start()
        assert segments(f"rpd_{instance}_") == [f"rpd_{instance}_good", f"rpd_{instance}_good.data"]
        server = ReplayServer("127.0.0.1:0", instance=instance, recover=True).start()
        try:
            assert server.registry.episodic("good").episodes == 1
        finally:
            server.stop(grace=0)


@pytest.mark.parametrize("checkpoint_from", ["restore_from", "checkpoint_dir"])
def test_recovery_restores_only_the_corrupt_buffers_from_the_checkpoint(tmp_path, checkpoint_from: str) -> None:
    """--recover with a checkpoint: a buffer whose segments pass the checks keeps what it stored after the
    checkpoint; only the corrupt one comes back from it. Restoring every checkpointed buffer would roll the
    good one back, or (as its name is taken) fail the start."""
    from replayd.server.checkpoint import write_checkpoint
    from replayd.server.registry import BufferRegistry
    from replayd.server.server import ReplayServer
    from replayd.server.storage.shared_arrays import SharedArrays

    instance = f"{TEST_INSTANCE}only"
    with segments_removed(f"rpd_{instance}_"):
        registry = BufferRegistry(instance)
        try:
            for name in ("good", "bad"):
                registry.add(name, EpisodicBuffer(name, instance, FIELDS, 200))
                registry.episodic(name).insert(*whole(7, 10))
            write_checkpoint(registry, tmp_path)
            for name in ("good", "bad"):
                registry.episodic(name).insert(*whole(8, 10))  # after the checkpoint
        finally:
            for name, _ in registry.all():
                registry.detach(name)  # the server died; the segments stay
        corrupt = SharedArrays.attach(f"rpd_{instance}_bad", readonly=False)
        corrupt.arrays["state"][0] = -5  # head
        corrupt.close()

        server = ReplayServer("127.0.0.1:0", instance=instance, recover=True, **{checkpoint_from: str(tmp_path)})
        try:
            server.start()
            stored = {name: set(live_episodes(server.registry.episodic(name).ring)) for name in ("good", "bad")}
            assert stored == {"good": {7, 8}, "bad": {7}}
        finally:
            server.stop(grace=0)


@pytest.mark.parametrize("checkpoint_from", ["restore_from", "checkpoint_dir"])
def test_recover_on_an_emptied_dev_shm_restores_the_whole_checkpoint(tmp_path, checkpoint_from: str) -> None:
    """After a reboot (or in a new container) no segment of the instance is left: --recover restored
    nothing, without a word, and periodic checkpoints of the empty server then pruned the good ones."""
    from replayd.server.checkpoint import write_checkpoint
    from replayd.server.registry import BufferRegistry
    from replayd.server.server import ReplayServer

    instance = f"{TEST_INSTANCE}boot"
    with segments_removed(f"rpd_{instance}_"):
        registry = BufferRegistry(instance)
        try:
            registry.add("kept", EpisodicBuffer("kept", instance, FIELDS, 200))
            registry.episodic("kept").insert(*whole(7, 10))
            write_checkpoint(registry, tmp_path)
        finally:
            for name, _ in registry.all():
                registry.detach(name)
        for segment in segments(f"rpd_{instance}_"):  # the reboot empties /dev/shm
            remove_segment(segment)
        server = ReplayServer("127.0.0.1:0", instance=instance, recover=True, **{checkpoint_from: str(tmp_path)})
        try:
            server.start()
            assert set(live_episodes(server.registry.episodic("kept").ring)) == {7}
        finally:
            server.stop(grace=0)


def test_bounds_of_an_uncommitted_block_are_not_drawn_after_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after _write_block stores the rows' bounds, before the head moves: recovery drops the block, and
    its bounds past the head too. A new open episode's reserved (unwritten) room would read them, and the
    uniform sampler would draw the dead block's rows as steps of the new episode."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_phantom"):
        buffer = EpisodicBuffer("phantom", TEST_INSTANCE, FIELDS, 200)
        header = buffer.storage.header_name
        buffer.insert(*whole(1, 20))  # positions 0..20
        crash_inside(buffer, "_write_block", monkeypatch, after=True)
        with pytest.raises(Crash):
            buffer.insert(*whole(2, 30))  # would be 21..51: never acknowledged
        monkeypatch.undo()
        buffer.storage.close()
        with closing(EpisodicBuffer.recover(header)) as recovered:
            recovered.insert(*chunk(3, 5, True, False))  # open: rows 21..25 landed, room to 30
            positions = np.arange(recovered.tail_position(), recovered.head)
            _, bounds, _ = recovered.ring.episode_bounds(positions)
            assert int(np.count_nonzero(positions < bounds)) == recovered.sampleable_steps  # 24, not 29
            batch = recovered.sample(2000, TransitionsMode(1, 0.9), np.random.default_rng(0), include_keys=True)
            np.testing.assert_array_equal(batch["obs"][:, 0], batch["episode_id"].astype(np.float64))


@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("grows", [False, True])
def test_steps_an_interrupted_append_commits_have_a_priority(grows: bool, after: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An append to an open episode commits when its last row is published (the head is already past its
    room, or grown to cover it), so the steps it adds get their first priority before that: killed in
    between, they would come back live with leaf 0, counted sampleable but never drawn."""
    with segments_removed(f"rpd_{TEST_INSTANCE}_prio"):
        buffer = EpisodicBuffer("prio", TEST_INSTANCE, FIELDS, 200, sampler=PrioritizedSampler(0.5))
        header = buffer.storage.header_name
        buffer.insert(*chunk(100, 5, True, False))  # open, with a small room
        if not grows:
            buffer.insert(*whole(1, 10))  # after the room: the append stays inside it
        crash_inside(buffer, "_rows_written", monkeypatch, after)
        with pytest.raises(Crash):
            buffer.insert(*chunk(100, 30 if grows else 3, False, False, 5))
        monkeypatch.undo()
        buffer.storage.close()
        with closing(EpisodicBuffer.recover(header)) as recovered:
            positions = np.arange(recovered.tail_position(), recovered.head)
            rows, bounds, _ = recovered.ring.episode_bounds(positions)
            steps = positions < bounds
            assert int(np.count_nonzero(steps)) == recovered.sampleable_steps
            leaves = recovered.sampler.tree.get(rows)
            assert np.all(leaves[steps] > 0), f"live steps without a priority at {positions[steps & (leaves == 0)]}"
            assert np.all(leaves[~steps] == 0)
