"""The batch-mode interface: turns a Draw of positions into named columns.

A mode is chosen per request (its options travel in SampleRequest.mode) and holds no state, so one object
serves a whole stream. Adding a mode is this class's subclass, its options class (proto/components.py)
and its wire message (proto/replay.proto); service/components.py lists the implementations.

A mode's kernels gather the plain columns (`build`); the frames of stacked observation fields are assembled
afterwards by one pass for every mode (service/buffers/stacking.py), from the positions each of the mode's
output prefixes reads (`frame_reads`). `gather` runs both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from replayd.server.buffers.ring import EpisodicRing
from replayd.server.buffers.stacking import FrameRead, Shipped, gather_frames
from replayd.server.configured import Configured
from replayd.server.samplers.draw import Draw
from replayd.wire.components import ModeOptions


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
        """Bytes per item of the columns `gather` returns (an aliased column once), to size a batch before
        drawing it."""

    @abstractmethod
    def build(self, ring: EpisodicRing, draw: Draw, rng: np.random.Generator,
              batch: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The draw's columns, in `batch` if given: a column it already holds is the array its values are
        written into (one of the right dtype and shape), e.g. a view of the message the batch is sent in."""

    @abstractmethod
    def frame_reads(self, ring: EpisodicRing, draw: Draw, batch: dict[str, np.ndarray]) -> tuple[FrameRead, ...]:
        """Where each output prefix of this mode reads observations (after `build`, whose columns it may use:
        the geometric offsets), for the stacked fields' pass: e.g. ("", positions), ("next_", positions + 1)."""

    def gather(self, ring: EpisodicRing, draw: Draw, rng: np.random.Generator,
               batch: dict[str, np.ndarray] | None = None, shipped: list[Shipped] | None = None
               ) -> dict[str, np.ndarray]:
        """The draw's whole batch: `build`'s columns, then every stacked or compressed field at every prefix's
        positions, each written into `batch`'s array of its name when it holds one. With `shipped` (a sample
        with decompress="client"), compressed fields' frames go there compressed, and their columns hold
        indices into them."""
        built = self.build(ring, draw, rng, batch)
        if ring.framed_fields:
            gather_frames(ring, self.frame_reads(ring, draw, built), ring.episode_starts_of(draw.rows, draw.open_seq),
                          built, shipped)
        return built
