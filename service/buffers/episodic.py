"""EpisodicBuffer: one episodic replay table, configured once with a sampler, a remover and a rate limiter.

As Reverb's Table: the components are chosen at creation (always all three; the rate limiter MinSize(1)
by default) and the buffer is then only inserted into and sampled from. It composes:

- the ring (service/buffers/ring.py): rows, bounds and extent table in shared memory;
- the writer (writer.py), which applies the insert planner's operations (planner.py) to the ring;
- the reader (reader.py): draws by the sampler and batches by a batch mode;
- crash repair (repair.py), the exactly-once memory of stored spans (service/dedup.py), and the lock
  every use of the shared memory holds.

Inserts and samples wait for each other on one condition (`inserted`, over the lock), which the waits
release; the buffer wakes it after every insert and after every sample a limiter counts.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from replayd.server import components
from replayd.server.buffers.arena import (
    ARENA_HEAD,
    ARENA_STORED,
    arena_sizes,
    arena_specs,
    rows_from_bytes,
    sizes_from_rows,
)
from replayd.server.buffers.lifetime import Lifetime, LiveBuffer
from replayd.server.buffers.planner import (
    ArenaSnapshot,
    Extent,
    FrameLengths,
    Op,
    RingSnapshot,
    Spans,
    check_frames_fit,
    check_spans,
    plan_insert,
)
from replayd.server.buffers.reader import RingReader, shared_sampling
from replayd.server.buffers.repair import repair
from replayd.server.buffers.ring import HOLE, NEXT_SEQ, SAMPLEABLE, STATE_SIZE, EpisodicRing, shm_name
from replayd.server.buffers.stacking import Shipped
from replayd.server.buffers.writer import RingWriter
from replayd.server.dedup import DEFAULT_WINDOW, SpanDedup, select, span_offsets
from replayd.server.kernels import REWARD_DTYPES
from replayd.server.limiters import MinSizeLimiter, RateLimiter
from replayd.server.modes.base import BatchMode
from replayd.server.removers import FifoRemover, Remover
from replayd.server.samplers.base import Sampler
from replayd.server.samplers.draw import Draw
from replayd.server.samplers.uniform import UniformSampler
from replayd.server.schema import Field, check_buffer_name, check_columns, check_fields
from replayd.server.storage.shared_arrays import ALIGN, ArraySpec, SharedArrays
from replayd.server.worker_seats import WorkerSeats
from replayd.wire.errors import Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, ShortOfDraws
from replayd.wire.frame_fields import CompressedFrames, compress_bound


@dataclass(frozen=True)
class InsertResult:
    completed: int  # episodes the request's spans complete, duplicates included
    duplicate_spans: int  # spans already stored (acknowledged, not stored again)


def call_ended(ended: threading.Event | None) -> bool:
    return ended is not None and ended.is_set()


def ring_specs(fields: tuple[Field, ...], capacity: int, arena_sizes: list[int]) -> list[ArraySpec]:
    """The ring's own arrays: field columns (the compressed fields' arenas instead), row bounds, the extent table
    and the state counters."""
    extent_slots = capacity // 2 + 2  # every extent spans >= 2 positions
    columns = [ArraySpec(f"field.{f.name}", f.dtype, (capacity, *f.shape)) for f in fields if not f.compressed]
    return columns + arena_specs(fields, capacity, arena_sizes) + [
        ArraySpec("row.end", "int64", (capacity,)),
        ArraySpec("row.seq", "int64", (capacity,)),
        ArraySpec("extent.episode_id", "uint64", (extent_slots,)),
        ArraySpec("extent.start", "int64", (extent_slots,)),
        ArraySpec("extent.last", "int64", (extent_slots,)),
        ArraySpec("extent.flags", "uint8", (extent_slots,)),
        ArraySpec("state", "int64", (STATE_SIZE,)),
    ]


def _table_bytes(fields: tuple[Field, ...], capacity: int, sampler: Sampler, remover: Remover) -> int:
    """Shared memory of every array of a buffer of `capacity` rows but the arenas' bytes (alignment included)."""
    specs = ring_specs(fields, capacity, [0] * sum(f.compressed for f in fields))
    return sum(spec.nbytes + ALIGN for spec in specs + sampler.array_specs(capacity) + remover.array_specs(capacity))


