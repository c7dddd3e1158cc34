"""States: the observation fields of sampled steps, drawn by the buffer's sampler (e.g. ALLO's orthogonality
batches from a uniform buffer)."""

from __future__ import annotations

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.ring import EpisodicRing
from replayd.server.buffers.stacking import FrameRead
from replayd.server.modes.base import BatchMode
from replayd.server.samplers.draw import Draw
from replayd.wire.components import States


class StatesMode(BatchMode):
    def __init__(self) -> None:
        self.options = States()

    def item_bytes(self, ring: EpisodicRing) -> int:
        return ring.observation_row_bytes

    def build(self, ring: EpisodicRing, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        batch = {} if batch is None else batch
        kernels.gather_columns(batch, draw.rows, ring.observation_columns)
        return batch

    def frame_reads(self, ring: EpisodicRing, draw: Draw, batch: dict[str, np.ndarray]) -> tuple[FrameRead, ...]:
        return (FrameRead("", draw.positions),)
