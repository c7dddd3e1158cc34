"""What every learner shares: the environment steps it reports and its greedy evaluation."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch

from client import ReplayClient
from client.learners.common import env_steps, evaluate_greedy

SCHEMA = {"obs": ("float32", (2,)), "action": ("int64", ())}


def test_env_steps_are_the_inserted_rows_less_each_ended_episodes_final_observation(client: ReplayClient) -> None:
    client.create_buffer("b", 1000, SCHEMA)
    for length in (10, 5):
        client.insert_episode("b", terminated=True, obs=np.zeros((length + 1, 2), np.float32),
                              action=np.zeros(length, np.int64))
    assert env_steps(client.describe("b")) == 15
    assert env_steps({"counters": {"inserted_rows": 40.0, "inserted_episodes": 3.0}}) == 37
    assert env_steps({"counters": {}}) == 0  # a buffer nothing was inserted into


class _CountdownEnv:
    """Ends after `seed % 5 + 1` steps with a reward of 1 each: the return tells which seed it was reset with."""

    def __init__(self, resets: list[int | None]) -> None:
        self.resets = resets

    def reset(self, seed: int | None = None):
        self.resets.append(seed)
        self.left = (seed or 0) % 5 + 1
        return np.zeros(2, np.float32), {}

    def step(self, action: int):
        self.left -= 1
        return np.zeros(2, np.float32), 1.0, self.left == 0, False, {}


def test_greedy_evaluation_resets_episode_i_with_seed_plus_i(monkeypatch: pytest.MonkeyPatch) -> None:
    resets: list[int | None] = []
    monkeypatch.setattr(gymnasium, "make", lambda env_id: _CountdownEnv(resets))
    score = evaluate_greedy(lambda obs: torch.zeros(len(obs), dtype=torch.int64), "Countdown-v0", 4, seed=12)
    assert resets == [12, 13, 14, 15]
    assert score == pytest.approx(np.mean([3, 4, 5, 1]))  # seeds 12..15: 3, 4, 5 and 1 steps
