"""Sequence replay against a plain-Python reference built from the inserted episodes: every sequence is the
right rows of one episode in order, with its masks, flags and n-step targets, across ring wrap-around,
eviction and chunked open episodes, on the writer's path and a lock-free reader's; starts follow the
sampler's law among the allowed starts."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from replayd.client import Prioritized, ReplayClient, Sequences, ShardedReplayClient
from replayd.client.local_reader import LocalReader
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.buffers.reader import RingReader
from replayd.server.modes.sequences import SequencesMode
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.server.server import ReplayServer
from replayd.wire.errors import FailedPrecondition, InvalidArgument
from tests.conftest import TEST_INSTANCE
from tests.test_episodic_buffer import FIELDS, RefEpisode, _chi_square_critical, expected_item, make_rows

BATCH = 64


def new_buffer(capacity: int, **components: object) -> EpisodicBuffer:
    return EpisodicBuffer("seq", f"test{os.getpid()}", FIELDS, capacity, **components)


def check_sequences(buffer: EpisodicBuffer | RingReader, episodes: dict[int, RefEpisode], mode: SequencesMode,
                    rng: np.random.Generator, batch: dict[str, np.ndarray] | None = None) -> None:
    """Each sequence of one batch equals the reference episode's rows from its start."""
    if batch is None:
        batch = buffer.sample(BATCH, mode, rng, include_keys=True)
    steps, options = mode.steps, mode.options
    assert batch["mask"].shape == (len(batch["key"]), steps)
    for i, episode_id in enumerate(batch["episode_id"]):
        episode = episodes[int(episode_id)]
        start, bound = int(batch["t"][i, 0]), len(episode.obs) - 1
        assert start < bound, "a sequence starts at a step"
        assert start % options.period == 0
        if options.boundary == "fit":
            assert start + steps <= bound
        for j in range(steps):
            check_row(batch, i, j, episode, start + j, bound, options)


def check_row(batch: dict[str, np.ndarray], i: int, j: int, episode: RefEpisode, t: int, bound: int,
              options: Sequences) -> None:
    if t > bound:  # past the episode's final observation: zeros, no step
        for name in ("obs", "t", "action", "reward", *("mask", "is_first", "terminated", "truncated")):
            assert not np.any(batch[name][i, j]), (name, t, bound)
        return
    np.testing.assert_array_equal(batch["obs"][i, j], episode.obs[t])
    assert batch["t"][i, j] == t and bool(batch["is_first"][i, j]) == (t == 0)
    assert bool(batch["mask"][i, j]) == (t < bound)
    if t == bound:  # the final (or last landed) observation: held, but no step starts there
        assert not batch["terminated"][i, j] and not batch["truncated"][i, j]
        return
    want = expected_item(episode, t, max(options.n_step, 1), options.gamma)
    assert batch["action"][i, j] == want["action"] and batch["reward"][i, j] == want["reward"]
    assert bool(batch["terminated"][i, j]) == want["terminated"]
    assert bool(batch["truncated"][i, j]) == want["truncated"]
    if options.n_step:
        assert batch["n_step_return"][i, j] == pytest.approx(want["n_step_return"], rel=1e-5, abs=1e-5)
        assert batch["bootstrap_discount"][i, j] == pytest.approx(want["bootstrap_discount"], rel=1e-6)
        n_eff = min(options.n_step, bound - t)
        assert batch["bootstrap_step"][i, j] == j + n_eff


MODES = [SequencesMode(6), SequencesMode(8, burn_in=4, n_step=3, gamma=0.9), SequencesMode(5, period=3),
         SequencesMode(4, burn_in=2, boundary="fit", n_step=2, gamma=0.5)]


def insert_whole(buffer: EpisodicBuffer, episodes: dict[int, RefEpisode], rng: np.random.Generator,
                 first_id: int, count: int) -> None:
    lengths = rng.integers(1, 30, count)
    terminated = rng.random(count) < 0.5
    parts = [make_rows(rng, 0, int(n) + 1) for n in lengths]
    columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    ids = np.arange(first_id, first_id + count)
    buffer.insert(columns, Spans.whole_episodes(lengths, ids, terminated))
    for episode_id, part, term in zip(ids, parts, terminated, strict=True):
        episodes[int(episode_id)] = RefEpisode(int(episode_id), part["obs"], part["reward"], part["action"],
                                               complete=True, terminated=bool(term))


