"""Geometric future-state pairs for representation learning (e.g. ALLO's Laplacian encoder)."""

from __future__ import annotations

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.ring import EpisodicRing
from replayd.server.buffers.stacking import FrameRead
from replayd.server.modes.base import BatchMode
from replayd.server.samplers.draw import Draw
from replayd.wire.components import Geometric


class GeometricMode(BatchMode):
    """Observation at t, observation at t + d, and the offset d: P(d) proportional to discount^(d-1) for
    d in 1..M, M = steps to the episode's bound (drawn in kernels.geometric_batch)."""

    def __init__(self, discount: float) -> None:
        self.options = Geometric(discount)
        self.discount = self.options.discount

    def item_bytes(self, ring: EpisodicRing) -> int:
        return 2 * ring.observation_row_bytes + np.dtype(np.int64).itemsize  # offset

    def build(self, ring: EpisodicRing, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        batch = {} if batch is None else batch
        columns = ring.observation_columns
        bit_generator = rng.bit_generator
        with bit_generator.lock:
            kernels.geometric_batch(batch, bit_generator.capsule, self.discount, draw.positions, draw.rows,
                                    draw.bounds, ring.capacity, columns.names,
                                    kernels.prefixed("future_", columns.names), columns.arrays)
        return batch

    def frame_reads(self, ring: EpisodicRing, draw: Draw, batch: dict[str, np.ndarray]) -> tuple[FrameRead, ...]:
        return FrameRead("", draw.positions), FrameRead("future_", draw.positions + batch["offset"])
