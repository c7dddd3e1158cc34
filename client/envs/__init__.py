"""Environments of the sequence-replay and hindsight demos, registered with gymnasium on import (`make` is
gymnasium's, with them registered: actors and learners make every env through it):

* ``replayd/CartPolePOMDP-v1``: CartPole-v1 with the velocities hidden (client/envs/pomdp.py);
* ``replayd/BitFlipping-v0``: the HER paper's bit-flipping task, 15 bits (client/envs/bit_flipping.py).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from replayd.client.envs.bit_flipping import BitFlippingEnv
from replayd.client.envs.pomdp import HideVelocities, make_cartpole_pomdp

__all__ = ["BIT_FLIPPING", "CARTPOLE_POMDP", "BitFlippingEnv", "HideVelocities", "make", "make_cartpole_pomdp"]

CARTPOLE_POMDP = "replayd/CartPolePOMDP-v1"
BIT_FLIPPING = "replayd/BitFlipping-v0"

if CARTPOLE_POMDP not in gym.registry:
    gym.register(CARTPOLE_POMDP, entry_point=make_cartpole_pomdp)
if BIT_FLIPPING not in gym.registry:
    gym.register(BIT_FLIPPING, entry_point=BitFlippingEnv, kwargs={"n_bits": 15})


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """gymnasium.make, for gymnasium's environments and the ones registered here."""
    return gym.make(env_id, **kwargs)
