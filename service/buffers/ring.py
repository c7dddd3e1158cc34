"""The read side of an episodic buffer: what a sampler needs, over arrays in shared memory.

The writer (`EpisodicBuffer`) and every reader (a learner's local reader, a sample worker process) share
this class: the same bound lookups, samplers and batch modes, so a batch has the same format whichever
process gathers it. A reader attaches by the buffer's header segment name alone.

Readers hold no lock; they validate by the tail. A position's row never changes while the position is
live (>= the tail): the writer marks the rows of evicted extents as holes and moves `state[TAIL_POS]`
past them before it overwrites any of them, and the tail never moves back. So a batch whose positions
are all >= the tail read after the gather was read from live rows only: it is whole. Otherwise it raced
with an eviction and is drawn again. Bounds publish rows, not the head, which moves back when the newest
episode closes short of its room (see episodic.py's commit order). (x86 keeps stores in program order,
and loads too, which this relies on.)
"""

from __future__ import annotations

import math
import platform

import numpy as np

from service.buffers.lifetime import SharedReads
from service.errors import FailedPrecondition, InvalidArgument, RingChanged
from service.removers import FifoRemover, MaxTimesSampledRemover
from service.samplers import kernels
from service.samplers.draw import Draw
from service.samplers.kernels import Columns
from service.samplers.modes import BatchMode
from service.samplers.prioritized import PrioritizedSampler
from service.samplers.uniform import UniformSampler
from service.schema import Field, check_instance_name
from service.storage.shared_arrays import SharedArrays

OPEN, HOLE = kernels.OPEN, kernels.HOLE  # row_end of a row whose episode is open / that holds no episode
NO_COUNTS = np.empty(0, dtype=np.int64)  # no remover counts draws
NO_REWARD = np.empty(0, dtype=np.float32)  # no reward field: transition_batch writes no returns

ALIVE, IS_OPEN, TERMINATED = 1, 2, kernels.TERMINATED  # extent flags

# Indices into the shared `state` array.
HEAD, TAIL_SEQ, NEXT_SEQ, EPISODES, SAMPLEABLE, STORED, TAIL_POS = range(7)
STATE_SIZE = 8

# A reader gives up after this many torn draws in a row (each needs an eviction during one gather).
MAX_TORN_DRAWS = 100


def shm_name(instance: str, buffer: str) -> str:
    return f"rpd_{check_instance_name(instance)}_{buffer}"


def shared_sampling(components: dict) -> bool:
    """Whether processes other than the writer may sample: not when sampling changes state (a remover
    counting draws, a rate limiter). Prioritized readers descend the shared sum tree; priority updates
    still go to the writer."""
    return components["remover"]["kind"] == "fifo" and not components["rate_limited"]


def lock_free_host() -> bool:
    """Whether this host may sample shared memory lock-free: numpy issues no memory barriers, so the readers'
    validation takes x86's ordering of loads and stores."""
    return platform.machine().lower() in ("x86_64", "amd64")


def check_importance_beta(importance_beta: float) -> None:
    if not (math.isfinite(importance_beta) and importance_beta >= 0):
        raise InvalidArgument(f"importance_beta must be finite and >= 0, got {float(importance_beta)}")


