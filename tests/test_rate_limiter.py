"""Rate limiter: min size, the samples-per-insert band under concurrent inserters and samplers, deadlines."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from service.buffers.episodic import EpisodicBuffer, Spans
from service.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from service.limiters import RateLimiter
from service.samplers.states import StatesMode
from tests.test_episodic_buffer import FIELDS, make_rows


def new_buffer(limiter: RateLimiter, capacity: int = 10_000) -> EpisodicBuffer:
    return EpisodicBuffer("rl", f"test{os.getpid()}", FIELDS, capacity, limiter=limiter)


def insert_episode(buffer: EpisodicBuffer, steps: int, episode_id: int, timeout: float | None = None) -> None:
    buffer.insert(make_rows(np.random.default_rng(episode_id), 0, steps + 1),
                  Spans.whole_episodes(np.array([steps]), np.array([episode_id]), np.ones(1, bool)), timeout=timeout)


def test_min_size_blocks_sampling_until_reached() -> None:
    buffer = new_buffer(RateLimiter(min_size_to_sample=10))
    try:
        insert_episode(buffer, 5, 0)
        with pytest.raises(FailedPrecondition, match="min_size_to_sample=10"):
            buffer.sample(1, StatesMode())
        with pytest.raises(DeadlineExceeded):
            buffer.sample(1, StatesMode(), wait_seconds=0.05)
        insert_episode(buffer, 5, 1)
        assert len(buffer.sample(4, StatesMode())["obs"]) == 4
    finally:
        buffer.close()


def test_ratio_band_blocks_each_side_and_deadlines_end_blocked_calls() -> None:
    limiter = RateLimiter(min_size_to_sample=4, samples_per_insert=2.0, error_buffer=8.0)
    buffer = new_buffer(limiter)
    try:
        insert_episode(buffer, 4, 0)  # 4 items: diff = 8 = the band's center
        with pytest.raises(DeadlineExceeded, match="insert"):  # diff + 2 > max_diff = 16 after 4 more
            insert_episode(buffer, 4, 1)
            insert_episode(buffer, 4, 2, timeout=0.05)
        assert limiter.inserts == 8 and limiter.insert_waits == 1
        buffer.sample(8, StatesMode())
        buffer.sample(8, StatesMode())  # diff 16 -> 0 = min_diff
        with pytest.raises(FailedPrecondition, match="inserts are behind"):
            buffer.sample(1, StatesMode())
        with pytest.raises(DeadlineExceeded):
            buffer.sample(1, StatesMode(), wait_seconds=0.05)
        with pytest.raises(InvalidArgument, match="batch_size=15"):
            buffer.sample(15, StatesMode(), wait_seconds=1.0)
        assert limiter.sample_waits == 1
    finally:
        buffer.close()


def test_concurrent_inserters_and_samplers_stay_in_the_band() -> None:
    spi, error_buffer, min_size = 4.0, 40.0, 20
    limiter = RateLimiter(min_size, spi, error_buffer)
    buffer = new_buffer(limiter, capacity=100_000)
    observed: list[float] = []
    errors: list[BaseException] = []

    def actor(first_id: int) -> None:
        try:
            for i in range(60):
                insert_episode(buffer, 5, first_id + i, timeout=10.0)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def learner() -> None:
        try:
            for _ in range(145):  # 2 x 145 x 8 samples: enough to admit the last insert, within the band
                buffer.sample(8, StatesMode(), wait_seconds=10.0)
                observed.append(limiter.diff)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=actor, args=(k * 1000,)) for k in range(2)]
    threads += [threading.Thread(target=learner) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    try:
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert limiter.inserts == 2 * 60 * 5
        assert min(observed) >= limiter.min_diff  # samples never ran ahead of the ratio
        assert limiter.insert_waits > 0 and limiter.sample_waits > 0
    finally:
        buffer.close()


def test_config_is_validated() -> None:
    with pytest.raises(InvalidArgument, match="error_buffer"):
        RateLimiter(1, samples_per_insert=4.0, error_buffer=1.0)
    with pytest.raises(InvalidArgument, match="samples_per_insert"):
        RateLimiter(1, samples_per_insert=-1.0)
