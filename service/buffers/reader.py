"""RingReader: a ring with its sampler and rate limiter, drawing batches.

The writer (service/buffers/episodic.py) holds one and draws under its lock; a learner's local reader and
a sample worker attach one by the buffer's header segment name alone and draw without any lock
(`sample_shared`), validating each batch against the writer's concurrent evictions (see ring.py).
"""

from __future__ import annotations

import math
import platform

import numpy as np

from replayd.server import components, kernels
from replayd.server.buffers.lifetime import SharedReads
from replayd.server.buffers.ring import EpisodicRing
from replayd.server.buffers.stacking import Shipped
from replayd.server.limiters import RateLimiter
from replayd.server.modes.base import BatchMode
from replayd.server.removers import Remover
from replayd.server.samplers.base import Sampler
from replayd.server.samplers.draw import Draw
from replayd.server.storage.shared_arrays import SharedArrays
from replayd.wire import components as options
from replayd.wire.errors import FailedPrecondition, InvalidArgument, RingChanged

# A reader gives up after this many torn draws in a row (each needs an eviction during one gather).
MAX_TORN_DRAWS = 100
# A draw whose mode admits only some steps draws again for the rest; it gives up once it drew this many
# candidates per item asked for without admitting one (the mode then says why no step is admitted).
MAX_CANDIDATES_PER_ITEM = 256


def lock_free_host() -> bool:
    """Whether this host may sample shared memory lock-free: numpy issues no memory barriers, so the readers'
    validation takes x86's ordering of loads and stores."""
    return platform.machine().lower() in ("x86_64", "amd64")


def check_importance_beta(importance_beta: float) -> None:
    if not (math.isfinite(importance_beta) and importance_beta >= 0):
        raise InvalidArgument(f"importance_beta must be finite and >= 0, got {float(importance_beta)}")


def shared_sampling(config: dict) -> bool:
    """Whether processes other than the writer may sample the buffer a configuration describes: not when
    sampling changes state (a remover counting draws, a rate limiter's balance)."""
    return not options.sampling_changes_state(options.from_config("remover", config["remover"]),
                                              options.from_config("rate_limiter", config["rate_limiter"]))


