"""Hindsight goal relabeling (Andrychowicz et al. 2017) of goal-conditioned transitions.

The buffer names its goal fields at creation: the goal each state achieved and the goal the episode
pursued (observation fields of one dtype and shape). A batch holds 1-step transitions whose desired goal
is, with probability `relabel_ratio`, replaced by the goal achieved at step t + k of the same episode,
with the offset k drawn by the strategy:

    final      k = M, the episode's final state (M = steps from t to the episode's bound)
    future     k uniform on 1..M (strictly later states)
    episode    t + k uniform over the episode's states
    geometric  k on 1..M with P(k) proportional to discount^(k - 1), as the geometric mode draws offsets

The episode's bound is precomputed at insert, so a relabeled goal is one more gather: nothing is copied or
stored again. The server never runs user code: the stored `reward` is the one for the stored goal, and a
client recomputes the reward of the batch's goals from `next_<achieved>` (the loader applies the user's
`compute_reward`).

Columns: every observation field at t, every step field at t, `next_<field>` at t + 1 for every
observation field but the desired goal, `terminated`, `truncated`, the desired-goal field holding each
transition's goal, `relabeled`, and `goal_offset` (k; 0 where the goal was not relabeled).
"""

from __future__ import annotations

import numpy as np

from service import kernels
from service.buffers.ring import NO_REWARD, EpisodicRing
from service.errors import InvalidArgument
from service.modes.base import BatchMode
from service.samplers.draw import Draw
from service.wire.components import Hindsight

ONE_STEP = np.ones(2)  # the powers of a 1-step window: transition_batch's `powers`
NO_NAMES: tuple[str, ...] = ()


class HindsightMode(BatchMode):
    def __init__(self, strategy: str = "future", relabel_ratio: float = 0.8, discount: float = 0.9) -> None:
        self.options = Hindsight(strategy, relabel_ratio, discount)

    def check(self, ring: EpisodicRing) -> None:
        if ring.goal_fields is None:
            raise InvalidArgument(f"hindsight: buffer {ring.name!r} has no goal fields; create it with "
                                  "goal_fields=(achieved, desired) naming two observation fields")

    def item_bytes(self, ring: EpisodicRing) -> int:
        desired = next(f for f in ring.observation_fields if f.name == ring.goal_fields[1])
        steps = sum(f.row_bytes for f in ring.step_fields)
        flags = 3  # terminated, truncated, relabeled
        return 2 * ring.observation_row_bytes - desired.row_bytes + steps + flags + 8  # goal_offset

    def build(self, ring: EpisodicRing, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        batch = {} if batch is None else batch
        achieved, desired = ring.goal_fields
        # The desired goal last among the observation fields: it alone gets no next_ column.
        observed = tuple(f.name for f in ring.observation_fields if f.name != desired)
        names = (*observed, desired, *(f.name for f in ring.step_fields))
        kernels.transition_batch(batch, draw.positions, draw.rows, draw.bounds, draw.closed, 1, ONE_STEP,
                                 ring.capacity, NO_REWARD, ring.row_seq, ring.extent_flags, ring.extent_slots,
                                 names, tuple(ring.columns[name] for name in names),
                                 kernels.prefixed("next_", observed), NO_NAMES)
        relabeled = rng.random(draw.positions.size) < self.options.relabel_ratio  # (B,)
        offsets = self._offsets(ring, draw, rng.random(draw.positions.size))  # (B,) k of every draw
        goal_rows = (draw.rows + offsets)[relabeled] % ring.capacity  # (R,)
        batch[desired][relabeled] = ring.columns[achieved][goal_rows]
        batch["relabeled"] = relabeled
        batch["goal_offset"] = np.where(relabeled, offsets, 0)
        return batch

    def _offsets(self, ring: EpisodicRing, draw: Draw, uniform: np.ndarray) -> np.ndarray:
        """k for each draw by the strategy, from one uniform in [0, 1) per draw."""
        left = draw.bounds - draw.positions  # (B,) M >= 1: steps to the episode's bound
        strategy = self.options.strategy
        if strategy == "final":
            return left
        if strategy == "future":
            return 1 + np.minimum((uniform * left).astype(np.int64), left - 1)
        if strategy == "episode":
            starts = ring.episode_starts_of(draw.rows, draw.open_seq)  # (B,)
            states = draw.bounds - starts + 1  # (B,) states of the episode, its final one included
            return starts + np.minimum((uniform * states).astype(np.int64), states - 1) - draw.positions
        return _geometric(uniform, left, self.options.discount)


def _geometric(uniform: np.ndarray, left: np.ndarray, discount: float) -> np.ndarray:
    """k on 1..M with P(k) proportional to discount^(k - 1), by inverting its distribution function
    F(k) = (1 - g^k) / (1 - g^M)."""
    if discount == 0.0:
        return np.ones_like(left)
    if discount == 1.0:
        return 1 + np.minimum((uniform * left).astype(np.int64), left - 1)
    log_g = np.log(discount)
    tail = np.exp(left * log_g)  # (B,) g^M
    k = np.floor(np.log1p(-uniform * (1.0 - tail)) / log_g).astype(np.int64) + 1  # (B,)
    return np.clip(k, 1, left)
