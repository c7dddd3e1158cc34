"""Transitions with n-step returns, bounded by each episode's precomputed final row."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from service.errors import InvalidArgument
from service.samplers.draw import Draw

if TYPE_CHECKING:
    from service.buffers.episodic import EpisodicBuffer

MAX_N_STEP = 1000


class TransitionsMode:
    """obs, step fields, next_obs, 1-step terminated/truncated, and n-step targets.

    n_eff = min(n, steps left to the episode's bound). `n_step_return` = sum_{k<n_eff} gamma^k r_{t+k};
    `bootstrap_discount` = gamma^n_eff, or 0 when the episode terminated at t + n_eff (truncation keeps
    bootstrapping); `bootstrap_<obs>` = the observation at t + n_eff (the same array as next_<obs>
    when n = 1, sent once on the wire).
    """

    def __init__(self, n_step: int = 1, gamma: float = 0.99) -> None:
        if not 1 <= n_step <= MAX_N_STEP:
            raise InvalidArgument(f"transitions.n_step must be in 1..{MAX_N_STEP}, got {n_step}")
        if not 0.0 <= gamma <= 1.0:
            raise InvalidArgument(f"transitions.gamma must be in [0, 1], got {gamma}")
        self.n_step = int(n_step)
        self.gamma = float(gamma)
        self._offsets = np.arange(self.n_step)  # (n,)
        self._powers = self.gamma ** np.arange(self.n_step + 1)  # (n + 1,): gamma^0 .. gamma^n

    def build(self, ring: EpisodicBuffer, draw: Draw, rng: np.random.Generator) -> dict[str, np.ndarray]:
        positions, rows, bounds = draw.positions, draw.rows, draw.bounds
        capacity, columns, n = ring.capacity, ring.columns, self.n_step
        next_positions = positions + 1
        next_rows = next_positions % capacity
        batch = {f.name: columns[f.name].take(rows, axis=0) for f in ring.observation_fields}
        batch.update({f.name: columns[f.name].take(rows, axis=0) for f in ring.step_fields})
        batch.update({f"next_{f.name}": columns[f.name].take(next_rows, axis=0) for f in ring.observation_fields})

        n_eff = np.minimum(n, bounds - positions) if n > 1 else 1
        # Only a window that reaches a closed episode's final row can see its termination.
        at_end = (bounds == positions + n_eff if n > 1 else bounds == next_positions) & draw.closed
        ends = np.count_nonzero(at_end)
        episode_terminated = np.zeros(len(rows), dtype=bool)
        if ends:
            episode_terminated[at_end] = ring.terminated_at(rows[at_end])
        if n == 1:
            batch["terminated"] = episode_terminated
            batch["truncated"] = at_end ^ episode_terminated if ends else episode_terminated
        else:
            last_step = bounds == next_positions
            batch["terminated"] = episode_terminated & last_step
            batch["truncated"] = (at_end & last_step) ^ batch["terminated"]

        if ring.reward_field is None:
            if n > 1:
                raise InvalidArgument("transitions.n_step > 1 needs a reward field; the buffer has none")
            return batch
        if n == 1:
            batch["n_step_return"] = batch[ring.reward_field].astype(np.float32, copy=False)
            for f in ring.observation_fields:
                batch[f"bootstrap_{f.name}"] = batch[f"next_{f.name}"]
            batch["bootstrap_discount"] = np.where(episode_terminated, np.float32(0.0), np.float32(self.gamma))
            return batch
        # The reward window (B, n) in one gather; steps past the episode's bound are masked out.
        window = ring.columns[ring.reward_field].take((rows[:, None] + self._offsets) % capacity)  # (B, n)
        window *= self._offsets < n_eff[:, None]
        batch["n_step_return"] = (window @ self._powers[:n]).astype(np.float32)  # (B,)
        bootstrap_rows = (rows + n_eff) % capacity
        for f in ring.observation_fields:
            batch[f"bootstrap_{f.name}"] = columns[f.name].take(bootstrap_rows, axis=0)
        discount = self._powers.take(n_eff).astype(np.float32)  # gamma^n_eff
        discount[episode_terminated] = 0.0
        batch["bootstrap_discount"] = discount
        return batch
