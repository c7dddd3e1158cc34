"""Geometric future-state pairs for representation learning (e.g. ALLO's Laplacian encoder)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from service.errors import InvalidArgument
from service.samplers import kernels
from service.samplers.draw import Draw

if TYPE_CHECKING:
    from service.buffers.episodic import EpisodicBuffer


class GeometricMode:
    """Observation at t, observation at t + d, and the offset d: P(d) proportional to discount^(d-1) for
    d in 1..M, M = steps to the episode's bound (drawn in kernels.geometric_batch)."""

    def __init__(self, discount: float) -> None:
        if not 0.0 <= discount <= 1.0:
            raise InvalidArgument(f"geometric.discount must be in [0, 1], got {discount}")
        self.discount = float(discount)

    def check(self, ring: EpisodicBuffer) -> None:
        """Any episodic ring has observations to pair."""

    def item_bytes(self, ring: EpisodicBuffer) -> int:
        return 2 * ring.observation_row_bytes + np.dtype(np.int64).itemsize  # offset

    def build(self, ring: EpisodicBuffer, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        batch = {} if batch is None else batch
        columns = ring.observation_columns
        bit_generator = rng.bit_generator
        with bit_generator.lock:
            kernels.geometric_batch(batch, bit_generator.capsule, self.discount, draw.positions, draw.rows,
                                    draw.bounds, ring.capacity, columns.names,
                                    kernels.prefixed("future_", columns.names), columns.arrays)
        return batch
