"""Lock-free readers (LocalReader, sample workers) against a writer that moves, closes and evicts episodes.

A reader process samples the ring's shared memory without the writer's lock while the writer inserts
interleaved chunks of many open episodes into a small ring: open episodes move to the head (their old
rows turn into holes), close, and are evicted. Every row's data names its episode and step, so each
sampled item is checked against the episode it claims: its id, successor, n-step return, bootstrap
discount (0 only through a termination) and, for prioritized buffers, a finite importance weight.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from replayd.server import kernels
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.buffers.reader import RingReader
from replayd.server.buffers.ring import EpisodicRing
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.server.schema import Field
from replayd.wire.errors import FailedPrecondition, RingChanged
from tests.conftest import TEST_INSTANCE

FIELDS = [Field("obs", "float64", (3,), observation=True), Field("reward", "float64")]
GAMMA, N_STEP, BATCH = 0.9, 4, 64
OPEN_EPISODES, CAPACITY = 12, 400
SECONDS = 3.0


def length_of(episode: int) -> int:
    return 3 + (episode * 7919) % 60


def reward_of(episode: int, t: np.ndarray) -> np.ndarray:
    return np.sin(episode * 1.7 + np.asarray(t) * 0.3)


def terminated_of(episode: int) -> bool:
    return episode % 3 != 0


def episode_rows(episode: int, lo: int, hi: int) -> dict[str, np.ndarray]:
    """Rows [lo, hi) of an episode: obs = (episode, t, checksum); row L is the final observation."""
    t = np.arange(lo, hi, dtype=np.float64)
    obs = np.stack([np.full(hi - lo, episode, np.float64), t, np.cos(episode * 0.37 + t * 1.3)], axis=1)
    return {"obs": obs, "reward": np.where(t < length_of(episode), reward_of(episode, t), 0.0)}


def wrong_items(batch: dict[str, np.ndarray]) -> list[str]:
    wrong = []
    for i in range(len(batch["obs"])):
        episode, t = int(batch["obs"][i, 0]), int(batch["obs"][i, 1])
        boot_t = int(batch["bootstrap_obs"][i, 1])
        length = length_of(episode)
        steps = np.arange(t, boot_t)
        expected_discount = 0.0 if boot_t == length and terminated_of(episode) else GAMMA ** (boot_t - t)
        checks = {
            "episode_id": int(batch["episode_id"][i]) == episode,
            "next_obs": tuple(batch["next_obs"][i, :2]) == (episode, t + 1),
            "bootstrap_obs": int(batch["bootstrap_obs"][i, 0]) == episode and 1 <= boot_t - t <= N_STEP
            and boot_t <= length,
            "n_step_return": abs(batch["n_step_return"][i] - np.sum(GAMMA ** (steps - t) * reward_of(episode, steps)))
            < 1e-4,
            "bootstrap_discount": abs(batch["bootstrap_discount"][i] - expected_discount) < 1e-5,
            # w = (p_i / p_min)^-beta is in (0, 1], also when a priority changed while the batch was read
            "weight": "weight" not in batch or bool(0 < batch["weight"][i] <= 1 and batch["probability"][i] > 0),
        }
        wrong += [f"{name}: episode {episode} t={t} (L={length})" for name, ok in checks.items() if not ok]
    return wrong


def read(header_name: str, seconds: float, results: multiprocessing.Queue) -> None:
    """The reader process: samples without the lock until `seconds` pass; reports (items, wrong, error)."""
    ring = RingReader.attach(header_name)
    rng = np.random.default_rng(os.getpid())
    mode = TransitionsMode(N_STEP, GAMMA)
    items, wrong, error = 0, [], None
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                batch, _ = ring.sample_shared(BATCH, mode, rng, include_keys=True, importance_beta=0.5)
            except FailedPrecondition as exc:
                if "no sampleable step" in str(exc):  # a moment with every episode still in its first chunk
                    continue
                # This writer turns the tiny ring over in microseconds; a reader the scheduler sets aside
                # (2 busy cores) can lose a hundred draws in a row. That is liveness, not a torn batch:
                # `items` below still requires the reader to get through.
                if "raced with the writer" in str(exc):
                    continue
                raise
            items += BATCH
            wrong += wrong_items(batch)
    except Exception as exc:  # reported to the test, which fails on it
        error = repr(exc)
    finally:
        ring.close()
    results.put((items, wrong[:10], len(wrong), error))


def write(buffer: EpisodicBuffer, stop: threading.Event, prioritized: bool) -> None:
    """Chunks of 1-5 rows of OPEN_EPISODES interleaved episodes, each closed by its last chunk."""
    rng = np.random.default_rng(1)
    next_episode = 1
    sent = {}  # episode -> rows sent
    for _ in range(OPEN_EPISODES):
        sent[next_episode] = 0
        next_episode += 1
    while not stop.is_set():
        episode = int(rng.choice(list(sent)))
        rows = length_of(episode) + 1
        k = min(int(rng.integers(2 if sent[episode] == 0 else 1, 6)), rows - sent[episode])
        ends = sent[episode] + k == rows
        spans = Spans(np.array([episode], np.uint64), np.array([k]), np.array([sent[episode] == 0]),
                      np.array([ends]), np.array([ends and terminated_of(episode)]), np.array([sent[episode]]))
        try:
            buffer.insert(episode_rows(episode, sent[episode], sent[episode] + k), spans)
            sent[episode] += k
        except FailedPrecondition:  # evicted while open: start another
            ends = True
        if ends:
            del sent[episode]
            sent[next_episode] = 0
            next_episode += 1
        if prioritized and rng.random() < 0.15:
            batch = buffer.sample(16, TransitionsMode(1, GAMMA), rng, include_keys=True)
            buffer.update_priorities(batch["key"], rng.uniform(0.01, 10, 16))


@pytest.mark.parametrize("prioritized", [False, True])
def test_lock_free_samples_are_whole_while_episodes_move_close_and_evict(prioritized: bool) -> None:
    sampler = PrioritizedSampler(0.6) if prioritized else None
    buffer = EpisodicBuffer("race", f"{TEST_INSTANCE}race", FIELDS, CAPACITY, sampler=sampler)
    stop = threading.Event()
    writer = threading.Thread(target=write, args=(buffer, stop, prioritized))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    reader = context.Process(target=read, args=(buffer.storage.header_name, SECONDS, results))
    try:
        first = length_of(100_000)
        buffer.insert(episode_rows(100_000, 0, first + 1),
                      Spans.whole_episodes(np.array([first]), np.array([100_000]), np.array([True])))
        writer.start()
        reader.start()
        items, examples, wrong, error = results.get(timeout=SECONDS + 120)
    finally:
        stop.set()
        reader.join(timeout=30)
        if reader.is_alive():
            reader.kill()
        if writer.is_alive():
            writer.join()
        counters = buffer.counters
        buffer.close()
    assert error is None
    assert counters["moved_open_episodes"] > 100 and counters["evicted_episodes"] > 100  # the races happened
    assert items > 10_000
    assert wrong == 0, examples


@pytest.fixture
def attached_ring() -> Iterator[RingReader]:
    """A lock-free reader's ring over a buffer holding one closed episode."""
    buffer = EpisodicBuffer("one", f"{TEST_INSTANCE}one", FIELDS, CAPACITY)
    ring = None
    try:
        length = length_of(5)
        buffer.insert(episode_rows(5, 0, length + 1),
                      Spans.whole_episodes(np.array([length]), np.array([5]), np.array([True])))
        ring = RingReader.attach(buffer.storage.header_name)
        yield ring
    finally:
        if ring is not None:
            ring.close()
        buffer.close()


