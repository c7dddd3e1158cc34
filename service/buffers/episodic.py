"""Episodic replay: one flat ring of steps in shared memory.

Positions. Absolute positions `pos` increase forever; position `pos` lives in ring row `pos % capacity`.
An episode of L steps occupies L + 1 consecutive positions: its final observation is stored once, and
the step fields of that final row are padding.

Extents. Positions are handed out at the head in *extents*, numbered by `seq` in ring order; each live
episode owns one extent. An open episode (arriving in chunks) reserves room to grow in place; when it
outgrows its extent it moves to the head with twice the room (amortized O(1) copies per row), so every
episode stays contiguous. Reserved rows left unused, and rows an episode moved away from, are holes.
When the head needs room, the oldest extents are evicted whole, so a sample never sees a partially
overwritten episode.

Precomputed bounds. `row_end[row]` is the absolute position of the episode's final row, written once
when the episode closes, so a sample finds its bound in O(1) and never searches for boundaries. Rows of
open episodes hold OPEN and take their bound from the extent table (the last row landed so far); rows
that hold nothing hold HOLE. Every insert rewrites the bounds of the rows it reuses.

Commit order within an insert: rows first; a whole episode's extent record and its rows' `row_seq`, then
their bounds (a lock-free reader that reads a bound then finds the episode's record in place, even below a
head it read before the head moved back); an open episode's rows are marked OPEN before its extent's last
row covers them; counters, then the head, last.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from service.buffers.lifetime import Lifetime, LiveBuffer
from service.buffers.ring import (
    ALIVE,
    EPISODES,
    HEAD,
    HOLE,
    IS_OPEN,
    NEXT_SEQ,
    OPEN,
    SAMPLEABLE,
    STATE_SIZE,
    STORED,
    TAIL_POS,
    TAIL_SEQ,
    TERMINATED,
    EpisodicRing,
    shared_sampling,
    shm_name,
)
from service.dedup import DEFAULT_WINDOW, SpanDedup, select, span_offsets
from service.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted, ShortOfDraws
from service.limiters import RateLimiter, WorkerSeats, wait_on
from service.removers import DrawCounts, FifoRemover, MaxTimesSampledRemover
from service.samplers.draw import Draw
from service.samplers.kernels import REWARD_DTYPES
from service.samplers.modes import BatchMode
from service.samplers.prioritized import PrioritizedSampler
from service.samplers.uniform import UniformSampler
from service.schema import Field, check_buffer_name, check_columns, check_fields
from service.storage.shared_arrays import ArraySpec, SharedArrays


@dataclass(frozen=True)
class Spans:
    """Per-span metadata of an insert: a span is a whole episode or a chunk of an open one."""

    episode_ids: np.ndarray  # uint64
    rows: np.ndarray  # int64, rows of each span in the request's columns
    begins: np.ndarray  # bool: the span starts its episode
    ends: np.ndarray  # bool: the span's last row is the episode's final observation
    terminated: np.ndarray  # bool: for ends, terminated (else truncated)
    # int64: row index of each span's first row within its episode (service/dedup.py); None: not sent
    offsets: np.ndarray | None = None

    @classmethod
    def whole_episodes(cls, lengths: np.ndarray, episode_ids: np.ndarray, terminated: np.ndarray) -> Spans:
        ones = np.ones(len(lengths), dtype=bool)
        return cls(np.asarray(episode_ids, np.uint64), np.asarray(lengths, np.int64) + 1, ones, ones,
                   np.asarray(terminated, bool))


@dataclass(frozen=True)
class InsertResult:
    completed: int  # episodes the request's spans complete, duplicates included
    duplicate_spans: int  # spans already stored (acknowledged, not stored again)


@dataclass
class _Extent:
    """Planning record for an extent touched by an insert (open episodes keep theirs between inserts)."""

    episode_id: int
    seq: int
    start: int
    last: int  # last landed row; start - 1 before the first row lands
    reserved_end: int  # exclusive


@dataclass
class _Op:
    kind: str  # "block" (whole episodes), "open", "append", "move"
    span_lo: int  # first span of the op
    span_hi: int  # one past the last span
    row_lo: int  # first row of the op in the request's columns
    row_hi: int
    extent: _Extent | None = None  # for open/append/move: the extent after the op
    moved_from: _Extent | None = None  # for move: the extent the episode leaves
    closes: bool = False
    terminated: bool = False
    head_before: int = 0
    head_after: int = 0


class EpisodicBuffer(EpisodicRing, LiveBuffer):
    """The writer of one episodic ring: creates its shared memory, inserts, evicts, samples under a lock."""

    def __init__(
        self,
        name: str,
        instance: str,
        fields: tuple[Field, ...] | list[Field],
        capacity_steps: int,
        reward_field: str | None = None,
        sampler: UniformSampler | PrioritizedSampler | None = None,
        remover: FifoRemover | MaxTimesSampledRemover | None = None,
        limiter: RateLimiter | None = None,
        max_bytes: int | None = None,
        dedup_window: int = DEFAULT_WINDOW,
    ) -> None:
        self.name = check_buffer_name(name)
        self.fields = check_fields(fields)
        if not isinstance(capacity_steps, int | np.integer) or capacity_steps < 2:
            raise InvalidArgument(f"capacity_steps must be an integer >= 2, got {capacity_steps!r}")
        self.capacity = int(capacity_steps)
        if limiter is not None and limiter.min_size_to_sample > self.capacity - 1:
            raise InvalidArgument(
                f"rate_limiter.min_size_to_sample={limiter.min_size_to_sample} can never be reached: a buffer of "
                f"capacity_steps={self.capacity} holds at most {self.capacity - 1} sampleable steps"
            )
        self.observation_fields = tuple(f for f in self.fields if f.observation)
        self.step_fields = tuple(f for f in self.fields if not f.observation)
        if not self.observation_fields:
            raise InvalidArgument("schema: at least one field must be an observation field (one row per state)")
        by_name = {f.name: f for f in self.fields}
        if reward_field is None:  # the field named "reward", when the schema has one
            self.reward_field = "reward" if "reward" in by_name else None
        elif reward_field in by_name:
            self.reward_field = reward_field
        else:
            raise InvalidArgument(f"reward_field {reward_field!r} is not a field of the schema {sorted(by_name)}")
        if self.reward_field is not None:
            reward = by_name[self.reward_field]
            if reward.observation or reward.shape != () or reward.dtype not in REWARD_DTYPES:
                raise InvalidArgument(
                    f"reward field {self.reward_field!r} must be a scalar float32 or float64 per-step field, got "
                    f"{reward.dtype}{list(reward.shape)} observation={reward.observation}"
                )
        self.extent_slots = self.capacity // 2 + 2  # every extent spans >= 2 positions
        specs = [ArraySpec(f"field.{f.name}", f.dtype, (self.capacity, *f.shape)) for f in self.fields]
        specs += [
            ArraySpec("row.end", "int64", (self.capacity,)),
            ArraySpec("row.seq", "int64", (self.capacity,)),
            ArraySpec("extent.episode_id", "uint64", (self.extent_slots,)),
            ArraySpec("extent.start", "int64", (self.extent_slots,)),
            ArraySpec("extent.last", "int64", (self.extent_slots,)),
            ArraySpec("extent.flags", "uint8", (self.extent_slots,)),
            ArraySpec("state", "int64", (STATE_SIZE,)),
        ]
        # Sampler, remover and limiter are composed in; the first two keep per-row state next to the rows.
        sampler, remover = sampler or UniformSampler(), remover or FifoRemover()
        specs += sampler.array_specs(self.capacity) + remover.array_specs(self.capacity)
        config = {
            "fields": [[f.name, f.dtype, list(f.shape), f.observation] for f in self.fields],
            "capacity_steps": self.capacity,
            "reward_field": self.reward_field,
            "sampler": ({"kind": "prioritized", "alpha": sampler.alpha} if isinstance(sampler, PrioritizedSampler)
                        else {"kind": "uniform"}),
            "remover": ({"kind": "max_times_sampled", "max_times_sampled": remover.max_times_sampled}
                        if isinstance(remover, MaxTimesSampledRemover) else {"kind": "fifo"}),
            "rate_limiter": None if limiter is None else limiter.config(),
            "dedup_window": dedup_window,
        }
        meta = {
            "kind": self.kind,
            "name": self.name,
            "capacity": self.capacity,
            "reward_field": self.reward_field,
            "fields": config["fields"],
            # What a reader attaching by name needs to know about how this buffer is sampled.
            "components": {
                "sampler": {"kind": sampler.name},
                "remover": {"kind": config["remover"]["kind"]},
                "rate_limited": limiter is not None,
            },
            "config": config,  # everything needed to build this buffer again (crash recovery)
        }
        storage = SharedArrays.create(shm_name(instance, name), specs, meta, max_bytes)
        self._attach(storage, sampler, remover, limiter, dedup_window)
        self.row_end.fill(HOLE)
        self.row_seq.fill(-1)
        self.sampler.bind(storage.arrays)

    def _attach(self, storage: SharedArrays, sampler: UniformSampler | PrioritizedSampler,
                remover: FifoRemover | MaxTimesSampledRemover, limiter: RateLimiter | None,
                dedup_window: int) -> None:
        EpisodicRing.__init__(self, storage, sampler, remover)
        self.limiter = limiter
        self.row_bytes = sum(f.row_bytes for f in self.fields)
        self.lock = threading.RLock()  # re-entrant: describe() reads info() and component state under one hold
        self.lifetime = Lifetime(self.lock, self.name)  # every use of the arrays enters it (live())
        self.inserted = threading.Condition(self.lock)  # wakes samplers waiting for data
        self.worker_seats = WorkerSeats()  # a server's registry shares its capped seats with every buffer it holds
        self.rng = np.random.default_rng()  # used under `lock` when a request brings no seed
        self.counters: Counter[str] = Counter()
        self.samples_short_of_draws = 0  # samples waiting for steps with draws left (only inserts bring them)
        self._open: dict[int, _Extent] = {}
        self.dedup = SpanDedup(dedup_window)  # recently stored span names, used under `lock`

    def python_state(self) -> dict:
        """The writer's state that lives outside shared memory (call with `lock` held): open episodes'
        reservations, counters, limiter counts, dedup memory. Checkpoints store it beside the arrays."""
        return {
            "open": [[e.episode_id, e.seq, e.start, e.last, e.reserved_end] for e in self._open.values()],
            "counters": dict(self.counters),
            "remover_counters": dict(self.remover.counters),
            "limiter": None if self.limiter is None else self.limiter.snapshot(),
            "dedup": self.dedup.snapshot(),
        }

    def restore_python_state(self, state: dict) -> None:
        self._open = {int(e[0]): _Extent(*(int(v) for v in e)) for e in state["open"]}
        self.counters = Counter(state["counters"])
        self.remover.counters = Counter(state["remover_counters"])
        if self.limiter is not None and state["limiter"] is not None:
            self.limiter.restore(state["limiter"])
        self.dedup.restore(state["dedup"])

    def config(self) -> dict:
        """Everything needed to build this buffer again: schema, capacity and components."""
        return self.storage.meta["config"]

    @staticmethod
    def components_from_config(config: dict) -> tuple[UniformSampler | PrioritizedSampler,
                                                       FifoRemover | MaxTimesSampledRemover, RateLimiter | None]:
        sampler = (PrioritizedSampler(config["sampler"]["alpha"]) if config["sampler"]["kind"] == "prioritized"
                   else UniformSampler())
        remover = (MaxTimesSampledRemover(config["remover"]["max_times_sampled"])
                   if config["remover"]["kind"] == "max_times_sampled" else FifoRemover())
        limiter = None if config["rate_limiter"] is None else RateLimiter(**config["rate_limiter"])
        return sampler, remover, limiter

    @classmethod
    def from_config(cls, name: str, instance: str, config: dict, max_bytes: int | None = None) -> EpisodicBuffer:
        sampler, remover, limiter = cls.components_from_config(config)
        fields = tuple(Field(f, dtype, tuple(shape), observation) for f, dtype, shape, observation in config["fields"])
        return cls(name, instance, fields, int(config["capacity_steps"]), reward_field=config["reward_field"],
                   sampler=sampler, remover=remover, limiter=limiter, max_bytes=max_bytes,
                   dedup_window=int(config["dedup_window"]))

    @classmethod
    def recover(cls, header_name: str) -> EpisodicBuffer:
        """Reattaches to the segments of a writer that was killed, and repairs what an insert it was
        running left half done (see `_repair`). Raises FailedPrecondition when the segments are not a
        consistent replayd buffer; the caller then falls back to a checkpoint."""
        try:
            storage = SharedArrays.attach(header_name, readonly=False)
        except (FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(f"recover {header_name!r}: {exc}") from exc
        try:
            config = storage.meta["config"]
            sampler, remover, limiter = cls.components_from_config(config)
            buffer = cls.__new__(cls)
            buffer._attach(storage, sampler, remover, limiter, int(config["dedup_window"]))
            buffer.sampler.attach(storage.arrays)
            with buffer.lock:
                buffer._repair()
        except (KeyError, TypeError, ValueError, InvalidArgument) as exc:
            storage.close()
            raise FailedPrecondition(f"recover {header_name!r}: the header does not describe a buffer ({exc})") from exc
        except BaseException:
            storage.close()
            raise
        return buffer

    def _repair(self) -> None:
        """Makes the shared state consistent again after the writer died mid-insert.

        The committed state is what the head covers: every op writes rows, bounds and extent records, and
        moves the head last. Extents past the head belong to an interrupted op and are dropped; row bounds
        (of every row) and counters are rebuilt from the surviving extent table; an episode that an interrupted
        move left in two places keeps its newest; the sampler's leaves are recomputed for the live rows.
        """
        state, slots_total, capacity = self.state, self.extent_slots, self.capacity
        head, tail_pos = int(state[HEAD]), int(state[TAIL_POS])
        tail_seq, next_seq = int(state[TAIL_SEQ]), int(state[NEXT_SEQ])
        if not (0 <= tail_pos <= head and head - tail_pos <= capacity and 0 <= tail_seq <= next_seq
                and next_seq - tail_seq <= slots_total):
            raise FailedPrecondition(
                f"recover {self.name!r}: inconsistent ring state head={head} tail={tail_pos} extents "
                f"{tail_seq}..{next_seq}"
            )
        seqs = np.arange(tail_seq, next_seq, dtype=np.int64)
        slots = seqs % slots_total
        starts = self.extent_start[slots]
        # An eviction publishes the tail position before the first live extent: one killed in between left
        # evicted extents (starting below the tail) in the range. Finish it.
        evicted = int(np.argmin(starts < tail_pos)) if np.any(starts >= tail_pos) else len(starts)
        if evicted:
            self.extent_flags[slots[:evicted]] = 0
            tail_seq += evicted
            state[TAIL_SEQ] = tail_seq
            seqs, slots, starts = seqs[evicted:], slots[evicted:], starts[evicted:]
        committed = int(np.count_nonzero(starts < head))
        if np.any(starts[:committed] < tail_pos) or np.any(np.diff(starts[:committed]) <= 0):
            raise FailedPrecondition(f"recover {self.name!r}: extent starts are not ordered within the ring")
        self.extent_flags[slots[committed:]] = 0
        seqs, slots, starts = seqs[:committed], slots[:committed], starts[:committed]
        state[NEXT_SEQ] = tail_seq + committed
        flags = self.extent_flags[slots]
        alive = (flags & ALIVE) != 0
        is_open = alive & ((flags & IS_OPEN) != 0)
        ids = self.extent_episode_id[slots]
        # A close in place sets how the episode ended, then its rows' bounds, then its last row: one killed
        # before the last row moved leaves the first row's bound off the extent's last row. The episode is
        # still open at its old last row (the client's retry closes it).
        torn = alive & ~is_open & (self.row_end[starts % capacity] != self.extent_last[slots])
        self.extent_flags[slots[torn]] = ALIVE | IS_OPEN
        is_open |= torn
        # An interrupted move leaves an open episode in two extents, the newer one (open, or closed by the
        # move) complete: an open extent is stale when a newer live extent has its id.
        open_index, alive_index = np.flatnonzero(is_open), np.flatnonzero(alive)
        _, first = np.unique(ids[alive_index][::-1], return_index=True)
        newest = alive_index[::-1][first]
        stale = np.setdiff1d(open_index, newest)
        self.extent_flags[slots[stale]] = 0
        alive[stale] = is_open[stale] = False
        lasts = self.extent_last[slots]
        ends = np.append(starts[1:], head)  # each extent's room reaches the next extent (or the head)
        if np.any(alive & ((lasts < starts) | (lasts >= ends))):
            raise FailedPrecondition(f"recover {self.name!r}: an extent's last row lies outside its room")
        # Row bounds rebuilt from the extent table, over the whole ring: an interrupted op may have left bounds
        # past the head (a block killed before the head moved) or below the tail (an eviction killed before
        # its rows became holes), which rooms reserved later would read as steps.
        self.row_end[:] = HOLE
        self.row_seq[:] = -1
        lengths = np.where(alive, lasts - starts + 1, 0)
        positions = np.repeat(starts, lengths) + (np.arange(int(lengths.sum())) -
                                                   np.repeat(np.cumsum(lengths) - lengths, lengths))
        rows = positions % capacity
        self.row_seq[rows] = np.repeat(seqs, lengths)
        self.row_end[rows] = np.repeat(np.where(is_open, OPEN, lasts), lengths)
        state[EPISODES] = int(np.count_nonzero(alive & ~is_open))
        state[STORED] = int(lengths.sum())
        state[SAMPLEABLE] = int(np.where(alive, lasts - starts, 0).sum())
        self._open = {int(ids[i]): _Extent(int(ids[i]), int(seqs[i]), int(starts[i]), int(lasts[i]), int(ends[i]))
                      for i in np.flatnonzero(is_open)}
        self.remover.recover(self, positions)
        self.sampler.recover(self, tail_pos, head)
        closed = np.flatnonzero(alive & ~is_open)
        self.dedup.remember_closed(ids[closed], lengths[closed])
        if self.limiter is not None:
            self.limiter.recover(self.sampleable_steps)
        self.counters["recovered"] += 1

    @property
    def open_episodes(self) -> int:
        return len(self._open)

    @property
    def shared_sampling(self) -> bool:
        return shared_sampling(self.storage.meta["components"])

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

    # ------------------------------------------------------------------ insert
    def insert(self, columns: Mapping[str, np.ndarray], spans: Spans, timeout: float | None = None) -> int:
        """Appends spans all-or-nothing: every check runs before the first byte is written.

        With a rate limiter, waits up to `timeout` seconds (None: no deadline) for it to admit the insert.
        Returns the number of episodes this insert completed (spans already stored included: see
        `insert_result`).
        """
        return self.insert_result(columns, spans, timeout).completed

    def insert_result(self, columns: Mapping[str, np.ndarray], spans: Spans, timeout: float | None = None,
                      ended: threading.Event | None = None) -> InsertResult:
        """`insert`, exactly once per span name (service/dedup.py): spans this buffer already stored are
        acknowledged and counted in `duplicate_spans`, the others are stored all-or-nothing."""
        rows = check_columns(self.fields, columns, "insert")
        self._check_spans(spans, rows)
        offsets = span_offsets(spans)
        self._check_rewards(columns)
        completed = int(np.count_nonzero(spans.ends))
        with self.live():
            keep = self.dedup.screen(spans, offsets, self._landed)
            if keep.any() and self.limiter is not None:
                if not self.limiter.can_insert(self):  # a request that could never land fails now, not at its deadline
                    self._plan(select(columns, spans, offsets, keep)[1], np.flatnonzero(keep))
                self.limiter.await_insert(self, timeout, ended)
                self.check_live()
                keep = self.dedup.screen(spans, offsets, self._landed)  # the wait released the lock
            duplicates = len(keep) - int(np.count_nonzero(keep))
            duplicate_rows = int(spans.rows[~keep].sum())
            if not keep.any():
                self._count_duplicates(duplicates, duplicate_rows)
                self.counters["duplicate_requests"] += 1
                return InsertResult(completed, duplicates)
            kept = np.flatnonzero(keep)
            columns, spans, offsets = select(columns, spans, offsets, keep)
            rows = int(spans.rows.sum())
            ops = self._plan(spans, kept)  # may refuse the request: nothing counted or written before this
            self._count_duplicates(duplicates, duplicate_rows)
            for op in ops:
                self._apply(op, columns, spans)
            self.dedup.remember(spans, offsets)
            self.counters["inserted_rows"] += rows
            self.counters["inserted_spans"] += len(spans.rows)
            self.counters["inserted_episodes"] += int(np.count_nonzero(spans.ends))
            self.counters["insert_requests"] += 1
            if self.limiter is not None:
                # Items: each row that got a successor; a span that begins an episode has one row fewer.
                self.limiter.record_insert(rows - int(np.count_nonzero(spans.begins)))
            self.inserted.notify_all()
        return InsertResult(completed, duplicates)

    def _count_duplicates(self, spans: int, rows: int) -> None:
        if spans:
            self.counters["duplicate_spans"] += spans
            self.counters["duplicate_rows"] += rows

    def _landed(self, episode_id: int) -> int | None:
        """Rows landed so far of an open episode; None if it is not open."""
        extent = self._open.get(episode_id)
        return None if extent is None else extent.last - extent.start + 1

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

    def _check_spans(self, spans: Spans, rows: int) -> None:
        count = len(spans.rows)
        if count == 0:
            raise InvalidArgument("insert: no spans (episode_ids, span_rows, begins, ends, terminated are empty)")
        for label, values in (("episode_ids", spans.episode_ids), ("begins", spans.begins),
                              ("ends", spans.ends), ("terminated", spans.terminated)):
            if len(values) != count:
                raise InvalidArgument(f"insert: {label} has {len(values)} entries, span_rows has {count}")
        if np.any(spans.rows < 1):
            bad = int(np.argmax(spans.rows < 1))
            raise InvalidArgument(f"insert: span_rows[{bad}] = {int(spans.rows[bad])}, expected >= 1")
        if int(spans.rows.sum()) != rows:
            raise InvalidArgument(f"insert: span_rows sum to {int(spans.rows.sum())}, but the steps hold {rows} rows")
        whole = spans.begins & spans.ends
        # Only consecutive chunks of one open episode may share an id; a whole episode's id repeated in the
        # request would make two episodes indistinguishable (episode_id in samples, continuing chunks).
        _, inverse, counts = np.unique(spans.episode_ids, return_inverse=True, return_counts=True)
        repeated = whole & (counts[inverse] > 1)
        if repeated.any():
            bad = int(np.argmax(repeated))
            same = np.flatnonzero(spans.episode_ids == spans.episode_ids[bad])
            other = int(same[same != bad][0])
            raise InvalidArgument(
                f"insert: episode_ids[{bad}] = {int(spans.episode_ids[bad])} is a whole episode, but "
                f"episode_ids[{other}] has the same id; expected ids unique within a request"
            )
        short = whole & (spans.rows < 2)
        if short.any():
            bad = int(np.argmax(short))
            raise InvalidArgument(
                f"insert: span {bad} is a whole episode of {int(spans.rows[bad])} row; an episode needs at least "
                "2 rows (its first and final observation)"
            )
        long = spans.rows > self.capacity  # a chunk too: the ring cannot hold it whole at once
        if long.any():
            bad = int(np.argmax(long))
            what = "episode" if whole[bad] else "chunk of episode"
            raise InvalidArgument(
                f"insert: {what} {int(spans.episode_ids[bad])} has {int(spans.rows[bad])} rows, more than "
                f"capacity_steps={self.capacity}"
            )

    def _plan(self, spans: Spans, request_index: np.ndarray) -> list[_Op]:
        """Simulates the insert on metadata only; raises before anything is written. `request_index`: each
        span's index in the request as sent (duplicates were dropped), for the messages."""
        head = self.head
        # Extents starting below this are evicted once the ops so far apply (each evicts below its head_after
        # less the capacity, see _apply). Not the head's own bound: the head moves back when the head
        # episode closes and gives up unused room, and what an earlier op evicted stays evicted.
        evicted_below = head - self.capacity
        next_seq = int(self.state[NEXT_SEQ])
        touched: dict[int, _Extent] = {}  # episodes this request opened or went on with, and left open
        ended: dict[int, int] = {}  # episode id -> the span (as sent) of this request that ended it
        ops: list[_Op] = []
        whole = spans.begins & spans.ends
        row_offsets = np.concatenate([[0], np.cumsum(spans.rows)])
        i, count = 0, len(spans.rows)
        # Ops apply in order, each evicting what it needs first: a later op may evict an episode an earlier
        # one wrote, as two requests would. Only a single write may not outgrow the ring, so a run of whole
        # episodes is written in blocks of at most capacity rows.
        while i < count:
            if whole[i]:
                j = i + 1  # one episode fits (_check_spans)
                while j < count and whole[j] and row_offsets[j + 1] - row_offsets[i] <= self.capacity:
                    j += 1
                size = int(row_offsets[j] - row_offsets[i])
                ops.append(_Op("block", i, j, int(row_offsets[i]), int(row_offsets[j]),
                               head_before=head, head_after=head + size))
                head += size
                evicted_below = max(evicted_below, head - self.capacity)
                next_seq += j - i
                i = j
                continue
            episode_id = int(spans.episode_ids[i])
            sent = int(request_index[i])  # the span's index in the request as the client sent it
            k = int(spans.rows[i])
            op = _Op("open", i, i + 1, int(row_offsets[i]), int(row_offsets[i + 1]),
                     closes=bool(spans.ends[i]), terminated=bool(spans.terminated[i]), head_before=head)
            current = None if episode_id in ended else touched.get(episode_id) or self._open.get(episode_id)
            if spans.begins[i]:
                if current is not None:
                    raise InvalidArgument(f"insert: span {sent} begins episode {episode_id}, which is already open")
                reserve = min(2 * k, self.capacity)
                extent = _Extent(episode_id, next_seq, head, head + k - 1, head + reserve)
                next_seq += 1
                head += reserve
            else:
                if episode_id in ended:
                    raise InvalidArgument(f"insert: span {sent} continues episode {episode_id}, which span "
                                          f"{ended[episode_id]} of this request ended")
                if current is None:
                    raise FailedPrecondition(
                        f"insert: span {sent} continues episode {episode_id}, which is not open (never begun, "
                        "already ended, or evicted)"
                    )
                if current.start < evicted_below:
                    raise ResourceExhausted(
                        f"insert: open episode {episode_id} would be overwritten before span {sent} lands; "
                        f"capacity_steps={self.capacity} is too small for this many concurrently open episodes"
                    )
                landed = current.last - current.start + 1
                if landed + k > self.capacity:
                    raise InvalidArgument(
                        f"insert: episode {episode_id} would have {landed + k} rows, more than "
                        f"capacity_steps={self.capacity}"
                    )
                if current.last + k < current.reserved_end:
                    op.kind = "append"
                    extent = _Extent(episode_id, current.seq, current.start, current.last + k, current.reserved_end)
                elif current.reserved_end == head:
                    # Nothing was placed after it: the room grows in place (doubling), no rows are copied.
                    op.kind = "append"
                    room = max(min(2 * (landed + k), self.capacity), landed + k)
                    extent = _Extent(episode_id, current.seq, current.start, current.last + k, current.start + room)
                    head = extent.reserved_end
                else:
                    op.kind = "move"
                    op.moved_from = current
                    reserve = min(2 * (landed + k), self.capacity)
                    extent = _Extent(episode_id, next_seq, head, head + landed + k - 1, head + reserve)
                    next_seq += 1
                    head += reserve
            if op.closes:
                if extent.last - extent.start + 1 < 2:
                    raise InvalidArgument(
                        f"insert: span {sent} ends episode {episode_id} after 1 row; an episode needs at least 2 rows"
                    )
                if extent.reserved_end == head:  # the head extent gives its unused room back
                    head = extent.last + 1
                extent.reserved_end = extent.last + 1
            op.extent = extent
            op.head_after = head
            evicted_below = max(evicted_below, head - self.capacity)
            if op.closes:  # as for two requests: a later span may begin the id anew, not go on with it
                touched.pop(episode_id, None)
                ended[episode_id] = sent
            else:
                touched[episode_id] = extent
                ended.pop(episode_id, None)
            ops.append(op)
            i += 1
        return ops

    def _apply(self, op: _Op, columns: Mapping[str, np.ndarray], spans: Spans) -> None:
        if op.kind == "block":
            self._evict_before(op.head_after - self.capacity)
            self._write_block(op, columns, spans)
        elif op.kind == "open":
            self._evict_before(op.head_after - self.capacity)
            self._write_extent_rows(op, columns, at=op.extent.start, mark_from=op.extent.start, prev_sampleable=0)
        elif op.kind == "append":
            if op.head_after > op.head_before:  # the head extent grew its room: make space for it
                self._evict_before(op.head_after - self.capacity)
                # Cover the grown room now, while it holds only holes (as the unused part of a room does):
                # the extent's last row then never lies past the head, whenever the writer dies.
                self.state[HEAD] = op.head_after
            slot = op.extent.seq % self.extent_slots
            old_last = int(self.extent_last[slot])
            self._write_extent_rows(op, columns, at=old_last + 1, mark_from=old_last + 1,
                                    prev_sampleable=old_last - op.extent.start)
        else:  # move: copy the landed rows out before their old place can be evicted or reused
            old = op.moved_from
            landed = self._gather_positions(np.arange(old.start, old.last + 1, dtype=np.int64))
            # Its steps (all landed rows but the last) keep their draw counts and priorities.
            old_rows = np.arange(old.start, old.last, dtype=np.int64) % self.capacity
            carried = self.remover.state_of_rows(old_rows), self.sampler.state_of_rows(old_rows)
            self._open.pop(old.episode_id)  # moving, not lost: the eviction below must not count it
            self._evict_before(op.head_after - self.capacity)
            self._write_rows(op.extent.start, landed, 0, old.last - old.start + 1)
            self._write_extent_rows(op, columns, at=op.extent.start + old.last - old.start + 1,
                                    mark_from=op.extent.start, prev_sampleable=0)
            new_rows = (op.extent.start + np.arange(old_rows.size, dtype=np.int64)) % self.capacity
            self.remover.restore_rows(self, new_rows, carried[0])
            self.sampler.restore_rows(self, new_rows, carried[1])
            self.state[HEAD] = op.head_after
            # The old place is retired only once the new one is committed: a crash in between leaves the
            # episode alive in one place or both (recovery keeps the newest), never in neither.
            if old.seq >= int(self.state[TAIL_SEQ]):  # unless the eviction above took it already
                self._kill_extent(old)
            self.counters["moved_open_episodes"] += 1
        self.state[HEAD] = op.head_after

    def _write_block(self, op: _Op, columns: Mapping[str, np.ndarray], spans: Spans) -> None:
        head = op.head_before
        self._write_rows(head, columns, op.row_lo, op.row_hi)
        rows = spans.rows[op.span_lo:op.span_hi]
        starts = head + np.concatenate([[0], np.cumsum(rows[:-1])])
        lasts = starts + rows - 1
        seq0 = int(self.state[NEXT_SEQ])
        seqs = np.arange(seq0, seq0 + len(rows), dtype=np.int64)
        # The rows' bounds last: the head does not publish these rows to every reader, as it moves back when
        # the head episode closes and gives up unused room, so a reader may hold a head past them already.
        # One that reads a bound then finds the rows' extents (id, how they ended) in place.
        self._set_ring(self.row_seq, head, np.repeat(seqs, rows))
        slots = seqs % self.extent_slots
        self.extent_episode_id[slots] = spans.episode_ids[op.span_lo:op.span_hi]
        self.extent_start[slots] = starts
        self.extent_last[slots] = lasts
        self.extent_flags[slots] = ALIVE | np.where(spans.terminated[op.span_lo:op.span_hi], TERMINATED, 0)
        bounds = np.repeat(lasts, rows)
        self._rows_written(head, head + int(rows.sum()), bounds)
        self._set_ring(self.row_end, head, bounds)
        self.state[NEXT_SEQ] = seq0 + len(rows)
        self.state[EPISODES] += len(rows)
        self.state[SAMPLEABLE] += int(rows.sum()) - len(rows)
        self.state[STORED] += int(rows.sum())

    def _write_extent_rows(self, op: _Op, columns: Mapping[str, np.ndarray], at: int, mark_from: int,
                           prev_sampleable: int) -> None:
        """Writes a chunk at position `at`, then the bounds of rows [mark_from, last], then the extent record."""
        extent = op.extent
        self._write_rows(at, columns, op.row_lo, op.row_hi)
        slot = extent.seq % self.extent_slots
        if op.kind != "append":  # a new extent record (opened, or moved to the head)
            self.extent_episode_id[slot] = extent.episode_id
            self.extent_start[slot] = extent.start
            self.state[NEXT_SEQ] = extent.seq + 1
        marked = extent.last + 1 - mark_from
        self._set_ring(self.row_seq, mark_from, np.full(marked, extent.seq, dtype=np.int64))
        # The previous last row and the new rows but the last become steps once the last row is published.
        self._rows_written(max(extent.start, mark_from - 1), extent.last + 1, extent.last)
        if op.closes:
            # How it ended first: a reader that sees a row's final bound also sees that. Then the bounds,
            # then the extent's last row: a lock-free reader that saw a row OPEN and then this last row
            # finds the row's bound changed when it checks its batch (bounds_kept), and draws again.
            self.extent_flags[slot] = ALIVE | (TERMINATED if op.terminated else 0)
            self._set_ring(self.row_end, extent.start, np.full(extent.last + 1 - extent.start, extent.last))
            self.extent_last[slot] = extent.last
        else:
            # New rows carry OPEN before the extent's last row moves over them, so readers see them whole.
            self._set_ring(self.row_end, mark_from, np.full(marked, OPEN, dtype=np.int64))
            self.extent_last[slot] = extent.last
            self.extent_flags[slot] = ALIVE | IS_OPEN
        # Every landed row but the last has its successor, so it is sampleable.
        self.state[SAMPLEABLE] += (extent.last - extent.start) - prev_sampleable
        self.state[STORED] += marked
        if op.closes:
            self._open.pop(extent.episode_id, None)
            self.state[EPISODES] += 1
        else:
            self._open[extent.episode_id] = extent

    def _kill_extent(self, extent: _Extent) -> None:
        """Turns a moved-away extent into holes (its rows were copied to the head)."""
        slot = extent.seq % self.extent_slots
        self.extent_flags[slot] = 0
        landed = extent.last - extent.start + 1
        self._set_ring(self.row_end, extent.start, np.full(landed, HOLE, dtype=np.int64))
        self._set_ring(self.row_seq, extent.start, np.full(landed, -1, dtype=np.int64))
        self.state[SAMPLEABLE] -= landed - 1
        self.state[STORED] -= landed
        self._rows_cleared(extent.start, extent.last + 1)

    def _evict_before(self, boundary: int) -> None:
        """Evicts, oldest first, every extent that starts before `boundary` (whole episodes only)."""
        tail_seq, next_seq = int(self.state[TAIL_SEQ]), int(self.state[NEXT_SEQ])
        live = next_seq - tail_seq
        if live == 0:  # empty ring: the next extent starts at the head
            self.state[TAIL_POS] = self.head
            return
        first = tail_seq % self.extent_slots
        n = self._count_starts_before(first, live, boundary)
        if n == 0:
            return
        tail_pos = int(self.extent_start[first])
        new_tail_seq = tail_seq + n
        if new_tail_seq == next_seq:
            new_tail_pos = self.head
        else:
            new_tail_pos = int(self.extent_start[new_tail_seq % self.extent_slots])
        # Publish the new tail before touching anything of the evicted extents: a reader that saw any of
        # the changes below then also sees the tail past its positions, and draws again.
        self.state[TAIL_POS] = new_tail_pos
        self.state[TAIL_SEQ] = new_tail_seq
        slots = (tail_seq + np.arange(n)) % self.extent_slots
        flags = self.extent_flags[slots]
        alive = (flags & ALIVE) != 0
        is_open = (flags & IS_OPEN) != 0
        starts, lasts = self.extent_start[slots], self.extent_last[slots]
        self.state[EPISODES] -= int(np.count_nonzero(alive & ~is_open))
        self.state[SAMPLEABLE] -= int((lasts - starts)[alive].sum())
        self.state[STORED] -= int((lasts - starts + 1)[alive].sum())
        for episode_id in self.extent_episode_id[slots[alive & is_open]]:
            if self._open.pop(int(episode_id), None) is not None:
                self.counters["evicted_open_episodes"] += 1
        self.counters["evicted_episodes"] += int(np.count_nonzero(alive & ~is_open))
        self.extent_flags[slots] = 0
        self._set_ring(self.row_end, tail_pos, np.full(new_tail_pos - tail_pos, HOLE, dtype=np.int64))
        self._set_ring(self.row_seq, tail_pos, np.full(new_tail_pos - tail_pos, -1, dtype=np.int64))
        self._rows_cleared(tail_pos, new_tail_pos)

    def _rows_written(self, lo: int, hi: int, bounds: np.ndarray | int) -> None:
        """Positions [lo, hi) are about to get these bounds (their episode's final row, or last landed row
        while open). Called before the bounds are stored: whenever the writer dies, a step that recovery
        finds published has its sampler state (a priority) already."""
        self.remover.on_rows_written(self, lo, hi)
        self.sampler.on_rows_written(self, lo, hi, bounds)

    def _rows_cleared(self, lo: int, hi: int) -> None:
        self.remover.on_rows_cleared(self, lo, hi)
        self.sampler.on_rows_cleared(self, lo, hi)

    def _count_starts_before(self, first: int, live: int, boundary: int) -> int:
        # Extent starts increase with seq, so the ring of starts is two sorted runs.
        end = first + live
        if end <= self.extent_slots:
            return int(np.searchsorted(self.extent_start[first:end], boundary, side="left"))
        head_run = self.extent_start[first:]
        n = int(np.searchsorted(head_run, boundary, side="left"))
        if n < len(head_run):
            return n
        return n + int(np.searchsorted(self.extent_start[: end - self.extent_slots], boundary, side="left"))

    # ------------------------------------------------------------------ ring helpers
    def _ring_pieces(self, pos: int, count: int) -> list[tuple[int, int, int]]:
        """(ring_row, source_offset, length) pieces covering positions [pos, pos + count)."""
        row = pos % self.capacity
        first = min(count, self.capacity - row)
        pieces = [(row, 0, first)]
        if first < count:
            pieces.append((0, first, count - first))
        return pieces

    def _set_ring(self, array: np.ndarray, pos: int, values: np.ndarray) -> None:
        for row, offset, length in self._ring_pieces(pos, len(values)):
            array[row:row + length] = values[offset:offset + length]

    def _write_rows(self, pos: int, columns: Mapping[str, np.ndarray], lo: int, hi: int) -> None:
        for row, offset, length in self._ring_pieces(pos, hi - lo):
            for name, target in self.columns.items():
                target[row:row + length] = columns[name][lo + offset:lo + offset + length]

    def _gather_positions(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        rows = positions % self.capacity
        return {name: column[rows] for name, column in self.columns.items()}

    # ------------------------------------------------------------------ sampling
    def sample(self, batch_size: int, mode: BatchMode, rng: np.random.Generator | None = None,
               include_keys: bool = False, wait_seconds: float | None = None,
               importance_beta: float = 0.0, ended: threading.Event | None = None) -> dict[str, np.ndarray]:
        """One batch: indices from the sampler, columns from the mode, gathered under the lock.

        With `wait_seconds`, an empty buffer (or a rate limiter that holds samples back, or steps with fewer
        draws left than the batch needs) is waited on (a condition, not a spin) for that long, or until
        `ended` is set (the call was cancelled: Cancelled); without, it fails at once.
        """
        mode.check(self)  # a request this buffer can never serve fails now, not after waiting for data
        deadline = None if wait_seconds is None else time.monotonic() + wait_seconds
        rng = rng or self.rng
        with self.live():
            while True:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if self.limiter is not None:
                    self.limiter.await_sample(self, batch_size, remaining, ended)
                    self.check_live()  # await_sample may have waited (which releases the lock)
                elif remaining is not None and not self.sampler.drawable(self):
                    if not wait_on(self, lambda: self.sampler.drawable(self), remaining, ended,
                                   f"sample of buffer {self.name!r} (waiting for data)"):
                        raise DeadlineExceeded(f"buffer {self.name!r} got no step to draw within {wait_seconds:.3g}s "
                                               f"(sampleable_steps={self.sampleable_steps})")
                    self.check_live()  # the wait released the lock
                if not self.remover.retires:
                    batch = self.gather(batch_size, mode, rng, include_keys, importance_beta)[1]
                    break
                try:
                    batch = self._gather_within_draws_left(batch_size, mode, rng, include_keys, importance_beta)
                    break
                except ShortOfDraws:
                    if deadline is None:
                        raise
                inserts = self.counters["insert_requests"]
                if not wait_on(self, lambda inserts=inserts: self.counters["insert_requests"] != inserts,
                               max(deadline - time.monotonic(), 0.0), ended,
                               f"sample of buffer {self.name!r} (waiting for draws left)", self._short_of_draws):
                    raise DeadlineExceeded(
                        f"buffer {self.name!r}: its steps had fewer draws left than batch_size={batch_size} for "
                        f"{wait_seconds:.3g}s (sampleable_steps={self.sampleable_steps})")
                self.check_live()  # the wait released the lock
            self.counters["sampled_batches"] += 1
            self.counters["sampled_items"] += batch_size
            if self.limiter is not None:
                self.limiter.record_sample(batch_size)
                self.inserted.notify_all()  # `inserted` also wakes inserts the limiter holds back
        return batch

    def _short_of_draws(self, change: int) -> None:
        """A sample starts (+1) or stops (-1) waiting for draws left (with the lock held). While one waits, a
        rate limiter lets inserts run ahead of its ratio: no sample can be taken until they land, so an insert
        it held back would wait for that sample, and the sample for it."""
        self.samples_short_of_draws += change
        if change > 0:
            self.inserted.notify_all()

    def _gather_within_draws_left(self, batch_size: int, mode: BatchMode, rng: np.random.Generator,
                                  include_keys: bool, importance_beta: float) -> dict[str, np.ndarray]:
        """A batch of a buffer whose remover retires steps, drawn in rounds: each round's draws are counted
        as they are taken, and those past a step's draws left are drawn again, so that a step comes back
        at most as often as it has draws left, within the batch too. A batch its steps' draws left cannot
        fill is refused (ShortOfDraws) with every count and priority as it was."""
        parts: list[Draw] = []
        taken: list[tuple[DrawCounts, np.ndarray, object]] = []
        need = batch_size
        weight_floor = self.sampler.weight_floor()  # as before any round retired a step of the batch
        try:
            while need:
                draw = self.draw(need, rng, importance_beta, weight_floor)
                kept, retired, counts = self.remover.count_draws(self, draw.positions)
                retired_rows = retired % self.capacity
                taken.append((counts, retired_rows, self.sampler.state_of_rows(retired_rows)))
                self.sampler.on_positions_cleared(self, retired)
                parts.append(draw if kept.all() else draw.select(kept))
                need -= int(np.count_nonzero(kept))
        except FailedPrecondition as exc:  # no step left to draw
            if not taken:
                raise
            for counts, retired_rows, state in reversed(taken):
                self.sampler.restore_rows(self, retired_rows, state)
                self.remover.uncount_draws(self, counts)
            raise ShortOfDraws(
                f"sample of buffer {self.name!r}: its steps have fewer draws left than batch_size={batch_size} "
                f"(max_times_sampled={self.remover.max_times_sampled}; {exc})"
            ) from None
        draw = Draw.concatenate(parts)
        return self.batch_of(draw, mode, rng, include_keys)

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> tuple[int, int]:
        """(applied, ignored_stale): see PrioritizedSampler.update_priorities."""
        if not isinstance(self.sampler, PrioritizedSampler):
            raise FailedPrecondition(
                f"update_priorities: buffer {self.name!r} uses the {self.sampler.name} sampler, not prioritized"
            )
        with self.live():
            applied_and_ignored = self.sampler.update_priorities(self, keys, priorities)
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
