"""DQN with hindsight experience replay (Andrychowicz et al. 2017) on replayd `Hindsight` batches.

The Q-network is goal-conditioned: its input is the observation and the desired goal side by side, so
``DQNTrainer`` trains it unchanged (``q_loss``, 1-step targets). ``her_prepare`` turns each numpy
`Hindsight` batch into the fields ``q_loss`` reads, in the loader's thread:

* ``n_step_return`` = the reward of reaching the next state under the transition's (maybe relabeled) goal,
  recomputed by the env's ``compute_reward`` (the server stores only the reward of the episode's own goal);
* ``bootstrap_discount`` = gamma * (1 - terminated), terminated recomputed by ``compute_terminated``: a task
  that ends on success ends where a relabeled goal is reached, whatever the stored episode did next;
* ``obs`` = [observation_t, goal], ``bootstrap_obs`` = [observation_{t+1}, goal];
* ``action``, and ``weight`` / ``key`` when the batch has them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from replayd.client.hindsight import GoalFunction, recompute_rewards, recompute_terminations
from replayd.client.loader import Prepare

__all__ = ["goal_input", "her_prepare", "q_learning_fields"]

KEPT = ("action", "weight", "key")  # fields passed through when present


def goal_input(observation: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """The goal-conditioned network's input (..., obs + goal) float32: observation and goal side by side."""
    return np.concatenate([observation, goal], axis=-1).astype(np.float32)


def q_learning_fields(gamma: float, observation: str = "observation", desired: str = "desired_goal") -> Prepare:
    """A prepare function from a `Hindsight` batch whose rewards and terminations fit its goals to the
    1-step fields of ``q_loss`` (see the module's docstring)."""
    def prepare(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        goal = batch[desired]  # (B, G)
        return {"obs": goal_input(batch[observation], goal),  # (B, S + G)
                "bootstrap_obs": goal_input(batch["next_" + observation], goal),  # (B, S + G)
                "n_step_return": batch["reward"].astype(np.float32),  # (B,)
                "bootstrap_discount": np.where(batch["terminated"], 0.0, gamma).astype(np.float32),  # (B,)
                **{name: batch[name] for name in KEPT if name in batch}}

    return prepare


def her_prepare(compute_reward: GoalFunction, compute_terminated: GoalFunction, gamma: float,
                achieved: str = "achieved_goal", desired: str = "desired_goal",
                observation: str = "observation") -> Prepare:
    """Rewards, then terminations, recomputed for the batch's goals, then ``q_learning_fields``."""
    steps: tuple[Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], ...] = (
        recompute_rewards(compute_reward, achieved, desired),
        recompute_terminations(compute_terminated, achieved, desired),
        q_learning_fields(gamma, observation, desired))

    def prepare(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for step in steps:
            batch = step(batch)
        return batch

    return prepare
