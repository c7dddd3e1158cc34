"""MaxTimesSampled: a step drawn k times is retired for every sampler; eviction keeps the counts right."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.modes.states import StatesMode
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.removers import MaxTimesSampledRemover
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.wire.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from tests.test_episodic_buffer import FIELDS, make_rows


def insert_episodes(buffer: EpisodicBuffer, lengths: list[int], first_id: int) -> None:
    rng = np.random.default_rng(first_id)
    parts = [make_rows(rng, 0, n + 1) for n in lengths]
    columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    ids = np.arange(first_id, first_id + len(lengths))
    buffer.insert(columns, Spans.whole_episodes(np.array(lengths), ids, np.ones(len(lengths), bool)))


@pytest.mark.parametrize("sampler", [None, PrioritizedSampler(0.5)], ids=["uniform", "prioritized"])
def test_each_step_is_drawn_at_most_k_times_then_retired(sampler) -> None:
    k = 3
    buffer = EpisodicBuffer("rm", f"test{os.getpid()}", FIELDS, 100, sampler=sampler,
                            remover=MaxTimesSampledRemover(k))
    rng = np.random.default_rng(0)
    try:
        insert_episodes(buffer, [6, 4], 0)
        drawn: list[np.ndarray] = []
        while buffer.sampleable_steps:
            drawn.append(buffer.sample(1, TransitionsMode(n_step=3), rng, include_keys=True)["key"])
        keys, counts = np.unique(np.concatenate(drawn), return_counts=True)
        assert keys.size == 10 and (counts == k).all()
        with pytest.raises(FailedPrecondition):
            buffer.sample(1, StatesMode(), rng)
        if sampler is not None:  # a retired step is stale: a new priority would make it drawable again
            assert buffer.update_priorities(keys, np.full(keys.size, 9.0)) == (0, keys.size)
            assert buffer.sampler.tree.total == 0
        insert_episodes(buffer, [40, 40], 2)  # evicts the retired episodes: counts stay consistent
        assert buffer.sampleable_steps == 80
        assert buffer.remover.counters["retired_steps"] == 10
        # One batch of every draw left: each of the 80 new steps exactly k times, within the batch too.
        keys, counts = np.unique(buffer.sample(240, StatesMode(), rng, include_keys=True)["key"], return_counts=True)
        assert keys.size == 80 and (counts == k).all() and (keys >= buffer.tail_position()).all()
        assert buffer.sampleable_steps == 0
    finally:
        buffer.close()


def test_max_times_sampled_is_validated() -> None:
    with pytest.raises(InvalidArgument, match="max_times_sampled"):
        MaxTimesSampledRemover(0)


def chunk(episode_id: int, rows: int, begins: bool, first_t: int = 0) -> tuple[dict, Spans]:
    columns = make_rows(np.random.default_rng(episode_id + first_t), first_t, rows)
    return columns, Spans(np.array([episode_id], np.uint64), np.array([rows]), np.array([begins]),
                          np.array([False]), np.array([False]))


@pytest.mark.parametrize("sampler", [None, PrioritizedSampler(0.5)], ids=["uniform", "prioritized"])
def test_retired_steps_stay_retired_when_their_open_episode_moves(sampler) -> None:
    """An open episode that outgrows its room is copied to the head: its draw counts move with it."""
    buffer = EpisodicBuffer("mv", f"test{os.getpid()}", FIELDS, 64, sampler=sampler,
                            remover=MaxTimesSampledRemover(1))
    rng = np.random.default_rng(0)
    try:
        buffer.insert(*chunk(1, 3, True))  # open episode 1: 2 steps, a room of 6 rows
        insert_episodes(buffer, [3], 2)  # a whole episode after that room
        while buffer.sampleable_steps:  # retire all 5 steps
            buffer.sample(1, StatesMode(), rng)
        buffer.insert(*chunk(1, 10, False, first_t=3))  # outgrows its room: moved to the head
        assert buffer.counters["moved_open_episodes"] == 1
        assert buffer.sampleable_steps == 10  # t = 2..11 of episode 1; t = 0, 1 were retired before the move
        t = buffer.sample(10, StatesMode(), rng)["t"]
        assert sorted(t.tolist()) == list(range(2, 12))
    finally:
        buffer.close()


def test_priorities_move_with_their_open_episode() -> None:
    buffer = EpisodicBuffer("mvp", f"test{os.getpid()}", FIELDS, 64, sampler=PrioritizedSampler(1.0))

    def key_of(t: int) -> int:  # episode 1's step t, wherever its (open) extent lies now
        return buffer.writer.open[1].start + t

    try:
        buffer.insert(*chunk(1, 3, True))  # open episode 1: steps t = 0, 1
        insert_episodes(buffer, [3], 2)
        buffer.update_priorities(np.array([key_of(0)]), np.array([50.0]))
        buffer.insert(*chunk(1, 10, False, first_t=3))  # moved to the head
        assert buffer.counters["moved_open_episodes"] == 1
        leaves = buffer.sampler.tree.get(np.array([key_of(0), key_of(1)]) % 64)
        np.testing.assert_array_equal(leaves, [50.0, 1.0])  # not reset to the max priority (50) or lost
    finally:
        buffer.close()


@pytest.mark.parametrize("sampler", [None, PrioritizedSampler(0.5)], ids=["uniform", "prioritized"])
def test_a_batch_holds_a_step_at_most_its_draws_left(sampler) -> None:
    """Draws are counted as a batch is drawn (as Reverb retires an item within a batch): with k = 1 a batch
    never repeats a step, and a batch larger than the draws left is refused with every count and priority
    as it was."""
    buffer = EpisodicBuffer("quota", f"test{os.getpid()}", FIELDS, 100, sampler=sampler,
                            remover=MaxTimesSampledRemover(1))
    rng = np.random.default_rng(0)
    try:
        insert_episodes(buffer, [10], 0)
        first = buffer.sample(8, StatesMode(), rng, include_keys=True)["key"]
        assert np.unique(first).size == 8 and buffer.sampleable_steps == 2
        before = {name: array.copy() for name, array in buffer.storage.arrays.items()}
        with pytest.raises(FailedPrecondition, match="fewer draws left than batch_size=8"):
            buffer.sample(8, StatesMode(), rng)
        for name, array in buffer.storage.arrays.items():
            np.testing.assert_array_equal(array, before[name], err_msg=name)
        assert buffer.remover.counters["retired_steps"] == 8
        rest = buffer.sample(2, StatesMode(), rng, include_keys=True)["key"]
        assert sorted(np.concatenate([first, rest]).tolist()) == list(range(10))
    finally:
        buffer.close()


def test_draws_left_hold_across_random_batches() -> None:
    k = 2
    buffer = EpisodicBuffer("quota2", f"test{os.getpid()}", FIELDS, 1000, remover=MaxTimesSampledRemover(k))
    rng = np.random.default_rng(1)
    try:
        insert_episodes(buffer, [30, 7, 12], 0)
        drawn = []
        while buffer.sampleable_steps:
            size = int(rng.integers(1, 9))
            try:
                drawn.append(buffer.sample(size, StatesMode(), rng, include_keys=True)["key"])
            except FailedPrecondition:
                drawn.append(buffer.sample(1, StatesMode(), rng, include_keys=True)["key"])
        keys, counts = np.unique(np.concatenate(drawn), return_counts=True)
        assert keys.size == 49 and (counts == k).all()
    finally:
        buffer.close()


def test_a_waiting_sample_waits_for_draws_left() -> None:
    """A sample that may wait, short of draws left, waits for an insert instead of failing."""
    import threading

    buffer = EpisodicBuffer("quota3", f"test{os.getpid()}", FIELDS, 100, remover=MaxTimesSampledRemover(1))
    rng = np.random.default_rng(2)
    try:
        insert_episodes(buffer, [4], 0)
        result: list[np.ndarray] = []
        waiter = threading.Thread(target=lambda: result.append(
            buffer.sample(6, StatesMode(), rng, include_keys=True, wait_seconds=30)["key"]))
        waiter.start()
        deadline = time.monotonic() + 10
        while buffer.worker_seats.taken["waits"] == 0:  # until the sample waits (in a wait seat)
            assert time.monotonic() < deadline, "the sample did not wait"
            time.sleep(0.001)
        insert_episodes(buffer, [5], 1)
        waiter.join(30)
        assert not waiter.is_alive() and np.unique(result[0]).size == 6
        with pytest.raises(DeadlineExceeded, match="fewer draws left than batch_size=6"):
            buffer.sample(6, StatesMode(), rng, wait_seconds=0.05)
    finally:
        buffer.close()
