"""Hindsight relabeling on the client: a `Hindsight` batch's relabeled goals come from the server, the rewards
(and terminations) they imply are recomputed here, since the server never runs user code.

Each function returns a `prepare` callable for `Loader(..., prepare=...)`, which runs it on every numpy batch
in the loader's thread. The callables follow gymnasium-robotics' goal-env signature, vectorized over the
batch: `compute_reward(achieved_goal, desired_goal, info)` (info is None here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # replayd.client.loader imports torch; this module needs numpy alone
    from replayd.client.loader import Prepare

__all__ = ["GoalFunction", "recompute_rewards", "recompute_terminations"]

GoalFunction = Callable[[np.ndarray, np.ndarray, None], np.ndarray]


def recompute_rewards(compute_reward: GoalFunction, achieved: str = "achieved_goal", desired: str = "desired_goal",
                      reward: str = "reward") -> Prepare:
    """A prepare function setting `batch[reward] = compute_reward(batch["next_" + achieved], batch[desired], None)`
    in the stored reward's dtype: the reward of reaching the transition's next state under its (relabeled) goal."""
    return _recompute(compute_reward, "compute_reward", achieved, desired, reward)


def recompute_terminations(compute_terminated: GoalFunction, achieved: str = "achieved_goal",
                           desired: str = "desired_goal", terminated: str = "terminated") -> Prepare:
    """A prepare function setting `batch[terminated] = compute_terminated(batch["next_" + achieved],
    batch[desired], None)`: for tasks that end on success, a transition reaching its relabeled goal ends the
    episode it is relabeled into (no bootstrap past it), whatever the stored episode did next."""
    return _recompute(compute_terminated, "compute_terminated", achieved, desired, terminated)


def _recompute(function: GoalFunction, function_name: str, achieved: str, desired: str, field: str) -> Prepare:
    def prepare(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        stored = batch[field]
        values = np.asarray(function(batch["next_" + achieved], batch[desired], None))
        if values.shape != stored.shape:
            raise ValueError(f"{function_name} for batch[{field!r}]: expected shape {stored.shape} (one value per "
                             f"transition), got {values.shape}")
        # A new array: decoded server batches are read-only views of the received message.
        return {**batch, field: values.astype(stored.dtype)}

    return prepare
