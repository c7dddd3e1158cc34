"""Transitions with n-step returns, bounded by each episode's precomputed final row."""

from __future__ import annotations

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.ring import EpisodicRing
from replayd.server.buffers.stacking import FrameRead
from replayd.server.modes.base import BatchMode
from replayd.server.samplers.draw import Draw
from replayd.wire.components import Transitions
from replayd.wire.errors import InvalidArgument


class TransitionsMode(BatchMode):
    """obs, step fields, next_obs, 1-step terminated/truncated, and n-step targets.

    n_eff = min(n, steps left to the episode's bound). `n_step_return` = sum_{k<n_eff} gamma^k r_{t+k};
    `bootstrap_discount` = gamma^n_eff, or 0 when the episode terminated at t + n_eff (truncation keeps
    bootstrapping); `bootstrap_<obs>` = the observation at t + n_eff (the same array as next_<obs>
    when n = 1, sent once on the wire).
    """

    def __init__(self, n_step: int = 1, gamma: float = 0.99) -> None:
        self.options = Transitions(n_step, gamma)
        self.n_step, self.gamma = self.options.n_step, self.options.gamma
        self._powers = self.gamma ** np.arange(self.n_step + 1)  # (n + 1,): gamma^0 .. gamma^n

    def check(self, ring: EpisodicRing) -> None:
        if ring.reward_field is None and self.n_step > 1:
            raise InvalidArgument("transitions.n_step > 1 needs a reward field; the buffer has none")

    def item_bytes(self, ring: EpisodicRing) -> int:
        observations = ring.observation_row_bytes
        steps = sum(f.row_bytes for f in ring.step_fields)
        flags = 2  # terminated, truncated (bool)
        if ring.reward_field is None:
            return 2 * observations + steps + flags  # obs, next obs
        # bootstrap obs is next obs when n = 1 (sent once); n_step_return and bootstrap_discount are float32
        return (2 if self.n_step == 1 else 3) * observations + steps + flags + 2 * 4

    def build(self, ring: EpisodicRing, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        batch = {} if batch is None else batch
        columns, observations = ring.observation_and_step_columns, ring.observation_columns.names
        kernels.transition_batch(batch, draw.positions, draw.rows, draw.bounds, draw.closed, self.n_step, self._powers,
                                 ring.capacity, ring.reward_column, ring.row_seq, ring.extent_flags, ring.extent_slots,
                                 columns.names, columns.arrays, kernels.prefixed("next_", observations),
                                 kernels.prefixed("bootstrap_", observations))
        return batch

    def frame_reads(self, ring: EpisodicRing, draw: Draw, batch: dict[str, np.ndarray]) -> tuple[FrameRead, ...]:
        following = draw.positions + 1
        if ring.reward_field is None:
            return FrameRead("", draw.positions), FrameRead("next_", following)
        # t + n_eff (as the kernel computes it; a torn bound's negative horizon reads t): the next state itself
        # for 1-step transitions, whose bootstrap column is the next one's
        bootstrap = following if self.n_step == 1 else draw.positions + np.clip(draw.bounds - draw.positions, 0,
                                                                                self.n_step)
        return FrameRead("", draw.positions), FrameRead("next_", following), FrameRead("bootstrap_", bootstrap)