def test_a_reader_reads_the_tail_after_the_bounds(attached_ring: RingReader, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check of a batch re-reads its rows' bounds first and the tail last: a row evicted and reused
    between the two reads then shows in the tail (read the other way round, it would pass both)."""
    reads = []
    bounds_kept, tail_position = kernels.bounds_kept, EpisodicRing.tail_position
    monkeypatch.setattr(kernels, "bounds_kept", lambda *args: reads.append("bounds") or bounds_kept(*args))
    monkeypatch.setattr(EpisodicRing, "tail_position", lambda self: reads.append("tail") or tail_position(self))
    attached_ring.sample_shared(8, TransitionsMode(N_STEP, GAMMA), np.random.default_rng(0))
    assert reads[-2:] == ["bounds", "tail"]


def test_a_draw_that_finds_its_range_emptied_is_drawn_again(attached_ring: RingReader,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Evictions can empty the range a lock-free reader read: the uniform draw then finds no step, and the
    reader draws again instead of failing (under the writer's lock this cannot happen)."""
    draw, raised = attached_ring.sampler.draw, []

    def emptied_once(*args: object) -> object:
        if not raised:
            raised.append(True)
            raise RingChanged("no sampleable step in the range the draw read")
        return draw(*args)

    monkeypatch.setattr(attached_ring.sampler, "draw", emptied_once)
    batch, torn = attached_ring.sample_shared(8, TransitionsMode(N_STEP, GAMMA), np.random.default_rng(0))
    assert torn == 1 and batch["obs"].shape == (8, 3)


def test_a_lock_free_reader_is_refused_off_x86(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its validation takes x86's memory ordering: elsewhere attaching fails, naming the host, and maps nothing."""
    buffer = EpisodicBuffer("arm", f"{TEST_INSTANCE}arm", FIELDS, 64)
    try:
        monkeypatch.setattr("platform.machine", lambda: "aarch64")
        with pytest.raises(FailedPrecondition, match=r"lock-free readers need an x86-64 host .* 'aarch64'"):
            RingReader.attach(buffer.storage.header_name)
    finally:
        buffer.close()
