"""Shared memory as a feature: a reader in another process samples the server's ring directly."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from replayd.client import ReplayClient
from replayd.client.local_reader import LocalReader
from replayd.client.polling import wait_until
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.buffers.lifetime import SharedReads
from replayd.server.buffers.reader import RingReader
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.removers import MaxTimesSampledRemover
from replayd.server.schema import Field
from replayd.wire.components import Geometric, Prioritized, States, Transitions
from replayd.wire.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, RingChanged
from tests.conftest import TEST_INSTANCE

SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}
GAMMA = 0.9


def test_local_reader_matches_grpc_sampling(client: ReplayClient) -> None:
    client.create_buffer("local", 5000, SCHEMA)
    rng = np.random.default_rng(0)
    client.insert_episodes("local", [{"obs": rng.normal(size=(n + 1, 4)).astype(np.float32),
                                      "action": rng.integers(0, 2, n), "reward": rng.normal(size=n).astype(np.float32)}
                                     for n in rng.integers(5, 60, 40)], [True, False] * 20)
    with LocalReader(client, "local") as reader:
        for mode in (Transitions(n_step=3, gamma=0.9), Geometric(discount=0.5), States()):
            local = reader.sample(128, mode, seed=11, include_keys=True)
            remote = client.sample("local", 128, mode, seed=11, include_keys=True)
            assert local.keys() == remote.keys()
            for name in local:
                np.testing.assert_array_equal(local[name], remote[name], err_msg=f"{mode}: {name}")
        assert len(list(reader.sample_stream(32, num_batches=5))) == 5


def _insert_some_episodes(client: ReplayClient, buffer: str) -> None:
    client.create_buffer(buffer, 5000, SCHEMA)
    rng = np.random.default_rng(0)
    client.insert_episodes(buffer, [{"obs": rng.normal(size=(n + 1, 4)).astype(np.float32),
                                     "action": rng.integers(0, 2, n), "reward": rng.normal(size=n).astype(np.float32)}
                                    for n in rng.integers(5, 60, 20)], [True, False] * 10)


def test_a_seeded_local_stream_is_reproducible(client: ReplayClient) -> None:
    _insert_some_episodes(client, "local")
    with LocalReader(client, "local") as reader:
        first, again, other = (list(reader.sample_stream(64, num_batches=3, seed=seed, include_keys=True))
                               for seed in (3, 3, 4))
    assert len(first) == len(again) == 3
    for a, b in zip(first, again, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert not np.array_equal(first[0]["key"], other[0]["key"])  # the seed chooses the draws


def test_a_local_reader_counts_the_torn_draws_it_redraws(client: ReplayClient,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A draw that raced with the writer is drawn again, and counted in torn_redraws (sample and stream)."""
    _insert_some_episodes(client, "local")
    with LocalReader(client, "local") as reader:
        gather, raced = reader.ring.gather, []

        def gather_racing_every_other_draw(*args: Any, **kwargs: Any) -> Any:
            raced.append(len(raced) % 2 == 0)
            if raced[-1]:
                raise RingChanged("injected: evictions emptied the drawn range")
            return gather(*args, **kwargs)

        monkeypatch.setattr(reader.ring, "gather", gather_racing_every_other_draw)
        assert reader.torn_redraws == 0
        assert reader.sample(8)["obs"].shape == (8, 4)
        assert reader.torn_redraws == 1
        batches = list(reader.sample_stream(8, num_batches=3))
        assert len(batches) == 3 and all(batch["obs"].shape == (8, 4) for batch in batches)
        assert reader.torn_redraws == 4 and raced.count(True) == 4


def test_local_sampling_refuses_counts_the_grpc_path_refuses(client: ReplayClient) -> None:
    """Protobuf refuses a float n_step and the server a negative num_batches; in-process they are refused too,
    not cut to int(2.9) = 2 and to nothing."""
    _insert_some_episodes(client, "local")
    with LocalReader(client, "local") as reader:
        with pytest.raises(InvalidArgument, match=r"transitions.n_step must be an integer in 1..1000, got 2.9"):
            reader.sample(8, mode=Transitions(n_step=2.9))
        with pytest.raises(InvalidArgument, match=r"transitions.n_step must be an integer in 1..1000, got True"):
            reader.sample(8, mode=Transitions(n_step=True))
        for count in (-1, 2.5):
            with pytest.raises(InvalidArgument, match=rf"num_batches expected an integer >= 0 .*got {count}"):
                reader.sample_stream(8, num_batches=count)
        assert reader.sample(8, mode=Transitions(n_step=np.int64(2)))["obs"].shape == (8, 4)