def ring_layout(fields: tuple[Field, ...], capacity_steps: Any, capacity_bytes: Any, sampler: Sampler,
                remover: Remover) -> tuple[int, list[int]]:
    """(rows, arena sizes) of a buffer of `capacity_steps` rows and/or `capacity_bytes` of shared memory (0: not
    given). Given bytes, the arenas take what the rows' tables leave; given rows alone, arenas hold frames that
    compress ARENA_SIZING_RATIO times; given bytes alone, rows are sized by ROW_SIZING_RATIO (arena.py)."""
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int | np.integer) or capacity_bytes < 0:
        raise InvalidArgument(f"capacity_bytes must be an integer >= 0 (0: sized by capacity_steps), got "
                              f"{capacity_bytes!r}")
    sized = isinstance(capacity_steps, int | np.integer) and not isinstance(capacity_steps, bool)
    if not (sized and (capacity_steps >= 2 or capacity_steps == 0 < capacity_bytes)):
        raise InvalidArgument(f"capacity_steps must be an integer >= 2 (or 0 with capacity_bytes > 0), got "
                              f"{capacity_steps!r}")
    capacity, budget = int(capacity_steps), int(capacity_bytes)
    if budget == 0:
        return capacity, sizes_from_rows(fields, capacity)
    compressed = [f for f in fields if f.compressed]
    least = sum(2 * compress_bound(f.compression, f.row_bytes) for f in compressed)
    if capacity == 0:
        per_row = _table_bytes(fields, 2**20, sampler, remover) / 2**20
        capacity = rows_from_bytes(fields, budget, per_row)
        while (excess := _table_bytes(fields, capacity, sampler, remover) + least - budget) > 0 and capacity > 2:
            capacity = max(2, capacity - math.ceil(excess / per_row))  # the estimate missed fixed costs
    left = budget - _table_bytes(fields, capacity, sampler, remover)
    if left < least:
        raise InvalidArgument(f"capacity_bytes={budget}: {capacity} rows take {budget - left} bytes, which leaves "
                              f"{left} for the compressed fields' frames, expected >= {least} (two frames each)")
    return capacity, arena_sizes(fields, left) if compressed else []


def check_goal_fields(fields: tuple[Field, ...], goal_fields: tuple[str, str] | None) -> tuple[str, str] | None:
    """Refuses goal fields that are not two distinct observation fields of one dtype and shape."""
    if goal_fields is None:
        return None
    by_name = {f.name: f for f in fields}
    if len(goal_fields) != 2 or goal_fields[0] == goal_fields[1]:
        raise InvalidArgument(f"goal_fields: expected two distinct field names (achieved, desired), "
                              f"got {goal_fields!r}")
    for role, name in zip(("achieved", "desired"), goal_fields, strict=True):
        if name not in by_name or not by_name[name].observation:
            raise InvalidArgument(f"goal_fields: the {role} goal {name!r} is not an observation field of the schema "
                                  f"(observation fields: {sorted(f.name for f in fields if f.observation)})")
    achieved, desired = (by_name[name] for name in goal_fields)
    for goal in (achieved, desired):
        if goal.framed:  # the relabeling kernel copies one stored goal row per transition
            raise InvalidArgument(f"goal_fields: goal field {goal.name!r} has stack={goal.stack} and compression="
                                  f"{goal.compression!r}; goals are plain observation fields (stack 1, no compression)")
    if (achieved.dtype, achieved.shape) != (desired.dtype, desired.shape):
        raise InvalidArgument(f"goal_fields: expected one dtype and shape, got {achieved.name} "
                              f"{achieved.dtype}{list(achieved.shape)} and {desired.name} "
                              f"{desired.dtype}{list(desired.shape)}")
    return (achieved.name, desired.name)


