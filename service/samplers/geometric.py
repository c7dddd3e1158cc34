"""Geometric future-state pairs for representation learning (e.g. ALLO's Laplacian encoder)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from service.errors import InvalidArgument
from service.samplers.draw import Draw

if TYPE_CHECKING:
    from service.buffers.episodic import EpisodicBuffer


def truncated_geometric(discount: float, horizon: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Draws d in 1..M with P(d) proportional to discount^(d-1), one per horizon M >= 1, by inverse CDF.

    CDF(k) = (1 - g^k) / (1 - g^M), so d = ceil(log(1 - u (1 - g^M)) / log g) for u ~ U[0, 1).
    """
    if discount == 0.0:
        return np.ones(len(horizon), dtype=np.int64)
    u = rng.random(len(horizon))
    if discount == 1.0:
        return (u * horizon).astype(np.int64) + 1
    log_g = np.log(discount)
    offsets = np.ceil(np.log1p(u * np.expm1(horizon * log_g)) / log_g).astype(np.int64)
    return np.clip(offsets, 1, horizon)


class GeometricMode:
    """Observation at t, observation at t + d, and the offset d; M = steps to the episode's bound."""

    def __init__(self, discount: float) -> None:
        if not 0.0 <= discount <= 1.0:
            raise InvalidArgument(f"geometric.discount must be in [0, 1], got {discount}")
        self.discount = float(discount)

    def build(self, ring: EpisodicBuffer, draw: Draw, rng: np.random.Generator) -> dict[str, np.ndarray]:
        offsets = truncated_geometric(self.discount, draw.bounds - draw.positions, rng)
        future_rows = (draw.rows + offsets) % ring.capacity
        batch = {f.name: ring.columns[f.name].take(draw.rows, axis=0) for f in ring.observation_fields}
        batch.update(
            {f"future_{f.name}": ring.columns[f.name].take(future_rows, axis=0) for f in ring.observation_fields}
        )
        batch["offset"] = offsets
        return batch