def insert_chunk(buffer: EpisodicBuffer, episodes: dict[int, RefEpisode], rng: np.random.Generator,
                 episode_id: int, begins: bool, ends: bool) -> None:
    episode = episodes.setdefault(episode_id, RefEpisode(episode_id, np.zeros((0, 3), np.float32),
                                                         np.zeros(0, np.float32), np.zeros(0, np.int64)))
    rows = make_rows(rng, len(episode.obs), int(rng.integers(2, 12)))
    terminated = bool(rng.random() < 0.5)
    buffer.insert(rows, Spans(np.array([episode_id], np.uint64), np.array([len(rows["t"])]), np.array([begins]),
                              np.array([ends]), np.array([terminated])))
    episode.obs = np.concatenate([episode.obs, rows["obs"]])
    episode.reward = np.concatenate([episode.reward, rows["reward"]])
    episode.action = np.concatenate([episode.action, rows["action"]])
    episode.complete, episode.terminated = ends, terminated and ends


@pytest.mark.parametrize("seed", range(3))
def test_sequences_match_the_reference_across_wraparound_eviction_and_open_episodes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    buffer = new_buffer(257)
    episodes: dict[int, RefEpisode] = {}
    next_id, open_id = 1, None
    try:
        for _ in range(50):
            if open_id is None or rng.random() < 0.5:
                insert_whole(buffer, episodes, rng, next_id, int(rng.integers(1, 4)))
                next_id += 4
            if open_id is None or open_id not in buffer.writer.open:  # a chunked episode, evicted or ended
                open_id, next_id = next_id, next_id + 1
                insert_chunk(buffer, episodes, rng, open_id, begins=True, ends=False)
            else:
                insert_chunk(buffer, episodes, rng, open_id, begins=False, ends=bool(rng.random() < 0.2))
                if episodes[open_id].complete:
                    open_id = None
            for mode in MODES:
                check_sequences(buffer, episodes, mode, rng)
        assert buffer.head > 3 * buffer.capacity
    finally:
        buffer.close()


def test_a_sequence_reaching_its_episode_end_is_padded_and_never_crosses_it() -> None:
    rng = np.random.default_rng(7)
    buffer = new_buffer(1000)
    episodes: dict[int, RefEpisode] = {}
    try:
        insert_whole(buffer, episodes, rng, 1, 30)
        batch = buffer.sample(512, SequencesMode(40), rng, include_keys=True)
        check_sequences(buffer, episodes, SequencesMode(40), rng, batch)
        lengths = batch["mask"].sum(axis=1)
        assert (lengths < 40).all()  # every episode is shorter than a sequence
        held = batch["t"][:, 1:] > 0  # rows after the first that hold an observation of the episode
        assert np.all(np.diff(batch["t"], axis=1)[held] == 1)
    finally:
        buffer.close()


def test_fit_refuses_a_request_no_stored_episode_can_serve_naming_the_longest() -> None:
    rng = np.random.default_rng(8)
    buffer = new_buffer(1000)
    episodes: dict[int, RefEpisode] = {}
    try:
        insert_whole(buffer, episodes, rng, 1, 10)
        longest = max(len(e.obs) - 1 for e in episodes.values())
        before = {name: array.copy() for name, array in buffer.storage.arrays.items()}
        with pytest.raises(FailedPrecondition, match=rf"the longest stored episode has {longest}\b"):
            buffer.sample(8, SequencesMode(longest + 1, boundary="fit"), rng)
        assert all(np.array_equal(before[name], array) for name, array in buffer.storage.arrays.items())
        batch = buffer.sample(64, SequencesMode(longest, boundary="fit"), rng, include_keys=True)
        assert batch["mask"].all()  # only the longest episode fits, from its first step
        assert (batch["t"][:, 0] == 0).all()
    finally:
        buffer.close()


