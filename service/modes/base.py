"""The batch-mode interface: turns a Draw of positions into named columns.

A mode is chosen per request (its options travel in SampleRequest.mode) and holds no state, so one object
serves a whole stream. Adding a mode is this class's subclass, its options class (service/wire/components.py)
and its wire message (proto/replay.proto); service/components.py lists the implementations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from service.buffers.ring import EpisodicRing
from service.configured import Configured
from service.samplers.draw import Draw
from service.wire.components import ModeOptions


class BatchMode(Configured, ABC):
    options: ModeOptions

    def check(self, ring: EpisodicRing) -> None:
        """Raises InvalidArgument when this mode cannot sample `ring` (called before any wait for data)."""

    def admit(self, ring: EpisodicRing, draw: Draw) -> np.ndarray | None:
        """Which drawn steps this mode can start an item at (a bool mask), or None: any step. The reader draws
        again for those it refuses, so items are drawn by the sampler among the admitted steps alone."""
        return None

    def refusal(self, ring: EpisodicRing) -> str | None:
        """Why no stored step can be admitted, for the error a sample then gets; None when some can (a draw
        that admitted none of many candidates met a rare admitted step, and draws on)."""
        return None

    @abstractmethod
    def item_bytes(self, ring: EpisodicRing) -> int:
        """Bytes per item of the columns `build` returns (an aliased column once), to size a batch before
        drawing it."""

    @abstractmethod
    def build(self, ring: EpisodicRing, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The draw's columns, in `batch` if given: a column it already holds is the array its values are
        written into (one of the right dtype and shape), e.g. a view of the message the batch is sent in."""
