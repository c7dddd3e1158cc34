"""Uniform index sampler: every sampleable step equally likely."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from service.samplers.draw import Draw
from service.storage.shared_arrays import ArraySpec

if TYPE_CHECKING:
    from service.buffers.episodic import EpisodicBuffer

# Below this fraction of sampleable positions in the live range, rejection would take many rounds,
# so the sampler enumerates the sampleable positions instead (only tiny-episode or hole-ridden rings).
_DENSE_ENOUGH = 1 / 16


def _uniform_integers(rng: np.random.Generator, low: int, high: int, size: int) -> np.ndarray:
    # Twice as fast as Generator.integers for small batches; the bias of flooring a 53-bit uniform
    # is below 2^-53 * (high - low), far under any statistical test's resolution.
    return low + (rng.random(size) * (high - low)).astype(np.int64)


class UniformSampler:
    name = "uniform"

    def array_specs(self, capacity: int) -> list[ArraySpec]:
        return []  # no per-row state: validity comes from the ring's bounds

    def bind(self, arrays: dict[str, np.ndarray]) -> None:
        pass

    def attach(self, arrays: dict[str, np.ndarray]) -> None:
        pass

    def recover(self, ring: EpisodicBuffer, tail: int, head: int) -> None:
        pass

    def draw(self, ring: EpisodicBuffer, batch_size: int, rng: np.random.Generator,
             importance_beta: float = 0.0) -> Draw:
        """Every weight would be 1, so `importance_beta` adds no column."""
        low, high = ring.tail_position(), ring.head
        if ring.sampleable_steps < _DENSE_ENOUGH * (high - low):
            candidates = np.arange(low, high, dtype=np.int64)
            _, bounds, _ = ring.episode_bounds(candidates)
            positions = rng.choice(candidates[candidates < bounds], size=batch_size)
            rows, bounds, in_open = ring.episode_bounds(positions)
            return Draw(positions, rows, bounds, ~in_open)
        # Rejection sampling over the live range is exactly uniform over sampleable positions: final
        # observations and holes are dropped. One oversampled round almost always yields enough, so the
        # usual call runs a fixed, short sequence of vector operations; a second round tops up.
        positions = rows = bounds = in_open = None
        needed = batch_size
        while needed:
            candidates = _uniform_integers(rng, low, high, needed + needed // 16 + 8)
            cand_rows, cand_bounds, cand_open = ring.episode_bounds(candidates)
            keep = np.flatnonzero(candidates < cand_bounds)[:needed]
            parts = candidates.take(keep), cand_rows.take(keep), cand_bounds.take(keep), cand_open.take(keep)
            if positions is None:
                positions, rows, bounds, in_open = parts
            else:
                positions, rows, bounds, in_open = (np.concatenate(pair) for pair in
                                                    zip((positions, rows, bounds, in_open), parts, strict=True))
            needed = batch_size - len(positions)
        return Draw(positions, rows, bounds, ~in_open)

    def on_rows_written(self, ring: EpisodicBuffer, lo: int, hi: int) -> None:
        """Positions [lo, hi) changed (new rows, or rows that just got a successor)."""

    def on_rows_cleared(self, ring: EpisodicBuffer, lo: int, hi: int) -> None:
        """Positions [lo, hi) no longer hold sampleable steps."""

    def on_positions_cleared(self, ring: EpisodicBuffer, positions: np.ndarray) -> None:
        """Scattered positions no longer hold sampleable steps (retired by a remover)."""