@pytest.mark.parametrize(("options", "message"), [
    ({"length": 0}, "sequences.length must be an integer >= 1, got 0"),
    ({"length": 4, "burn_in": -1}, "sequences.burn_in must be an integer >= 0, got -1"),
    ({"length": 4, "period": 0}, "sequences.period must be an integer >= 1, got 0"),
    ({"length": 4, "boundary": "wrap"}, "sequences.boundary must be one of 'pad', 'fit', got 'wrap'"),
    ({"length": 4, "n_step": -1}, "sequences.n_step must be an integer in 0..1000, got -1"),
    ({"length": 2.5}, "sequences.length must be an integer >= 1, got 2.5"),
])
def test_bad_options_are_refused_naming_the_field(options: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        Sequences(**options)


def test_a_sequence_longer_than_the_ring_is_refused() -> None:
    buffer = new_buffer(50)
    try:
        with pytest.raises(InvalidArgument, match=r"burn_in \+ length = 51 rows, more than the ring holds"):
            buffer.sample(4, SequencesMode(41, burn_in=10), np.random.default_rng(0))
    finally:
        buffer.close()


def start_counts(buffer: EpisodicBuffer, mode: SequencesMode, rng: np.random.Generator) -> dict[int, int]:
    keys = np.concatenate([buffer.sample(2000, mode, rng, include_keys=True)["key"] for _ in range(20)])
    values, counts = np.unique(keys, return_counts=True)
    return dict(zip(values.tolist(), counts.tolist(), strict=True))


def allowed_starts(lengths: np.ndarray, period: int, fit_steps: int | None) -> list[int]:
    """Positions of the allowed starts of whole episodes inserted back to back from position 0."""
    starts, position = [], 0
    for length in lengths:
        for t in range(int(length)):
            if t % period == 0 and (fit_steps is None or t + fit_steps <= length):
                starts.append(position + t)
        position += int(length) + 1
    return starts


@pytest.mark.parametrize(("period", "fit_steps"), [(1, None), (3, None), (1, 6), (4, 5)])
def test_starts_are_uniform_over_the_allowed_starts(period: int, fit_steps: int | None) -> None:
    rng = np.random.default_rng(period * 10 + (fit_steps or 0))
    lengths = np.array([3, 7, 12, 20, 9])
    buffer = new_buffer(200)
    try:
        parts = [make_rows(rng, 0, int(n) + 1) for n in lengths]
        columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(5), np.ones(5, bool)))
        mode = SequencesMode(fit_steps or 4, period=period, boundary="fit" if fit_steps else "pad")
        counts = start_counts(buffer, mode, rng)
        allowed = allowed_starts(lengths, period, fit_steps)
        assert sorted(counts) == allowed
        observed = np.array([counts[s] for s in allowed])
        expected = observed.sum() / len(allowed)
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < _chi_square_critical(len(allowed) - 1), chi2
    finally:
        buffer.close()


def test_prioritized_starts_follow_the_start_steps_priorities_among_the_allowed() -> None:
    rng = np.random.default_rng(11)
    lengths = np.array([6, 15, 11])
    buffer = new_buffer(200, sampler=PrioritizedSampler(0.7))
    try:
        parts = [make_rows(rng, 0, int(n) + 1) for n in lengths]
        columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(3), np.ones(3, bool)))
        steps = np.array(allowed_starts(lengths, 1, None))
        priorities = rng.uniform(0.2, 4.0, steps.size)
        buffer.update_priorities(steps, priorities)
        mode = SequencesMode(5, period=2, boundary="fit")
        counts = start_counts(buffer, mode, rng)
        allowed = allowed_starts(lengths, 2, 5)
        assert sorted(counts) == allowed
        weight = dict(zip(steps.tolist(), (priorities ** 0.7).tolist(), strict=True))
        p = np.array([weight[s] for s in allowed])
        observed = np.array([counts[s] for s in allowed])
        expected = observed.sum() * p / p.sum()
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < _chi_square_critical(len(allowed) - 1), chi2
        batch = buffer.sample(32, mode, rng, importance_beta=1.0)
        assert batch["weight"].shape == (32,) and batch["probability"].shape == (32,)
    finally:
        buffer.close()


