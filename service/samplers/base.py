"""The index-sampler interface: which sampleable positions a batch draws, and the per-row state that takes.

A sampler reads the ring (service/buffers/ring.py) and keeps its own per-row state (a sum tree of
priorities) in arrays of the buffer's shared memory, named by `array_specs`. The writer tells it about
rows through the hooks below, always before it publishes them (a row's bound) or after it unpublishes
them, so a lock-free reader never draws a published step without its state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from replayd.server.buffers.ring import EpisodicRing
from replayd.server.configured import Configured
from replayd.server.samplers.draw import Draw
from replayd.server.storage.shared_arrays import ArraySpec
from replayd.wire.components import SamplerOptions
from replayd.wire.errors import FailedPrecondition


class Sampler(Configured, ABC):
    options: SamplerOptions
    extra_item_bytes: int = 0  # bytes per item of the columns `draw` adds to a batch (Draw.extra)

    # ---------------------------------------------------------------- state in shared memory
    def array_specs(self, capacity: int) -> list[ArraySpec]:
        """The per-row arrays this sampler keeps beside the ring."""
        return []

    def bind(self, arrays: dict[str, np.ndarray]) -> None:
        """Takes freshly created arrays named by array_specs and initializes them (no step stored)."""

    def attach(self, arrays: dict[str, np.ndarray]) -> None:
        """Takes arrays that already hold its state (a reader, or a writer restarting on its segments)."""

    def recover(self, ring: EpisodicRing, tail: int, head: int) -> None:
        """After a crash: keeps the state of live sampleable steps in [tail, head) and clears the rest."""

    # ---------------------------------------------------------------- drawing
    @abstractmethod
    def draw(self, ring: EpisodicRing, batch_size: int, rng: np.random.Generator, importance_beta: float = 0.0,
             weight_floor: float | None = None) -> Draw:
        """`batch_size` sampleable positions, drawn independently (with replacement). `importance_beta` and
        `weight_floor` shape the importance weights of samplers that draw unequally."""

    def drawable(self, ring: EpisodicRing) -> bool:
        """Whether a draw can succeed now."""
        return ring.sampleable_steps > 0

    def weight_floor(self) -> float | None:
        """What a draw's importance weights are normalized against (None: no weights)."""
        return None

    def update_priorities(self, ring: EpisodicRing, keys: np.ndarray, priorities: np.ndarray) -> tuple[int, int]:
        """(applied, ignored_stale) for new priorities of sampled keys; only prioritized samplers take them."""
        raise FailedPrecondition(f"update_priorities: buffer {ring.name!r} uses the {self.name} sampler, "
                                 "not prioritized")

    def counters(self) -> dict[str, float]:
        """State worth reporting (metrics, descriptions), by name."""
        return {}

    # ---------------------------------------------------------------- writer hooks (under the writer's lock)
    def on_rows_written(self, ring: EpisodicRing, lo: int, hi: int, bounds: np.ndarray | int) -> None:
        """Positions [lo, hi) are about to get `bounds` (new rows, or rows that just got a successor)."""

    def on_rows_cleared(self, ring: EpisodicRing, lo: int, hi: int) -> None:
        """Positions [lo, hi) no longer hold sampleable steps."""

    def on_positions_cleared(self, ring: EpisodicRing, positions: np.ndarray) -> None:
        """Scattered positions no longer hold sampleable steps (retired by a remover)."""

    def state_of_rows(self, rows: np.ndarray) -> Any:
        """Per-row state of steps about to move with their open episode (None: nothing kept)."""
        return None

    def restore_rows(self, ring: EpisodicRing, rows: np.ndarray, state: Any) -> None:
        """Gives rows the state `state_of_rows` took (moved steps, or a draw taken back)."""
