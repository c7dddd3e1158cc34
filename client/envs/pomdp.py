"""CartPole as a POMDP: the observation keeps the cart position and the pole angle and hides both
velocities, so a policy must infer them from the history (a memoryless one sees no direction of motion)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["CARTPOLE_KEPT", "HideVelocities", "make_cartpole_pomdp"]

CARTPOLE_KEPT = (0, 2)  # cart position, pole angle (1 and 3 are their velocities)


class HideVelocities(gym.ObservationWrapper):
    """Keeps the entries `kept` of a Box observation (CartPole's position and angle by default)."""

    def __init__(self, env: gym.Env, kept: Sequence[int] = CARTPOLE_KEPT) -> None:
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, spaces.Box) or len(space.shape) != 1:
            raise ValueError(f"HideVelocities: expected a 1-D Box observation space, got {space}")
        if not kept or any(not 0 <= i < space.shape[0] for i in kept):
            raise ValueError(f"HideVelocities: kept must name entries in 0..{space.shape[0] - 1}, got {list(kept)}")
        self.kept = np.asarray(kept)
        self.observation_space = spaces.Box(space.low[self.kept], space.high[self.kept], dtype=space.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self.kept]


def make_cartpole_pomdp(**kwargs: Any) -> gym.Env:
    """CartPole-v1 (500-step time limit) seeing position and angle only; gymnasium's entry point of
    ``replayd/CartPolePOMDP-v1``."""
    return HideVelocities(gym.make("CartPole-v1", **kwargs))