def test_a_lock_free_reader_reads_whole_sequences_while_the_writer_evicts() -> None:
    """A reader in this process samples the ring the writer turns over as fast as it can insert: every
    sequence it returns holds consecutive rows of one episode (a batch that raced an eviction is redrawn)."""
    rng = np.random.default_rng(12)
    buffer = new_buffer(50_000)  # a gather sees a few percent of it turned over by the writer
    episodes: dict[int, RefEpisode] = {}
    insert_whole(buffer, episodes, rng, 1, 10)
    reader = RingReader.attach(buffer.storage.header_name)
    stop = threading.Event()

    def write() -> None:
        writer_rng, next_id = np.random.default_rng(13), 100
        while not stop.is_set():
            lengths = writer_rng.integers(1, 25, 4)
            parts = [make_rows(writer_rng, 0, int(n) + 1) for n in lengths]
            for part, episode_id in zip(parts, range(next_id, next_id + 4), strict=True):
                part["obs"][:, 0] = episode_id  # the episode's id in every row
            columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
            buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(next_id, next_id + 4), np.ones(4, bool)))
            next_id += 4

    writer = threading.Thread(target=write)
    writer.start()
    try:
        mode, redrawn, deadline = SequencesMode(12, burn_in=4, n_step=2), 0, time.monotonic() + 120
        while buffer.head < 3 * buffer.capacity:  # until the writer turned the ring over twice under the reader
            assert time.monotonic() < deadline, f"the writer reached head {buffer.head} in 120 s"
            batch, torn = reader.sample_shared(32, mode, rng, include_keys=True)
            redrawn += torn
            held = (np.arange(16) <= batch["mask"].sum(axis=1)[:, None])  # rows up to the first non-step
            ids = np.where(held, batch["obs"][:, :, 0], batch["obs"][:, :1, 0])
            recent = batch["episode_id"] >= 100
            assert np.all(ids[recent] == batch["episode_id"][recent, None])  # one episode per sequence
            t = batch["t"]
            assert np.all(np.diff(t, axis=1)[held[:, 1:]] == 1)  # consecutive rows, in order
        assert redrawn > 0  # some batches raced an eviction and were drawn again
    finally:
        stop.set()
        writer.join()
        reader.close()
        buffer.close()


def test_sequences_are_the_same_over_grpc_and_from_shared_memory(client: ReplayClient) -> None:
    schema = {f.name: (f.dtype, f.shape) for f in FIELDS}
    client.create_buffer("seq", 2000, schema, observation_fields=("obs", "t"))
    rng = np.random.default_rng(14)
    episodes = []
    for _ in range(20):
        rows = make_rows(rng, 0, int(rng.integers(3, 40)))
        episodes.append({"obs": rows["obs"], "t": rows["t"], "action": rows["action"][:-1],
                         "reward": rows["reward"][:-1]})
    client.insert_episodes("seq", episodes, [True, False] * 10)
    mode = Sequences(16, burn_in=8, period=4, n_step=3, gamma=0.95)
    with LocalReader(client, "seq") as reader:
        local = reader.sample(64, mode, seed=21, include_keys=True)
    remote = client.sample("seq", 64, mode, seed=21, include_keys=True)
    assert local.keys() == remote.keys()
    for name in local:
        np.testing.assert_array_equal(local[name], remote[name], err_msg=name)
    streamed = next(iter(client.sample_stream("seq", 64, mode, num_batches=1, seed=21, include_keys=True)))
    for name in local:
        np.testing.assert_array_equal(streamed[name], remote[name], err_msg=name)


def test_sequences_over_shards_are_whole_episodes_of_one_shard() -> None:
    """The sharded client merges the shards' sequences as any other batch: (B, T, ...) rows, keys tagged with
    their shard, each sequence one episode of one shard."""
    servers = [ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}sq{i}").start() for i in range(2)]
    try:
        with ShardedReplayClient([server.address for server in servers]) as client:
            schema = {f.name: (f.dtype, f.shape) for f in FIELDS}
            client.create_buffer("seq", 4000, schema, observation_fields=("obs", "t"), sampler=Prioritized())
            rng = np.random.default_rng(15)
            episodes = []
            for episode_id in range(30):
                rows = make_rows(rng, 0, int(rng.integers(3, 40)))
                rows["obs"][:, 0] = episode_id
                episodes.append({"obs": rows["obs"], "t": rows["t"], "action": rows["action"][:-1],
                                 "reward": rows["reward"][:-1]})
            client.insert_episodes("seq", episodes, [True] * 30)
            batch = client.sample("seq", 64, Sequences(12, burn_in=4, n_step=2), include_keys=True)
            held = np.arange(16) <= batch["mask"].sum(axis=1)[:, None]
            assert np.all(np.where(held, batch["obs"][:, :, 0], batch["obs"][:, :1, 0]) == batch["obs"][:, :1, 0])
            assert np.all(np.diff(batch["t"], axis=1)[held[:, 1:]] == 1)
            assert client.update_priorities("seq", batch["key"], np.full(64, 2.0)) == (64, 0)  # each to its shard
    finally:
        for server in servers:
            server.stop()