def check_schema(fields: tuple[Field, ...], capacity_steps: int, reward_field: str | None,
                 limiter: RateLimiter) -> str | None:
    """Refuses a schema, capacity or limiter the buffer could not serve; returns the reward field."""
    if limiter.min_size_to_sample > capacity_steps - 1:
        raise InvalidArgument(
            f"rate_limiter.min_size_to_sample={limiter.min_size_to_sample} can never be reached: a buffer of "
            f"capacity_steps={capacity_steps} holds at most {capacity_steps - 1} sampleable steps"
        )
    if not any(f.observation for f in fields):
        raise InvalidArgument("schema: at least one field must be an observation field (one row per state)")
    by_name = {f.name: f for f in fields}
    if reward_field is None:  # the field named "reward", when the schema has one
        return "reward" if "reward" in by_name else None
    if reward_field not in by_name:
        raise InvalidArgument(f"reward_field {reward_field!r} is not a field of the schema {sorted(by_name)}")
    reward = by_name[reward_field]
    if reward.observation or reward.shape != () or reward.dtype not in REWARD_DTYPES:
        raise InvalidArgument(
            f"reward field {reward_field!r} must be a scalar float32 or float64 per-step field, got "
            f"{reward.dtype}{list(reward.shape)} observation={reward.observation}"
        )
    return reward_field


