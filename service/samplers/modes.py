"""The batch-mode interface: turns a Draw of positions into named columns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from service.samplers.draw import Draw

if TYPE_CHECKING:
    from service.buffers.episodic import EpisodicBuffer


class BatchMode(Protocol):
    def check(self, ring: EpisodicBuffer) -> None:
        """Raises InvalidArgument when this mode cannot sample `ring` (called before any wait for data)."""

    def item_bytes(self, ring: EpisodicBuffer) -> int:
        """Bytes per item of the columns `build` returns (an aliased column once), to size a batch before
        drawing it."""

    def build(self, ring: EpisodicBuffer, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The draw's columns, in `batch` if given: a column it already holds is the array its values are
        written into (one of the right dtype and shape), e.g. a view of the message the batch is sent in."""
