"""MaxTimesSampled: a step drawn k times is retired for every sampler; eviction keeps the counts right."""

from __future__ import annotations

import os

import numpy as np
import pytest

from service.buffers.episodic import EpisodicBuffer, Spans
from service.errors import FailedPrecondition, InvalidArgument
from service.removers import MaxTimesSampledRemover
from service.samplers.prioritized import PrioritizedSampler
from service.samplers.states import StatesMode
from service.samplers.transitions import TransitionsMode
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
        insert_episodes(buffer, [40, 40], 2)  # evicts the retired episodes: counts stay consistent
        assert buffer.sampleable_steps == 80
        assert buffer.remover.counters["retired_steps"] == 10
        keys = buffer.sample(2000, StatesMode(), rng, include_keys=True)["key"]
        assert (keys >= buffer.tail_position()).all()
    finally:
        buffer.close()


def test_max_times_sampled_is_validated() -> None:
    with pytest.raises(InvalidArgument, match="max_times_sampled"):
        MaxTimesSampledRemover(0)
