"""Sequences of consecutive steps of one episode, for recurrent learners (R2D2, DRQN, world models).

A sequence starts at a step the buffer's sampler draws (uniform, or by the start step's priority) and holds
the T = burn_in + length rows from there, never past its episode's final observation: the precomputed
bound of the start row says where the episode ends, so a batch costs one draw, one bound lookup and one
gather of T rows per sequence and column, whatever the ring holds. `period` restricts starts to every
period-th step of an episode (R2D2's overlapping sequences); `boundary="fit"` to the steps where a whole
sequence fits. Restricted starts are drawn by rejection (RingReader.draw): the sampler's law among the
admitted steps.

Columns, batch-major (B, T, ...): every observation and step field; `mask`: the row is a step of the
episode (it has a successor); `is_first`: the row is its episode's first; `terminated`, `truncated`: the
step's transition ends the episode. The row holding the episode's final observation, when within the T
rows, holds it (mask False there: no step starts at it); rows after it are zeros. With `n_step` >= 1,
each step's n-step targets as the transitions mode computes them: `n_step_return`, `bootstrap_discount`,
and `bootstrap_step` = t + n_eff, the index of the bootstrap observation within the sequence (>= T: past
the sequence's rows, so the batch holds no target for that step). A recurrent state an actor stored per
step is a step field like any other: the learner takes its first row.
"""

from __future__ import annotations

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.ring import EpisodicRing
from replayd.server.buffers.stacking import FrameRead
from replayd.server.modes.base import BatchMode
from replayd.server.samplers.draw import Draw
from replayd.wire.components import Sequences
from replayd.wire.errors import InvalidArgument

FLAGS = ("mask", "is_first", "terminated", "truncated")


class SequencesMode(BatchMode):
    def __init__(self, length: int, burn_in: int = 0, period: int = 1, boundary: str = "pad", n_step: int = 0,
                 gamma: float = 0.99) -> None:
        self.options = Sequences(length, burn_in, period, boundary, n_step, gamma)
        self.steps = self.options.steps
        self.offsets = np.arange(self.steps, dtype=np.int64)  # (T,)
        self.powers = self.options.gamma ** np.arange(self.options.n_step + 1)  # (n + 1,)

    def check(self, ring: EpisodicRing) -> None:
        if self.steps > ring.capacity:
            raise InvalidArgument(f"sequences: burn_in + length = {self.steps} rows, more than the ring holds "
                                  f"(capacity_steps={ring.capacity})")
        if self.options.n_step and ring.reward_field is None:
            raise InvalidArgument("sequences.n_step >= 1 needs a reward field; the buffer has none")

    def item_bytes(self, ring: EpisodicRing) -> int:
        targets = 4 + 4 + 4 if self.options.n_step else 0  # n_step_return, bootstrap_discount, bootstrap_step
        return self.steps * (ring.item_row_bytes + len(FLAGS) + targets)

    def admit(self, ring: EpisodicRing, draw: Draw) -> np.ndarray | None:
        period, fit = self.options.period, self.options.boundary == "fit"
        if period == 1 and not fit:
            return None
        admitted = np.ones(draw.positions.size, dtype=bool)
        if period > 1:
            admitted &= (draw.positions - ring.episode_starts_of(draw.rows, draw.open_seq)) % period == 0
        if fit:
            admitted &= draw.positions + self.steps <= draw.bounds
        return admitted

    def refusal(self, ring: EpisodicRing) -> str | None:
        longest = ring.longest_episode()
        if self.options.boundary == "fit" and longest < self.steps:
            return (f"sequences.boundary='fit': no stored episode holds a whole sequence of burn_in + length = "
                    f"{self.steps} steps; the longest stored episode has {longest}")
        return None  # every episode's first step starts a sequence

    def build(self, ring: EpisodicRing, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        batch = {} if batch is None else batch
        columns = ring.observation_and_step_columns
        kernels.sequence_batch(batch, draw.positions, draw.rows, draw.bounds, draw.closed, draw.open_seq, self.steps,
                               ring.capacity, ring.row_seq, ring.extent_start, ring.extent_flags, ring.extent_slots,
                               columns.names, columns.arrays, self.options.n_step, self.powers, ring.reward_column)
        return batch

    def frame_reads(self, ring: EpisodicRing, draw: Draw, batch: dict[str, np.ndarray]) -> tuple[FrameRead, ...]:
        # Rows up to the episode's final observation hold states (the kernel's `held`); the rest are zeros.
        held = np.clip(draw.bounds - draw.positions + 1, 0, self.steps)  # (B,)
        return (FrameRead("", draw.positions[:, None] + self.offsets, self.offsets < held[:, None]),)  # (B, T)