def test_a_closed_local_stream_yields_nothing_more(client: ReplayClient) -> None:
    _insert_some_episodes(client, "local")
    with LocalReader(client, "local") as reader:
        stream = reader.sample_stream(8, num_batches=3)
        assert next(stream)["obs"].shape == (8, 4)
        stream.close()
        assert list(stream) == []  # two batches were left, and data is there
        unread = reader.sample_stream(8, num_batches=3)
        unread.close()
        assert list(unread) == []


def test_local_reader_stops_when_the_buffer_is_deleted_or_re_created(client: ReplayClient,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's mapping outlives the unlinked segment: it must not go on sampling a frozen snapshot."""
    monkeypatch.setattr("replayd.client.local_reader.CHECK_EVERY", 0.0)
    episode = {"obs": np.ones((11, 4), np.float32), "action": np.zeros(10, np.int64), "reward": np.ones(10, np.float32)}
    for replace in (False, True):
        client.create_buffer("gone", 1000, SCHEMA)
        client.insert_episodes("gone", [episode], [True])
        with LocalReader(client, "gone") as reader:
            stream = reader.sample_stream(8)
            assert next(stream)["obs"].shape == (8, 4)
            client.delete_buffer("gone")
            if replace:  # the same name again: a new segment, new data
                client.create_buffer("gone", 1000, SCHEMA)
                client.insert_episodes("gone", [{**episode, "obs": np.full((11, 4), 7, np.float32)}], [True])
            with pytest.raises(NotFound, match="was deleted or re-created"):
                reader.sample(8)
            with pytest.raises(NotFound, match="was deleted or re-created"):
                next(stream)
        if replace:
            client.delete_buffer("gone")


def test_a_buffer_deleted_while_a_reader_attaches_is_not_found(client: ReplayClient,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    client.create_buffer("gone", 1000, SCHEMA)
    describe = client.describe

    def describe_then_delete(name: str) -> dict:
        info = describe(name)
        monkeypatch.setattr(client, "describe", describe)
        client.delete_buffer(name)  # between the reader's describe and its attach
        return info

    monkeypatch.setattr(client, "describe", describe_then_delete)
    with pytest.raises(NotFound, match="'gone'"):
        LocalReader(client, "gone")


def test_local_reader_waits_for_data_when_asked(client: ReplayClient) -> None:
    client.create_buffer("later", 1000, SCHEMA)
    episode = {"obs": np.ones((11, 4), np.float32), "action": np.zeros(10, np.int64), "reward": np.ones(10, np.float32)}
    with LocalReader(client, "later") as reader:
        with pytest.raises(FailedPrecondition, match="no sampleable steps"):
            reader.sample(8)
        with pytest.raises(DeadlineExceeded, match=r"got no step to draw within 0\.1s"):
            reader.sample(8, wait=True, timeout=0.1)
        writer = threading.Thread(target=client.insert_episodes, args=("later", [episode], [True]))
        writer.start()
        assert reader.sample(8, wait=True, timeout=30)["obs"].shape == (8, 4)
        assert next(reader.sample_stream(8, wait=True, timeout=30))["obs"].shape == (8, 4)
        writer.join()


@pytest.mark.parametrize("wait", [
    pytest.param(lambda reader: reader.sample(8, wait=True), id="sample without timeout"),
    pytest.param(lambda reader: reader.sample(8, wait=True, timeout=60), id="sample with timeout"),
    pytest.param(lambda reader: next(reader.sample_stream(8, wait=True, timeout=60)), id="sample_stream"),
])
def test_a_reader_waiting_for_data_stops_when_the_buffer_is_deleted(
        client: ReplayClient, monkeypatch: pytest.MonkeyPatch, wait: Callable[[LocalReader], object]) -> None:
    """A deleted buffer never gets data: a reader waiting on it raises NotFound, not DeadlineExceeded at the
    timeout (or no answer at all without one)."""
    waiting = threading.Event()
    deleted_at: list[float] = []

    def wait_until_noted(check: Callable[[], object], deadline: float, what: str, **options: Any) -> object:
        waiting.set()
        # At most 5 s, so that a reader that misses the deletion fails this test instead of hanging it.
        return wait_until(check, min(deadline, time.monotonic() + 5), what, **options)

    def delete_once_waiting() -> None:
        if waiting.wait(30):
            client.delete_buffer("empty")
            deleted_at.append(time.monotonic())

    monkeypatch.setattr("replayd.client.local_reader.wait_until", wait_until_noted)
    client.create_buffer("empty", 1000, SCHEMA)
    deleter = threading.Thread(target=delete_once_waiting)
    with LocalReader(client, "empty") as reader:
        deleter.start()
        with pytest.raises(NotFound, match="was deleted or re-created"):
            wait(reader)
        raised_at = time.monotonic()
    deleter.join()  # the reader may see the deletion before the deleter's call returns
    # The reader checks every 50 ms; a second leaves room for a loaded machine.
    assert raised_at - deleted_at[0] < 1.0


def test_local_reader_refuses_buffers_only_the_server_may_sample() -> None:
    fields = [Field("obs", "float32", (2,), observation=True), Field("reward", "float32")]
    buffer = EpisodicBuffer("retiring", TEST_INSTANCE, fields, 100, remover=MaxTimesSampledRemover(2))
    try:
        with pytest.raises(FailedPrecondition, match="sampled by its server only"):
            RingReader.attach(buffer.storage.header_name)
    finally:
        buffer.close()


def test_local_reader_samples_prioritized_buffers_like_the_server(client: ReplayClient) -> None:
    client.create_buffer("prio", 5000, SCHEMA, sampler=Prioritized(alpha=0.7))
    rng = np.random.default_rng(1)
    client.insert_episodes("prio", [{"obs": rng.normal(size=(n + 1, 4)).astype(np.float32),
                                     "action": rng.integers(0, 2, n), "reward": np.ones(n, np.float32)}
                                    for n in rng.integers(5, 40, 30)], [True] * 30)
    keys = client.sample("prio", 64, include_keys=True, seed=2)["key"]
    client.update_priorities("prio", keys, rng.uniform(0.1, 5.0, len(keys)))
    with LocalReader(client, "prio") as reader:
        local = reader.sample(128, seed=9, include_keys=True, importance_beta=0.5)
    remote = client.sample("prio", 128, seed=9, include_keys=True, importance_beta=0.5)
    assert {"probability", "weight"} <= set(local)
    for name in remote:
        np.testing.assert_array_equal(local[name], remote[name], err_msg=name)


# ---------------------------------------------------------------- concurrency: writer vs reader processes
FIELDS = [Field("obs", "float64", (3,), observation=True), Field("reward", "float64")]


def episode_length(episode_id: int) -> int:
    return 3 + episode_id % 40


def reward_of(episode_id: int, t: np.ndarray) -> np.ndarray:
    return np.sin(episode_id * 1.7 + t * 0.3)


def make_episode(episode_id: int) -> dict[str, np.ndarray]:
    length = episode_length(episode_id)
    t = np.arange(length + 1, dtype=np.float64)
    checksum = np.cos(episode_id * 0.37 + t * 1.3)  # any torn row shows up as a checksum mismatch
    obs = np.stack([np.full(length + 1, episode_id, np.float64), t, checksum], axis=1)
    reward = np.append(reward_of(episode_id, t[:-1]), 0.0)
    return {"obs": obs, "reward": reward}


def check_batch(batch: dict[str, np.ndarray], n_step: int) -> int:
    """Number of samples inconsistent with the episode they claim."""
    errors = 0
    for i in range(len(batch["key"])):
        episode_id, t, checksum = batch["obs"][i]
        episode_id, t = int(episode_id), int(t)
        length = episode_length(episode_id)
        n_eff = min(n_step, length - t)
        expected_return = float(np.sum(GAMMA ** np.arange(n_eff) * reward_of(episode_id, t + np.arange(n_eff))))
        ok = (
            int(batch["episode_id"][i]) == episode_id
            and checksum == np.cos(episode_id * 0.37 + t * 1.3)
            and tuple(batch["next_obs"][i][:2]) == (episode_id, t + 1)
            and tuple(batch["bootstrap_obs"][i][:2]) == (episode_id, t + n_eff)
            and bool(batch["terminated"][i]) == (t + 1 == length)
            and abs(batch["n_step_return"][i] - expected_return) < 1e-5
            and abs(batch["bootstrap_discount"][i] - (0.0 if t + n_eff == length else GAMMA**n_eff)) < 1e-6
        )
        errors += not ok
    return errors


def reader_process(header_name: str, seconds: float, results: mp.Queue) -> None:
    ring = RingReader.attach(header_name)
    rng = np.random.default_rng(os.getpid())
    mode = TransitionsMode(4, GAMMA)
    samples = errors = torn = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch, redrawn = ring.sample_shared(64, mode, rng, include_keys=True)
        samples += 64
        torn += redrawn
        errors += check_batch(batch, 4)
    ring.close()
    results.put({"samples": samples, "errors": errors, "torn_redraws": torn})


def test_readers_never_see_torn_samples_while_the_writer_evicts() -> None:
    buffer = EpisodicBuffer("race", TEST_INSTANCE, FIELDS, 600)  # small ring: constant eviction
    stop = threading.Event()
    inserted = [0]

    def writer() -> None:
        episode_id = 0
        while not stop.is_set():
            episodes = [make_episode(episode_id + k) for k in range(4)]
            columns = {name: np.concatenate([e[name] for e in episodes]) for name in ("obs", "reward")}
            lengths = np.array([episode_length(episode_id + k) for k in range(4)])
            buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(episode_id, episode_id + 4),
                                                        np.ones(4, bool)))
            episode_id += 4
            inserted[0] = episode_id

    thread = threading.Thread(target=writer)
    readers = []
    try:
        buffer.insert({"obs": make_episode(10_000)["obs"], "reward": make_episode(10_000)["reward"]},
                      Spans.whole_episodes(np.array([episode_length(10_000)]), [10_000], [True]))
        thread.start()
        context = mp.get_context("spawn")
        results = context.Queue()
        readers = [context.Process(target=reader_process, args=(buffer.storage.header_name, 4.0, results))
                   for _ in range(2)]
        for reader in readers:
            reader.start()
        reports = [results.get(timeout=120) for _ in readers]
    finally:
        # Readers and the writer thread stop before the segments go: the mapping must outlive them.
        stop.set()
        for reader in readers:
            reader.join(timeout=30)
            if reader.is_alive():
                reader.kill()
        if thread.is_alive():
            thread.join()
        buffer.close()
    assert inserted[0] > 1000, "the writer did not keep the ring turning over"
    assert all(report["samples"] > 1000 for report in reports), reports
    assert sum(report["errors"] for report in reports) == 0, reports