class EpisodicBuffer(LiveBuffer):
    """The writer of one episodic ring: creates its shared memory, inserts, evicts, samples under a lock."""

    kind = EpisodicRing.kind

    def __init__(
        self,
        name: str,
        instance: str,
        fields: tuple[Field, ...] | list[Field],
        capacity_steps: int,
        reward_field: str | None = None,
        sampler: Sampler | None = None,
        remover: Remover | None = None,
        limiter: RateLimiter | None = None,
        max_bytes: int | None = None,
        dedup_window: int = DEFAULT_WINDOW,
        goal_fields: tuple[str, str] | None = None,
        capacity_bytes: int = 0,
    ) -> None:
        sampler, remover = sampler or UniformSampler(), remover or FifoRemover()
        limiter = limiter or MinSizeLimiter()
        fields = check_fields(fields)
        capacity, arenas = ring_layout(fields, capacity_steps, capacity_bytes, sampler, remover)
        reward_field = check_schema(fields, capacity, reward_field, limiter)
        goal_fields = check_goal_fields(fields, goal_fields)
        config = {
            "fields": [f.to_config() for f in fields],
            "capacity_steps": capacity,
            "capacity_bytes": int(capacity_bytes),
            "reward_field": reward_field,
            "goal_fields": None if goal_fields is None else list(goal_fields),
            "sampler": sampler.to_config(),
            "remover": remover.to_config(),
            "rate_limiter": limiter.to_config(),
            "dedup_window": dedup_window,
        }
        # `config` is everything needed to build this buffer again (crash recovery, readers attaching).
        meta = {"kind": self.kind, "name": check_buffer_name(name), "capacity": capacity,
                "reward_field": reward_field, "goal_fields": config["goal_fields"], "fields": config["fields"],
                "config": config}
        specs = ring_specs(fields, capacity, arenas) + sampler.array_specs(capacity) + remover.array_specs(capacity)
        storage = SharedArrays.create(shm_name(instance, name), specs, meta, max_bytes)
        remover.bind(storage.arrays)
        sampler.bind(storage.arrays)
        self._compose(storage, sampler, remover, limiter, dedup_window)
        self.ring.row_end.fill(HOLE)
        self.ring.row_seq.fill(-1)

    def _compose(self, storage: SharedArrays, sampler: Sampler, remover: Remover, limiter: RateLimiter,
                 dedup_window: int) -> None:
        self.ring = EpisodicRing(storage, remover.retired())
        self.name = self.ring.name
        # The arenas' sizes (heads unused), known without reading shared memory.
        self.arena_sizes = tuple(ArenaSnapshot(name, arena.size, 0) for name, arena in self.ring.arenas.items())
        self.sampler, self.remover, self.limiter = sampler, remover, limiter
        self.reader = RingReader(self.ring, sampler, limiter)
        self.counters: Counter[str] = Counter()
        self.writer = RingWriter(self.ring, sampler, remover, self.counters)
        self.lock = threading.RLock()  # re-entrant: describe() reads info() and component state under one hold
        self.lifetime = Lifetime(self.lock, self.name)  # every use of the arrays enters it (live())
        self.inserted = threading.Condition(self.lock)  # wakes samplers waiting for data
        self.worker_seats = WorkerSeats()  # a server's registry shares its capped seats with every buffer it holds
        self.rng = np.random.default_rng()  # used under `lock` when a request brings no seed
        self.samples_short_of_draws = 0  # samples waiting for steps with draws left (only inserts bring them)
        self.dedup = SpanDedup(dedup_window)  # recently stored span names, used under `lock`

    # ------------------------------------------------------------------ configuration and state
    def config(self) -> dict:
        """Everything needed to build this buffer again: schema, capacity and components."""
        return self.storage.meta["config"]

    @classmethod
    def from_config(cls, name: str, instance: str, config: dict, max_bytes: int | None = None) -> EpisodicBuffer:
        fields = tuple(Field.from_config(field) for field in config["fields"])
        return cls(name, instance, fields, int(config["capacity_steps"]), reward_field=config["reward_field"],
                   sampler=components.from_config("sampler", config["sampler"]),
                   remover=components.from_config("remover", config["remover"]),
                   limiter=components.from_config("rate_limiter", config["rate_limiter"]), max_bytes=max_bytes,
                   dedup_window=int(config["dedup_window"]),
                   goal_fields=None if config["goal_fields"] is None else tuple(config["goal_fields"]),
                   capacity_bytes=int(config["capacity_bytes"]))

    @classmethod
    def recover(cls, header_name: str) -> EpisodicBuffer:
        """Reattaches to the segments of a writer that was killed, and repairs what an insert it was
        running left half done (service/buffers/repair.py). Raises FailedPrecondition when the segments are
        not a consistent replayd buffer; the caller then falls back to a checkpoint."""
        try:
            storage = SharedArrays.attach(header_name, readonly=False)
        except (FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(f"recover {header_name!r}: {exc}") from exc
        try:
            config = storage.meta["config"]
            sampler = components.from_config("sampler", config["sampler"])
            remover = components.from_config("remover", config["remover"])
            limiter = components.from_config("rate_limiter", config["rate_limiter"])
            remover.bind(storage.arrays)
            sampler.attach(storage.arrays)
            buffer = cls.__new__(cls)
            buffer._compose(storage, sampler, remover, limiter, int(config["dedup_window"]))
            with buffer.lock:
                buffer._repair()
        except (KeyError, TypeError, ValueError) as exc:
            storage.close()
            raise FailedPrecondition(f"recover {header_name!r}: the header does not describe a buffer ({exc})") from exc
        except BaseException:
            storage.close()
            raise
        return buffer

    def _repair(self) -> None:
        repaired = repair(self.ring, self.sampler, self.remover)
        self.writer.open = repaired.open
        self.dedup.remember_closed(repaired.closed_ids, repaired.closed_lengths)
        self.limiter.recover(self.sampleable_steps)
        self.counters["recovered"] += 1

    def python_state(self) -> dict:
        """The writer's state that lives outside shared memory (call with `lock` held): open episodes'
        reservations, counters, limiter counts, dedup memory. Checkpoints store it beside the arrays."""
        return {
            "open": [[e.episode_id, e.seq, e.start, e.last, e.reserved_end, list(e.arena_first), list(e.arena_bytes)]
                     for e in self.writer.open.values()],
            "counters": dict(self.counters),
            "remover_counters": dict(self.remover.counters),
            "limiter": self.limiter.snapshot(),
            "dedup": self.dedup.snapshot(),
        }

    def restore_python_state(self, state: dict) -> None:
        self.writer.open = {int(e[0]): Extent(*(int(v) for v in e[:5]), tuple(map(int, e[5])), tuple(map(int, e[6])))
                            for e in state["open"]}
        self.counters.clear()
        self.counters.update(state["counters"])
        self.remover.counters = Counter(state["remover_counters"])
        self.limiter.restore(state["limiter"])
        self.dedup.restore(state["dedup"])

    # ------------------------------------------------------------------ what the ring holds
    @property
    def storage(self) -> SharedArrays:
        return self.ring.storage

    @property
    def capacity(self) -> int:
        return self.ring.capacity

    @property
    def fields(self) -> tuple[Field, ...]:
        return self.ring.fields

    @property
    def reward_field(self) -> str | None:
        return self.ring.reward_field

    @property
    def goal_fields(self) -> tuple[str, str] | None:
        return self.ring.goal_fields

    @property
    def row_bytes(self) -> int:
        return self.ring.row_bytes

    @property
    def head(self) -> int:
        return self.ring.head

    def tail_position(self) -> int:
        return self.ring.tail_position()

    @property
    def sampleable_steps(self) -> int:
        return self.ring.sampleable_steps

    @property
    def stored_steps(self) -> int:
        return self.ring.stored_steps

    @property
    def episodes(self) -> int:
        return self.ring.episodes

    @property
    def open_episodes(self) -> int:
        return len(self.writer.open)

    @property
    def shared_sampling(self) -> bool:
        """Whether other processes may sample this buffer lock-free (sampling changes nothing)."""
        return shared_sampling(self.config())

    def info(self) -> dict:
        with self.live():
            return {
                "name": self.name,
                "kind": self.kind,
                "capacity_steps": self.capacity,
                "bytes": self.storage.nbytes,
                "shm_name": self.storage.header_name,
                "stored_steps": self.stored_steps,
                "sampleable_steps": self.sampleable_steps,
                "episodes": self.episodes,
                "open_episodes": self.open_episodes,
                "counters": dict(self.counters),
            }

    def frame_stats(self) -> dict[str, dict[str, float]]:
        """Per compressed field (call inside `live()`): the bytes of its stored frames, its arena's size, and the
        compression ratio of what is stored (raw frame bytes over stored bytes; 0 while nothing is stored)."""
        stats = {}
        for name, arena in self.ring.arenas.items():
            stored = int(arena.state[ARENA_STORED])
            raw = self.stored_steps * arena.field.row_bytes
            stats[name] = {"stored_bytes": float(stored), "arena_bytes": float(arena.size),
                           "compression_ratio": raw / stored if stored else 0.0}
        return stats

    def component_counters(self) -> dict[str, float]:
        """The components' counters, prefixed by their role (call inside `live()`)."""
        return ({f"remover.{k}": float(v) for k, v in self.remover.counters.items()}
                | {f"{self.sampler.name}.{k}": float(v) for k, v in self.sampler.counters().items()}
                | {k: float(v) for k, v in self.limiter.counters().items()})

    # ------------------------------------------------------------------ waiting
    def _wait_on(self, ready: Callable[[], bool], timeout: float | None, ended: threading.Event | None, what: str,
                 waiting: Callable[[int], None] | None = None) -> bool:
        """Waits (releasing the lock, in a wait seat) until `ready()`, the buffer closes or `ended` is set (the
        call was cancelled: Cancelled). False: `timeout` passed first. `waiting(+1)` / `waiting(-1)` bracket
        the wait itself. The caller checks the lifetime before it touches the arrays again."""
        with self.worker_seats.wait_seat(what):
            if waiting is not None:
                waiting(1)
            try:
                ok = self.inserted.wait_for(lambda: self.closed or call_ended(ended) or ready(), timeout=timeout)
            finally:
                if waiting is not None:
                    waiting(-1)  # wait_for returns (or raises) with the lock held again
        if not self.closed and call_ended(ended) and not ready():
            raise Cancelled(f"{what}: the call ended while it waited")
        return ok

    def _limiter_wait(self, side: str) -> Callable[[int], None]:
        """The limiter's held-back gauge and wait counts, for one wait."""
        since = time.monotonic()
        return lambda change: self.limiter.waiting(side, change, time.monotonic() - since if change < 0 else 0.0)

    def _insert_allowed(self) -> bool:
        return self.limiter.insert_allowed(self.sampleable_steps, self.samples_short_of_draws > 0)

    def _await_insert(self, timeout: float | None, ended: threading.Event | None) -> None:
        """Waits until the rate limiter admits an insert; None = no deadline."""
        what = f"insert on buffer {self.name!r} (held back by its rate limiter)"
        if not self._wait_on(self._insert_allowed, timeout, ended, what, self._limiter_wait("insert")):
            raise DeadlineExceeded(
                f"insert: rate limiter of buffer {self.name!r} kept the insert waiting past its deadline "
                f"({timeout:.3g}s): {self.limiter.insert_blocked_reason()}"
            )
        self.check_live()

    def _held_back(self) -> str:
        size = self.sampleable_steps
        if not self.limiter.sample_allowed(size, 1):
            return self.limiter.blocked_reason(size)
        if not self.sampler.drawable(self.ring):
            return f"none of its {size} sampleable steps can be drawn (all priorities 0)"
        return self.limiter.blocked_reason(size)

    def _await_sample(self, batch_size: int, deadline: float | None, wait_seconds: float | None,
                      ended: threading.Event | None) -> None:
        """Returns once a sample of `batch_size` may draw, or at once without a deadline (the draw then
        says what it lacks). A sample the limiter alone holds back (it would be held back with a step to
        draw) waits in the limiter's counts; one that waits for a step to draw, for data."""
        limiter, reader = self.limiter, self.reader
        limiter.check_batch(batch_size, self.name)
        if reader.ready(batch_size):
            return
        held_by_limiter = not limiter.sample_allowed(max(self.sampleable_steps, 1), batch_size)
        if deadline is None:
            if held_by_limiter:
                raise FailedPrecondition(f"sample: rate limiter of buffer {self.name!r} blocks it: {self._held_back()}")
            return
        remaining = max(deadline - time.monotonic(), 0.0)
        ready = lambda: reader.ready(batch_size)  # noqa: E731
        if held_by_limiter:
            what = f"sample on buffer {self.name!r} (held back by its rate limiter)"
            if not self._wait_on(ready, remaining, ended, what, self._limiter_wait("sample")):
                raise DeadlineExceeded(f"sample: rate limiter of buffer {self.name!r} kept the sample waiting past "
                                       f"its deadline ({remaining:.3g}s): {self._held_back()}")
        elif not self._wait_on(ready, remaining, ended, f"sample of buffer {self.name!r} (waiting for data)"):
            raise DeadlineExceeded(f"buffer {self.name!r} got no step to draw within {wait_seconds:.3g}s "
                                   f"(sampleable_steps={self.sampleable_steps})")
        self.check_live()

    # ------------------------------------------------------------------ insert
    def insert(self, columns: Mapping[str, np.ndarray], spans: Spans, timeout: float | None = None) -> int:
        """Appends spans all-or-nothing: every check runs before the first byte is written.

        Waits up to `timeout` seconds (None: no deadline) for the rate limiter to admit the insert.
        Returns the number of episodes this insert completed (spans already stored included: see
        `insert_result`).
        """
        return self.insert_result(columns, spans, timeout).completed

    def insert_result(self, columns: Mapping[str, np.ndarray | CompressedFrames], spans: Spans,
                      timeout: float | None = None, ended: threading.Event | None = None) -> InsertResult:
        """`insert`, exactly once per span name (service/dedup.py): spans this buffer already stored are
        acknowledged and counted in `duplicate_spans`, the others are stored all-or-nothing. Compressed fields
        come as CompressedFrames (each frame checked here, before the lock is taken)."""
        rows = check_columns(self.fields, columns, "insert")
        check_spans(spans, rows, self.capacity)
        # Arena sizes only: shared memory is read inside live() (a delete may unmap it before then).
        check_frames_fit(self.arena_sizes, spans, self._frame_lengths(columns))
        offsets = span_offsets(spans)
        self._check_rewards(columns)
        completed = int(np.count_nonzero(spans.ends))
        with self.live():
            keep = self.dedup.screen(spans, offsets, self.writer_landed)
            if keep.any() and not self._insert_allowed():
                self._plan(*select(columns, spans, offsets, keep)[:2], np.flatnonzero(keep))  # could it ever land?
                self._await_insert(timeout, ended)
                keep = self.dedup.screen(spans, offsets, self.writer_landed)  # the wait released the lock
            duplicates = len(keep) - int(np.count_nonzero(keep))
            duplicate_rows = int(spans.rows[~keep].sum())
            if not keep.any():
                self._count_duplicates(duplicates, duplicate_rows)
                self.counters["duplicate_requests"] += 1
                return InsertResult(completed, duplicates)
            kept = np.flatnonzero(keep)
            columns, spans, offsets = select(columns, spans, offsets, keep)
            ops = self._plan(columns, spans, kept)  # may refuse the request: nothing counted or written before this
            self._count_duplicates(duplicates, duplicate_rows)
            for op in ops:
                self.writer.apply(op, columns, spans)
            self.dedup.remember(spans, offsets)
            self._count_insert(spans)
        return InsertResult(completed, duplicates)

    def _plan(self, columns: Mapping[str, np.ndarray | CompressedFrames], spans: Spans,
              request_index: np.ndarray) -> list[Op]:
        return plan_insert(self._snapshot(), self.writer.open, spans, request_index, self._frame_lengths(columns))

    def _snapshot(self) -> RingSnapshot:
        """The ring's metadata the planner reads (the arenas' heads, and their frame lengths for moves)."""
        arenas = tuple(ArenaSnapshot(name, arena.size, int(arena.state[ARENA_HEAD]))
                       for name, arena in self.ring.arenas.items())
        return RingSnapshot(self.head, int(self.ring.state[NEXT_SEQ]), self.capacity, arenas, self._landed_lengths)

    def _frame_lengths(self, columns: Mapping[str, np.ndarray | CompressedFrames]) -> FrameLengths:
        return FrameLengths(tuple(columns[name].lengths for name in self.ring.arenas))

    def _landed_lengths(self, start: int, count: int) -> tuple[np.ndarray, ...]:
        rows = np.arange(start, start + count) % self.capacity
        return tuple(arena.length[rows].astype(np.int64) for arena in self.ring.arenas.values())

    def _count_insert(self, spans: Spans) -> None:
        rows = int(spans.rows.sum())
        self.counters["inserted_rows"] += rows
        self.counters["inserted_spans"] += len(spans.rows)
        self.counters["inserted_episodes"] += int(np.count_nonzero(spans.ends))
        self.counters["insert_requests"] += 1
        # Items: each row that got a successor; a span that begins an episode has one row fewer.
        self.limiter.record_insert(rows - int(np.count_nonzero(spans.begins)))
        self.inserted.notify_all()

    def writer_landed(self, episode_id: int) -> int | None:
        """Rows landed so far of an open episode; None if it is not open."""
        extent = self.writer.open.get(episode_id)
        return None if extent is None else extent.landed

    def _count_duplicates(self, spans: int, rows: int) -> None:
        if spans:
            self.counters["duplicate_spans"] += spans
            self.counters["duplicate_rows"] += rows

    def _check_rewards(self, columns: Mapping[str, np.ndarray]) -> None:
        # Stored data is otherwise kept as the env produced it, but n-step returns sum rewards: one NaN or
        # inf would poison every return whose window covers it, padding rows included (they are summed
        # with weight 0, and 0 * inf is NaN).
        if self.reward_field is None:
            return
        finite = np.isfinite(columns[self.reward_field])
        if not finite.all():
            bad = int(np.argmin(finite))
            raise InvalidArgument(
                f"insert: field {self.reward_field!r} row {bad} is {columns[self.reward_field][bad]}, expected a "
                "finite reward"
            )

    # ------------------------------------------------------------------ sampling
    def draw(self, batch_size: int, rng: np.random.Generator, importance_beta: float = 0.0,
             weight_floor: float | None = None, mode: BatchMode | None = None) -> Draw:
        """Sampleable positions from the sampler (see RingReader.draw); call inside `live()`."""
        return self.reader.draw(batch_size, rng, importance_beta, weight_floor, mode)

    def sample(self, batch_size: int, mode: BatchMode, rng: np.random.Generator | None = None,
               include_keys: bool = False, wait_seconds: float | None = None,
               importance_beta: float = 0.0, ended: threading.Event | None = None,
               shipped: list[Shipped] | None = None) -> dict[str, np.ndarray]:
        """One batch: indices from the sampler, columns from the mode, gathered under the lock. `shipped`:
        where compressed fields' frames go compressed (decompress="client": BatchMode.gather).

        With `wait_seconds`, an empty buffer (or a rate limiter that holds samples back, or steps with fewer
        draws left than the batch needs) is waited on (a condition, not a spin) for that long, or until
        `ended` is set (the call was cancelled: Cancelled); without, it fails at once.
        """
        mode.check(self.ring)  # a request this buffer can never serve fails now, not after waiting for data
        deadline = None if wait_seconds is None else time.monotonic() + wait_seconds
        rng = rng or self.rng
        with self.live():
            while True:
                self._await_sample(batch_size, deadline, wait_seconds, ended)
                if not self.remover.retires:
                    batch = self.reader.gather(batch_size, mode, rng, include_keys, importance_beta, shipped)[1]
                    break
                try:
                    batch = self._gather_within_draws_left(batch_size, mode, rng, include_keys, importance_beta,
                                                           shipped)
                    break
                except ShortOfDraws:
                    if deadline is None:
                        raise
                self._await_draws_left(batch_size, deadline, wait_seconds, ended)
            self.counters["sampled_batches"] += 1
            self.counters["sampled_items"] += batch_size
            self.limiter.record_sample(batch_size)
            if self.limiter.samples_change_state:
                self.inserted.notify_all()  # `inserted` also wakes inserts the limiter holds back
        return batch

    def _await_draws_left(self, batch_size: int, deadline: float, wait_seconds: float,
                          ended: threading.Event | None) -> None:
        """Waits for the next insert: only inserts bring steps with draws left."""
        inserts = self.counters["insert_requests"]
        if not self._wait_on(lambda: self.counters["insert_requests"] != inserts,
                             max(deadline - time.monotonic(), 0.0), ended,
                             f"sample of buffer {self.name!r} (waiting for draws left)", self._short_of_draws):
            raise DeadlineExceeded(
                f"buffer {self.name!r}: its steps had fewer draws left than batch_size={batch_size} for "
                f"{wait_seconds:.3g}s (sampleable_steps={self.sampleable_steps})")
        self.check_live()

    def _short_of_draws(self, change: int) -> None:
        """A sample starts (+1) or stops (-1) waiting for draws left (with the lock held). While one waits, a
        rate limiter lets inserts run ahead of its ratio: no sample can be taken until they land, so an insert
        it held back would wait for that sample, and the sample for it."""
        self.samples_short_of_draws += change
        if change > 0:
            self.inserted.notify_all()

    def _gather_within_draws_left(self, batch_size: int, mode: BatchMode, rng: np.random.Generator,
                                  include_keys: bool, importance_beta: float,
                                  shipped: list[Shipped] | None) -> dict[str, np.ndarray]:
        """A batch of a buffer whose remover retires steps, drawn in rounds: each round's draws are counted
        as they are taken, and those past a step's draws left are drawn again, so that a step comes back
        at most as often as it has draws left, within the batch too. A batch its steps' draws left cannot
        fill is refused (ShortOfDraws) with every count and priority as it was."""
        parts: list[Draw] = []
        taken: list[tuple[Any, np.ndarray, object]] = []
        need = batch_size
        weight_floor = self.sampler.weight_floor()  # as before any round retired a step of the batch
        try:
            while need:
                draw = self.draw(need, rng, importance_beta, weight_floor, mode)
                counted = self.remover.count_draws(self.ring, draw.positions)
                self.ring.state[SAMPLEABLE] -= counted.retired.size
                retired_rows = counted.retired % self.capacity
                taken.append((counted.counts, retired_rows, self.sampler.state_of_rows(retired_rows)))
                self.sampler.on_positions_cleared(self.ring, counted.retired)
                parts.append(draw if counted.kept.all() else draw.select(counted.kept))
                need -= int(np.count_nonzero(counted.kept))
        except FailedPrecondition as exc:  # no step left to draw
            if not taken:
                raise
            for counts, retired_rows, state in reversed(taken):
                self.sampler.restore_rows(self.ring, retired_rows, state)
                self.remover.uncount_draws(counts)
                self.ring.state[SAMPLEABLE] += counts.retired
            raise ShortOfDraws(
                f"sample of buffer {self.name!r}: its steps have fewer draws left than batch_size={batch_size} "
                f"({self.remover.to_config()}; {exc})"
            ) from None
        return self.reader.batch_of(Draw.concatenate(parts), mode, rng, include_keys, shipped)

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> tuple[int, int]:
        """(applied, ignored_stale): see PrioritizedSampler.update_priorities."""
        with self.live():
            applied_and_ignored = self.sampler.update_priorities(self.ring, keys, priorities)
            self.inserted.notify_all()  # a sample waiting for a positive priority may go on now
            return applied_and_ignored

    # ------------------------------------------------------------------ lifetime
    def wake_waiters(self) -> None:
        """Wakes the calls waiting on this buffer to check their conditions again (one may have ended)."""
        with self.lock:
            self.inserted.notify_all()

    def check_live(self) -> None:
        """For code that waited on `inserted` inside `with self.live():` (the wait released the lock)."""
        self.lifetime.check()

    def close(self, unlink: bool = True) -> None:
        """Waits for the call holding the lock (an insert, a gather), wakes waiting calls (they raise
        NOT_FOUND) and unmaps the arrays. Readers in other processes keep their own mappings."""

        def release() -> None:
            self.inserted.notify_all()
            self.storage.close()
            if unlink:
                self.storage.unlink()

        self.lifetime.end(release)