class EpisodicRing:
    """Rows, bounds and extent table of one episodic buffer, read through its sampler."""

    kind = "episodic"

    def __init__(self, storage: SharedArrays, sampler: UniformSampler | PrioritizedSampler,
                 remover: FifoRemover | MaxTimesSampledRemover) -> None:
        meta = storage.meta
        self.storage = storage
        self.name: str = meta["name"]
        self.capacity: int = int(meta["capacity"])
        self.fields = tuple(Field(name, dtype, tuple(shape), observation)
                            for name, dtype, shape, observation in meta["fields"])
        self.observation_fields = tuple(f for f in self.fields if f.observation)
        self.step_fields = tuple(f for f in self.fields if not f.observation)
        self.reward_field: str | None = meta["reward_field"]
        self.extent_slots = self.capacity // 2 + 2  # every extent spans >= 2 positions
        arrays = storage.arrays
        self.columns = {f.name: arrays[f"field.{f.name}"] for f in self.fields}
        # The columns the batch modes gather, looked up once: a sample pays per dict lookup.
        self.observation_columns = Columns.of(self.columns, self.observation_fields)
        self.observation_and_step_columns = Columns.of(self.columns, self.observation_fields + self.step_fields)
        self.reward_column = NO_REWARD if self.reward_field is None else self.columns[self.reward_field]
        self.observation_row_bytes = sum(f.row_bytes for f in self.observation_fields)  # sizes a batch's items
        self.row_end, self.row_seq = arrays["row.end"], arrays["row.seq"]
        self.extent_episode_id, self.extent_start = arrays["extent.episode_id"], arrays["extent.start"]
        self.extent_last, self.extent_flags = arrays["extent.last"], arrays["extent.flags"]
        self.state = arrays["state"]
        self.sampler = sampler
        self.remover = remover
        self.reads = SharedReads(self.name)
        remover.bind(arrays)
        retired_counts, max_times = ((remover.times_sampled, remover.max_times_sampled) if remover.retires
                                     else (NO_COUNTS, 0))
        # The arguments after `positions` of the bound-lookup kernels.
        self.bound_tables = (self.capacity, self.row_end, self.row_seq, self.extent_last, self.extent_slots,
                             retired_counts, max_times)

    @classmethod
    def attach(cls, header_name: str) -> EpisodicRing:
        """Maps a buffer of this host read-only, for sampling without the server's lock.

        Buffers whose sampling changes state (a remover counting draws, a rate limiter) are sampled by
        their server only.
        """
        if not lock_free_host():
            raise FailedPrecondition(f"lock-free readers need an x86-64 host (its memory ordering), this one is "
                                     f"{platform.machine()!r}: sample over gRPC instead")
        storage = SharedArrays.attach(header_name, readonly=True)
        meta = storage.meta
        try:
            if meta.get("kind") != cls.kind:
                raise InvalidArgument(f"segment {header_name!r} holds a {meta.get('kind')} buffer, not an episodic one")
            if not shared_sampling(meta["components"]):
                raise FailedPrecondition(
                    f"buffer {meta['name']!r} ({meta['components']}) is sampled by its server only: shared-memory "
                    "readers sample buffers without a remover or rate limiter"
                )
            sampler_config = meta["config"]["sampler"]
            sampler = (PrioritizedSampler(sampler_config["alpha"]) if sampler_config["kind"] == "prioritized"
                       else UniformSampler())
            sampler.attach(storage.arrays)
        except BaseException:
            storage.close()
            raise
        return cls(storage, sampler, FifoRemover())

    # ------------------------------------------------------------------ state
    @property
    def head(self) -> int:
        return self.state.item(HEAD)

    def tail_position(self) -> int:
        """Absolute position of the oldest live extent's first row (the head when empty); never decreases."""
        return self.state.item(TAIL_POS)

    @property
    def sampleable_steps(self) -> int:
        return self.state.item(SAMPLEABLE)

    def live_range(self) -> tuple[int, int, int]:
        """(tail position, head, sampleable steps), read in that order: a draw's view of the ring, in one call."""
        state = self.state
        return state.item(TAIL_POS), state.item(HEAD), state.item(SAMPLEABLE)

    @property
    def stored_steps(self) -> int:
        return self.state.item(STORED)

    @property
    def episodes(self) -> int:
        return self.state.item(EPISODES)

    # ------------------------------------------------------------------ lookups
    def episode_bounds(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ring rows, episode bounds and closed-episode mask of absolute positions.

        The bound is the absolute position of the episode's final row (the last landed row while the
        episode is open); positions that hold no episode, or a step a remover retired, get HOLE.
        Sampleable iff position < bound.
        """
        rows, bounds, closed, _ = self.locate(positions)
        return rows, bounds, closed

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rows, bounds, closed, open_seq) of absolute positions: a Draw's fields (see Draw)."""
        return kernels.episode_bounds(np.ascontiguousarray(positions, dtype=np.int64), *self.bound_tables)

    def terminated_at(self, rows: np.ndarray) -> np.ndarray:
        """Whether the episode of each row ended by termination (False for open or truncated episodes)."""
        flags = self.extent_flags.take(self.row_seq.take(rows) % self.extent_slots)
        return (flags & TERMINATED) != 0

    def episode_ids_of(self, draw: Draw) -> np.ndarray:
        seqs = np.where(draw.open_seq >= 0, draw.open_seq, self.row_seq.take(draw.rows))
        return self.extent_episode_id.take(seqs % self.extent_slots)

    # ------------------------------------------------------------------ sampling
    def draw(self, batch_size: int, rng: np.random.Generator, importance_beta: float = 0.0,
             weight_floor: float | None = None) -> Draw:
        """Draws sampleable positions with the configured sampler.

        `importance_beta` is the prioritized sampler's importance-weight exponent, `weight_floor` the priority
        its weights are normalized against (None: the smallest now; see PrioritizedSampler.draw). Others
        ignore both.
        """
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
        check_importance_beta(importance_beta)
        if self.sampleable_steps == 0:
            raise FailedPrecondition(
                f"buffer {self.name!r} has no sampleable steps yet (stored_steps={self.stored_steps})"
            )
        return self.sampler.draw(self, batch_size, rng, importance_beta, weight_floor)

    def gather(self, batch_size: int, mode: BatchMode, rng: np.random.Generator, include_keys: bool = False,
               importance_beta: float = 0.0) -> tuple[Draw, dict[str, np.ndarray]]:
        """(draw, batch): indices from the sampler, columns from the mode. The callers (sample, sample_shared)
        ensure consistency and have the mode check the ring."""
        draw = self.draw(batch_size, rng, importance_beta)
        return draw, self.batch_of(draw, mode, rng, include_keys)

    def batch_of(self, draw: Draw, mode: BatchMode, rng: np.random.Generator, include_keys: bool = False
                 ) -> dict[str, np.ndarray]:
        """The batch of a draw: columns from the mode, keys and episode ids if asked, the sampler's extras."""
        batch = mode.build(self, draw, rng)
        if include_keys:
            batch["key"] = draw.positions
            batch["episode_id"] = self.episode_ids_of(draw)
        if draw.extra:
            batch.update(draw.extra)
        return batch

    def drawable(self) -> bool:
        """Whether a lock-free draw can succeed now (NotFound once this reader is closed)."""
        with self.reads:
            return self.sampler.drawable(self)

    def sample_shared(self, batch_size: int, mode: BatchMode, rng: np.random.Generator, include_keys: bool = False,
                      importance_beta: float = 0.0) -> tuple[dict[str, np.ndarray], int]:
        """A whole batch gathered without the writer's lock; returns (batch, torn draws redrawn). NotFound
        once this reader is closed; a close waits for the samples running."""
        mode.check(self)
        with self.reads:
            return self._sample_shared(batch_size, mode, rng, include_keys, importance_beta)

    def _sample_shared(self, batch_size: int, mode: BatchMode, rng: np.random.Generator, include_keys: bool,
                       importance_beta: float) -> tuple[dict[str, np.ndarray], int]:
        for torn in range(MAX_TORN_DRAWS):
            try:
                draw, batch = self.gather(batch_size, mode, rng, include_keys, importance_beta)
            except RingChanged:  # evictions emptied the range the draw read
                continue
            # Every position drawn was a step, is still live and kept its bound: the batch was read whole.
            # (A prioritized draw can also race a priority write and land on a position that just stopped
            # being a step; the sampler gives such draws a HOLE bound.)
            # The tail is read after the bounds: a row evicted and reused since the draw shows there.
            if (kernels.bounds_kept(draw.rows, draw.bounds, draw.closed, self.row_end)
                    and kernels.drawn_live(draw.positions, draw.bounds, self.tail_position())):
                return batch, torn
        raise FailedPrecondition(
            f"buffer {self.name!r}: {MAX_TORN_DRAWS} draws in a row raced with the writer (evictions, episodes moving "
            "or closing); the ring turns over faster than one batch can be gathered (raise capacity_steps)"
        )

    def close(self) -> None:
        """Unmaps a reader's view of the ring, once the samples running on it end."""
        self.reads.end(self.storage.close)
