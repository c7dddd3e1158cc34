"""ElegantRL's `ReplayBufferList`, the on-policy rollout storage, re-implemented as written for comparison.

Actors' trajectories are appended to a list; every update (`update_buffer`) transposes it (one list per item) and
concatenates each item along dim 0 into a batch list that is cleared and refilled, so every update
allocates a whole new rollout while the previous one and the actors' parts are still alive.
"""

from __future__ import annotations

import torch


class ListRolloutStore:
    def __init__(self) -> None:
        self.traj_list: list[tuple[torch.Tensor, ...]] = []
        self.batch: list[torch.Tensor] = []

    def add(self, trajectory: tuple[torch.Tensor, ...]) -> None:
        self.traj_list.append(trajectory)

    def update(self) -> list[torch.Tensor]:
        cur_items = list(map(list, zip(*self.traj_list, strict=True)))
        self.batch.clear()
        self.batch.extend([torch.cat(item, dim=0) for item in cur_items])
        self.traj_list.clear()
        return self.batch
