"""The bit-flipping task of the HER paper (Andrychowicz et al. 2017, section 3.1) as a gymnasium goal env.

State and goal are n bits; action i flips bit i. The reward is -1 until the state equals the goal and 0 on
the step that reaches it, which also ends the episode (terminated); an episode is truncated after n steps
(enough to reach any goal). Observations follow gymnasium-robotics' goal envs: a Dict of `observation`,
`achieved_goal` (the state) and `desired_goal`, with vectorized `compute_reward` and `compute_terminated`
of their signature, which hindsight relabeling calls on relabeled goals.
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["BitFlippingEnv"]


class BitFlippingEnv(gym.Env):
    """n-bit flipping (default 15). Reset draws a uniform state and a uniform goal different from it."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(self, n_bits: int = 15, max_episode_steps: int | None = None) -> None:
        if n_bits < 1:
            raise ValueError(f"n_bits must be >= 1, got {n_bits}")
        self.n_bits = n_bits
        self.max_episode_steps = n_bits if max_episode_steps is None else max_episode_steps
        if self.max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {self.max_episode_steps}")
        bits = spaces.MultiBinary(n_bits)
        self.observation_space = spaces.Dict({"observation": bits, "achieved_goal": bits, "desired_goal": bits})
        self.action_space = spaces.Discrete(n_bits)
        self.state = np.zeros(n_bits, np.int8)
        self.goal = np.zeros(n_bits, np.int8)
        self.steps = 0

    def _observation(self) -> dict[str, np.ndarray]:
        return {"observation": self.state.copy(), "achieved_goal": self.state.copy(),
                "desired_goal": self.goal.copy()}

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        self.state = self.np_random.integers(0, 2, self.n_bits, dtype=np.int8)
        self.goal = self.state
        while np.array_equal(self.goal, self.state):  # an episode solved at reset has no step to learn from
            self.goal = self.np_random.integers(0, 2, self.n_bits, dtype=np.int8)
        self.steps = 0
        return self._observation(), {"is_success": False}

    def step(self, action: int) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        if not self.action_space.contains(action):
            raise ValueError(f"action: expected an integer in 0..{self.n_bits - 1}, got {action!r}")
        self.state = self.state.copy()
        self.state[action] ^= 1
        self.steps += 1
        success = bool(self.compute_terminated(self.state, self.goal, None))
        reward = float(self.compute_reward(self.state, self.goal, None))
        truncated = not success and self.steps >= self.max_episode_steps
        return self._observation(), reward, success, truncated, {"is_success": success}

    @staticmethod
    def compute_reward(achieved_goal: np.ndarray, desired_goal: np.ndarray, info: Any) -> np.ndarray:
        """0 where the achieved goal equals the desired one, else -1; over the last axis (any leading shape)."""
        differs = np.any(np.asarray(achieved_goal) != np.asarray(desired_goal), axis=-1)
        return np.where(differs, np.float32(-1), np.float32(0))

    @staticmethod
    def compute_terminated(achieved_goal: np.ndarray, desired_goal: np.ndarray, info: Any) -> np.ndarray:
        """Success (the episode ends): the achieved goal equals the desired one, over the last axis."""
        return np.all(np.asarray(achieved_goal) == np.asarray(desired_goal), axis=-1)
