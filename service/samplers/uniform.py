"""Uniform index sampler: every sampleable step equally likely."""

from __future__ import annotations

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.ring import EpisodicRing
from replayd.server.samplers.base import Sampler
from replayd.server.samplers.draw import Draw
from replayd.wire.components import Uniform
from replayd.wire.errors import RingChanged

# Below this fraction of sampleable positions in the live range, rejection would take many rounds,
# so the sampler enumerates the sampleable positions instead (only tiny-episode or hole-ridden rings).
_DENSE_ENOUGH = 1 / 16
# Each round draws about 1.06x the expected number of candidates it needs, so one usually suffices and
# 64 never fall short in practice; a lock-free reader can get there only when evictions emptied the
# range it read.
_MAX_ROUNDS = 64


class UniformSampler(Sampler):
    def __init__(self) -> None:
        self.options = Uniform()

    def draw(self, ring: EpisodicRing, batch_size: int, rng: np.random.Generator,
             importance_beta: float = 0.0, weight_floor: float | None = None) -> Draw:
        """Every weight would be 1, so `importance_beta` and `weight_floor` add no column."""
        low, high, sampleable = ring.live_range()
        if sampleable < _DENSE_ENOUGH * (high - low):
            candidates = np.arange(low, high, dtype=np.int64)
            _, bounds, _ = ring.episode_bounds(candidates)
            steps = candidates[candidates < bounds]
            if not steps.size:  # only a lock-free reader whose range evictions emptied
                raise RingChanged(f"buffer {ring.name!r}: no sampleable step in positions [{low}, {high}) "
                                  f"(sampleable_steps={sampleable}); the ring changed under the draw")
            positions = rng.choice(steps, size=batch_size)
            return Draw(positions, *ring.locate(positions))
        # Rejection sampling over the live range is exactly uniform over sampleable positions: final
        # observations and holes are dropped. One oversampled round almost always yields enough; a
        # second round tops up.
        candidates_per_step = 1.0625 * (high - low) / max(sampleable, 1)  # <= 17: dense enough
        bit_generator = rng.bit_generator
        with bit_generator.lock:
            drawn = kernels.draw_uniform(bit_generator.capsule, batch_size, low, high, candidates_per_step,
                                         _MAX_ROUNDS, *ring.bound_tables)
        if drawn is None:
            raise RingChanged(
                f"buffer {ring.name!r}: found no sampleable step in {_MAX_ROUNDS} rounds over positions "
                f"[{low}, {high}) (sampleable_steps={sampleable}); the ring changed under the draw"
            )
        return Draw(*drawn)
