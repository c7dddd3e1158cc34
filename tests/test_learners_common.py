"""What every learner shares: the environment steps it reports and its greedy evaluation."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch

from replayd.client import ReplayClient
from replayd.client.learner import main as learner_main
from replayd.client.learners.common import BufferMismatch, create_or_reuse, env_steps, evaluate_greedy
from replayd.client.learners.dqn import CARTPOLE_SCHEMA

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


def test_a_learner_reuses_its_buffer_left_alike_and_names_what_differs_otherwise(client: ReplayClient) -> None:
    """A learner started again on the same server goes on with the buffer an earlier one made (creating it
    again failed: FAILED_PRECONDITION, a traceback)."""
    def create() -> object:
        return client.create_buffer("cartpole", 1000, CARTPOLE_SCHEMA)

    assert create_or_reuse(client, "cartpole", create, "episodic", 1000, CARTPOLE_SCHEMA) is False
    assert create_or_reuse(client, "cartpole", create, "episodic", 1000, CARTPOLE_SCHEMA) is True
    with pytest.raises(BufferMismatch, match=r"buffer 'cartpole' already exists on the server with capacity 1000 "
                                             r"steps \(needs 2000\), field 'obs' float32\[4\] \(needs float64\[4\]\)"):
        create_or_reuse(client, "cartpole", lambda: client.create_buffer("cartpole", 2000, CARTPOLE_SCHEMA),
                        "episodic", 2000, {**CARTPOLE_SCHEMA, "obs": ("float64", (4,))})
    with pytest.raises(BufferMismatch, match=r"kind episodic \(needs rollout\), capacity 1000 steps \(needs 8\), "
                                             r"no field 'log_prob'"):
        create_or_reuse(client, "cartpole", create, "rollout", 8, {"log_prob": ("float32", ())})


def test_a_learner_refused_its_buffer_exits_with_one_line_and_stops_its_actors(
        client: ReplayClient, capsys: pytest.CaptureFixture) -> None:
    """It publishes its first weights before the buffer (actors wait for the buffer, then fetch them): a
    learner that cannot go on publishes them final, or its actors would collect for nobody until their
    --seconds ran out."""
    client.create_buffer("cartpole", 500, CARTPOLE_SCHEMA)  # e.g. the client guide's learner example, another size
    with pytest.raises(SystemExit) as info:
        learner_main(["--algo", "dqn", "--address", client.address, "--seconds", "5"], prog="replayd learn")
    assert info.value.code == 1
    assert capsys.readouterr().err == ("replayd learn: buffer 'cartpole' already exists on the server with capacity "
                                       "500 steps (needs 100000): delete it (ReplayClient.delete_buffer) or restart "
                                       "the server\n")
    assert client.fetch_weights("q", newer_than=0).final

