"""States: the observation fields of sampled steps, drawn by the buffer's sampler (e.g. ALLO's orthogonality
batches from a uniform buffer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from service.samplers import kernels
from service.samplers.draw import Draw

if TYPE_CHECKING:
    from service.buffers.episodic import EpisodicBuffer


class StatesMode:
    def check(self, ring: EpisodicBuffer) -> None:
        """Any episodic ring has states."""

    def item_bytes(self, ring: EpisodicBuffer) -> int:
        return ring.observation_row_bytes

    def build(self, ring: EpisodicBuffer, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        batch = {} if batch is None else batch
        kernels.gather_columns(batch, draw.rows, ring.observation_columns)
        return batch