class RingReader:
    """Draws and batches of one ring, by its sampler, within its rate limiter's minimum size."""

    def __init__(self, ring: EpisodicRing, sampler: Sampler, limiter: RateLimiter) -> None:
        self.ring = ring
        self.sampler = sampler
        self.limiter = limiter
        self.name = ring.name
        self.reads = SharedReads(ring.name)

    @classmethod
    def attach(cls, header_name: str) -> RingReader:
        """Maps a buffer of this host read-only, for sampling without the server's lock.

        Buffers whose sampling changes state (a remover counting draws, a rate limiter's balance) are
        sampled by their server only.
        """
        if not lock_free_host():
            raise FailedPrecondition(f"lock-free readers need an x86-64 host (its memory ordering), this one is "
                                     f"{platform.machine()!r}: sample over gRPC instead")
        storage = SharedArrays.attach(header_name, readonly=True)
        meta = storage.meta
        try:
            if meta.get("kind") != EpisodicRing.kind:
                raise InvalidArgument(f"segment {header_name!r} holds a {meta.get('kind')} buffer, not an episodic one")
            config = meta["config"]
            if not shared_sampling(config):
                raise FailedPrecondition(
                    f"buffer {meta['name']!r} (remover {config['remover']}, rate limiter {config['rate_limiter']}) "
                    "is sampled by its server only: shared-memory readers sample buffers whose sampling changes "
                    "nothing (no max_times_sampled remover, no sample-to-insert ratio)"
                )
            sampler: Sampler = components.from_config("sampler", config["sampler"])
            remover: Remover = components.from_config("remover", config["remover"])
            limiter: RateLimiter = components.from_config("rate_limiter", config["rate_limiter"])
            sampler.attach(storage.arrays)
            remover.bind(storage.arrays)
        except BaseException:
            storage.close()
            raise
        return cls(EpisodicRing(storage, remover.retired()), sampler, limiter)

    # ------------------------------------------------------------------ drawing
    def draw(self, batch_size: int, rng: np.random.Generator, importance_beta: float = 0.0,
             weight_floor: float | None = None, mode: BatchMode | None = None) -> Draw:
        """Draws sampleable positions with the configured sampler, among the steps `mode` admits.

        `importance_beta` is the prioritized sampler's importance-weight exponent, `weight_floor` the priority
        its weights are normalized against (None: the smallest now; see PrioritizedSampler.draw). Others
        ignore both.
        """
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
        check_importance_beta(importance_beta)
        ring = self.ring
        if ring.sampleable_steps == 0:
            raise FailedPrecondition(
                f"buffer {self.name!r} has no sampleable steps yet (stored_steps={ring.stored_steps})"
            )
        draw = self.sampler.draw(ring, batch_size, rng, importance_beta, weight_floor)
        admitted = None if mode is None else mode.admit(ring, draw)
        if admitted is None or admitted.all():
            return draw
        floor = self.sampler.weight_floor() if weight_floor is None else weight_floor  # one for every round
        return self._admitted(draw, admitted, batch_size, rng, importance_beta, floor, mode)

    def _admitted(self, draw: Draw, admitted: np.ndarray, batch_size: int, rng: np.random.Generator,
                  importance_beta: float, weight_floor: float | None, mode: BatchMode) -> Draw:
        """The first `batch_size` admitted draws of independent rounds: the sampler's law restricted to the
        admitted steps. Each round draws as many candidates as the admission rate so far predicts it needs."""
        parts, kept, drawn = [draw.select(admitted)], int(np.count_nonzero(admitted)), draw.positions.size
        asked = False  # whether the mode was asked if any step is admitted at all
        while kept < batch_size:
            if drawn >= MAX_CANDIDATES_PER_ITEM * batch_size and kept == 0 and not asked:
                reason, asked = mode.refusal(self.ring), True
                if reason is not None:
                    raise FailedPrecondition(f"sample: {reason}")
            need = batch_size - kept
            candidates = min(int(need * 1.25 * drawn / max(kept, 1)) + 8, MAX_CANDIDATES_PER_ITEM * batch_size)
            draw = self.sampler.draw(self.ring, candidates, rng, importance_beta, weight_floor)
            admitted = mode.admit(self.ring, draw)
            parts.append(draw.select(admitted))
            kept += int(np.count_nonzero(admitted))
            drawn += candidates
        return Draw.concatenate(parts).head(batch_size)

    def gather(self, batch_size: int, mode: BatchMode, rng: np.random.Generator, include_keys: bool = False,
               importance_beta: float = 0.0, shipped: list[Shipped] | None = None
               ) -> tuple[Draw, dict[str, np.ndarray]]:
        """(draw, batch): indices from the sampler, columns from the mode. The callers (the writer's sample,
        sample_shared) ensure consistency and have the mode check the ring."""
        draw = self.draw(batch_size, rng, importance_beta, mode=mode)
        return draw, self.batch_of(draw, mode, rng, include_keys, shipped)

    def batch_of(self, draw: Draw, mode: BatchMode, rng: np.random.Generator, include_keys: bool = False,
                 shipped: list[Shipped] | None = None) -> dict[str, np.ndarray]:
        """The batch of a draw: columns from the mode, keys and episode ids if asked, the sampler's extras.
        `shipped`: where compressed frames go compressed (BatchMode.gather)."""
        batch = mode.gather(self.ring, draw, rng, shipped=shipped)
        if include_keys:
            batch["key"] = draw.positions
            batch["episode_id"] = self.ring.episode_ids_of(draw.rows, draw.open_seq)
        if draw.extra:
            batch.update(draw.extra)
        return batch

    def ready(self, batch_size: int = 1) -> bool:
        """Whether a sample of `batch_size` may be drawn now: its limiter lets it through and the sampler
        has a step to draw."""
        return (self.limiter.sample_allowed(self.ring.sampleable_steps, batch_size)
                and self.sampler.drawable(self.ring))

    # ------------------------------------------------------------------ lock-free sampling
    def drawable(self) -> bool:
        """Whether a lock-free draw can succeed now (NotFound once this reader is closed)."""
        with self.reads:
            return self.ready()

    def sample_shared(self, batch_size: int, mode: BatchMode, rng: np.random.Generator, include_keys: bool = False,
                      importance_beta: float = 0.0, shipped: list[Shipped] | None = None
                      ) -> tuple[dict[str, np.ndarray], int]:
        """A whole batch gathered without the writer's lock; returns (batch, torn draws redrawn). NotFound
        once this reader is closed; a close waits for the samples running. `shipped`: see BatchMode.gather."""
        mode.check(self.ring)
        with self.reads:
            size = self.ring.sampleable_steps
            if size and not self.limiter.sample_allowed(size, batch_size):
                raise FailedPrecondition(f"sample: rate limiter of buffer {self.name!r} blocks it: "
                                         f"{self.limiter.blocked_reason(size)}")
            return self._sample_shared(batch_size, mode, rng, include_keys, importance_beta, shipped)

    def _sample_shared(self, batch_size: int, mode: BatchMode, rng: np.random.Generator, include_keys: bool,
                       importance_beta: float, shipped: list[Shipped] | None) -> tuple[dict[str, np.ndarray], int]:
        ring = self.ring
        for torn in range(MAX_TORN_DRAWS):
            frames: list[Shipped] | None = None if shipped is None else []  # this draw's: a torn one is dropped
            try:
                draw, batch = self.gather(batch_size, mode, rng, include_keys, importance_beta, frames)
            except RingChanged:  # evictions emptied the range the draw read, or tore a frame it read
                continue
            # Every position drawn was a step, is still live and kept its bound: the batch was read whole.
            # (A prioritized draw can also race a priority write and land on a position that just stopped
            # being a step; the sampler gives such draws a HOLE bound.)
            # The tail is read after the bounds: a row evicted and reused since the draw shows there.
            if (kernels.bounds_kept(draw.rows, draw.bounds, draw.closed, ring.row_end)
                    and kernels.drawn_live(draw.positions, draw.bounds, ring.tail_position())):
                if shipped is not None:
                    shipped.extend(frames)
                return batch, torn
        raise FailedPrecondition(
            f"buffer {self.name!r}: {MAX_TORN_DRAWS} draws in a row raced with the writer (evictions, episodes moving "
            "or closing); the ring turns over faster than one batch can be gathered (raise capacity_steps)"
        )

    def close(self) -> None:
        """Unmaps a reader's view of the ring, once the samples running on it end."""
        self.reads.end(self.ring.storage.close)
