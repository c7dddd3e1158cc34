"""The batch-mode interface: turns a Draw of positions into named columns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from service.samplers.draw import Draw

if TYPE_CHECKING:
    from service.buffers.episodic import EpisodicBuffer


class BatchMode(Protocol):
    def build(self, ring: EpisodicBuffer, draw: Draw, rng: np.random.Generator) -> dict[str, np.ndarray]: ...