_CLOSE_WHILE_SAMPLING = """
import os, sys, threading
import numpy as np
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.buffers.reader import RingReader
from replayd.wire.errors import NotFound
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.schema import Field

instance = sys.argv[1]
writer = EpisodicBuffer("big", instance, [Field("obs", "float32", (1024,), True), Field("reward", "float32")], 4000)
try:
    writer.insert({"obs": np.ones((4000, 1024), np.float32), "reward": np.ones(4000, np.float32)},
                  Spans.whole_episodes(np.full(20, 199), np.arange(20), np.ones(20, bool)))
    ring = RingReader.attach(writer.storage.header_name)
    sampled, outcome = threading.Event(), []

    def sample_until_closed():  # 8192 rows of 4 KiB per column: the copies run without the GIL
        try:
            while True:
                ring.sample_shared(8192, TransitionsMode(3, 0.9), np.random.default_rng(0))
                sampled.set()
        except NotFound as exc:
            outcome.append(str(exc))
        finally:
            sampled.set()

    thread = threading.Thread(target=sample_until_closed)
    thread.start()
    sampled.wait()
    ring.close()  # e.g. a learner's `finally: reader.close()` while its loader thread still samples
    thread.join()
    try:
        ring.sample_shared(4, TransitionsMode(1, 0.9), np.random.default_rng(0))
    except NotFound as exc:
        outcome.append(str(exc))
    print(outcome)
finally:
    writer.close()
"""


def test_closing_a_reader_while_it_samples_is_an_error_not_a_crash() -> None:
    """close() waits for the samples running in other threads before it unmaps the ring, and later samples
    raise NotFound: unmapping under them would kill the process with SIGSEGV."""
    result = subprocess.run([sys.executable, "-c", _CLOSE_WHILE_SAMPLING, f"{TEST_INSTANCE}close"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(["this reader of buffer 'big' was closed"] * 2), result.stdout


def test_a_reader_close_waits_for_the_samples_running() -> None:
    reads = SharedReads("buffer")
    released = []
    with reads:  # a sample running
        closer = threading.Thread(target=reads.end, args=(lambda: released.append(True),))
        closer.start()
        wait_until(lambda: reads.closed, time.monotonic() + 10, "close() refusing new samples")
        assert released == []  # still mapped: the sample above is running
        with pytest.raises(NotFound, match="was closed"):
            reads.__enter__()
    closer.join(10)
    assert released == [True]
