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

import functools

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.ring import NO_REWARD, EpisodicRing
from replayd.server.buffers.stacking import FrameRead
from replayd.server.modes.base import BatchMode
from replayd.server.samplers.draw import Draw
from replayd.wire.components import STRATEGIES, Hindsight
from replayd.wire.errors import InvalidArgument

ONE_STEP = np.ones(2)  # the powers of a 1-step window: transition_batch's `powers`
NO_NAMES: tuple[str, ...] = ()


class HindsightMode(BatchMode):
    def __init__(self, strategy: str = "future", relabel_ratio: float = 0.8, discount: float = 0.9) -> None:
        self.options = Hindsight(strategy, relabel_ratio, discount)
        self.strategy = STRATEGIES.index(self.options.strategy)  # the kernel's number for it

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
        names, observed = _transition_columns(ring.observation_columns.names,
                                              tuple(f.name for f in ring.step_fields), desired)
        kernels.transition_batch(batch, draw.positions, draw.rows, draw.bounds, draw.closed, 1, ONE_STEP,
                                 ring.capacity, NO_REWARD, ring.row_seq, ring.extent_flags, ring.extent_slots,
                                 names, tuple(ring.columns[name] for name in names),
                                 kernels.prefixed("next_", observed), NO_NAMES)
        bit_generator = rng.bit_generator
        with bit_generator.lock:
            batch["relabeled"], batch["goal_offset"] = kernels.hindsight_goals(
                batch[desired], ring.columns[achieved], bit_generator.capsule, self.strategy,
                self.options.relabel_ratio, self.options.discount, draw.positions, draw.rows, draw.bounds,
                draw.open_seq, ring.capacity, ring.row_seq, ring.extent_start, ring.extent_flags, ring.extent_slots)
        return batch

    def frame_reads(self, ring: EpisodicRing, draw: Draw, batch: dict[str, np.ndarray]) -> tuple[FrameRead, ...]:
        # Stacked fields are never goals (check_goal_fields): each gets a next_ column.
        return FrameRead("", draw.positions), FrameRead("next_", draw.positions + 1)


@functools.cache
def _transition_columns(observations: tuple[str, ...], steps: tuple[str, ...],
                        desired: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the columns a transition's kernel gathers, the observation fields that get a next_ column there), from
    the plain (unstacked) observation fields and the step fields: the desired goal last among the observation
    fields, as it alone gets none (the transition's goal is one column)."""
    observed = tuple(name for name in observations if name != desired)
    return (*observed, desired, *steps), observed
