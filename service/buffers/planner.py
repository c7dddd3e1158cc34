"""The insert planner: from the ring's metadata and a request's spans to the operations that store them.

Pure: it reads a snapshot of the ring's head, extent numbering and open episodes, never shared memory, and
raises before anything is written, so a refused request leaves every buffer byte as it was. The writer
(service/buffers/writer.py) applies the operations in order.

Extents. Positions are handed out at the head in extents; each live episode owns one. An open episode
(arriving in chunks) reserves room to grow in place; when it outgrows its extent it grows the room at the
head, or moves to the head with twice the room (amortized O(1) copies per row), so every episode stays
contiguous. When the head needs room, the oldest extents are evicted whole (writer.py).

Frames. The frames of compressed fields are appended at their arenas' heads in position order (arena.py):
each op's frames get their offsets here, and the bytes they take evict (FIFO, whole episodes) every extent
whose first frame they would overwrite, as rows do. An episode or chunk larger than an arena, or an open
episode that the request's bytes would overwrite, is refused here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from replayd.server.buffers.arena import fits, place
from replayd.wire.errors import FailedPrecondition, InvalidArgument, ResourceExhausted


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


@dataclass
class Extent:
    """An extent an insert touches (open episodes keep theirs between inserts)."""

    episode_id: int
    seq: int
    start: int
    last: int  # last landed row; start - 1 before the first row lands
    reserved_end: int  # exclusive
    # Per compressed field (arena): the absolute offset of its first frame, and the bytes of its landed frames.
    arena_first: tuple[int, ...] = ()
    arena_bytes: tuple[int, ...] = ()

    @property
    def landed(self) -> int:
        return self.last - self.start + 1


@dataclass
class Op:
    kind: str  # "block" (whole episodes), "open", "append", "move"
    span_lo: int  # first span of the op
    span_hi: int  # one past the last span
    row_lo: int  # first row of the op in the request's columns
    row_hi: int
    extent: Extent | None = None  # for open/append/move: the extent after the op
    moved_from: Extent | None = None  # for move: the extent the episode leaves
    closes: bool = False
    terminated: bool = False
    head_before: int = 0
    head_after: int = 0
    # Per arena: the absolute offsets of the frames the op writes (a moved episode's landed frames first, then
    # the request's), and the arena's head after them.
    frame_offsets: tuple[np.ndarray, ...] = ()
    arena_after: tuple[int, ...] = ()


@dataclass(frozen=True)
class ArenaSnapshot:
    """A compressed field's arena as the planner reads it."""

    name: str
    size: int
    head: int


@dataclass(frozen=True)
class RingSnapshot:
    """What the planner reads of the ring: its head, its next extent number, its capacity, its arenas, and the
    frame lengths of an open episode's landed rows (positions [start, start + count), per arena), which a move
    appends again."""

    head: int
    next_seq: int
    capacity: int
    arenas: tuple[ArenaSnapshot, ...] = ()
    landed_lengths: Callable[[int, int], tuple[np.ndarray, ...]] | None = None


@dataclass(frozen=True)
class FrameLengths:
    """A request's frame lengths: per arena, one per row of the request."""

    lengths: tuple[np.ndarray, ...] = ()

    def rows(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        return tuple(lengths[lo:hi] for lengths in self.lengths)


def check_frames_fit(arenas: Sequence[ArenaSnapshot], spans: Spans, frames: FrameLengths) -> None:
    """Refuses a span whose frames of some compressed field cannot fit its arena (with a frame's slack); reads
    only the arenas' sizes."""
    bounds = np.concatenate([[0], np.cumsum(spans.rows)])
    for arena, lengths in zip(arenas, frames.lengths, strict=True):
        for i in range(len(spans.rows)):
            chunk = lengths[bounds[i]:bounds[i + 1]]
            if not fits(chunk, arena.size):
                what = "episode" if spans.begins[i] and spans.ends[i] else "chunk of episode"
                raise InvalidArgument(
                    f"insert: {what} {int(spans.episode_ids[i])}: its frames of field {arena.name!r} take "
                    f"{int(chunk.sum())} bytes (and up to {int(chunk.max())} of slack), more than the field's arena "
                    f"of {arena.size} bytes holds (capacity_bytes)")


def check_spans(spans: Spans, rows: int, capacity: int) -> None:
    """Refuses span metadata that does not describe `rows` rows of whole episodes and chunks."""
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
    _check_whole_episodes(spans, capacity)


def _check_whole_episodes(spans: Spans, capacity: int) -> None:
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
    long = spans.rows > capacity  # a chunk too: the ring cannot hold it whole at once
    if long.any():
        bad = int(np.argmax(long))
        what = "episode" if whole[bad] else "chunk of episode"
        raise InvalidArgument(
            f"insert: {what} {int(spans.episode_ids[bad])} has {int(spans.rows[bad])} rows, more than "
            f"capacity_steps={capacity}"
        )


@dataclass
class _Cursor:
    """The ring as the ops planned so far leave it."""

    head: int
    next_seq: int
    # Extents starting below this are evicted once the ops so far apply (each evicts below its head_after
    # less the capacity). Not the head's own bound: the head moves back when the head episode closes and
    # gives up unused room, and what an earlier op evicted stays evicted.
    evicted_below: int
    arena_heads: list[int]
    # Per arena: extents whose first frame lies below this are evicted once the ops so far apply.
    arena_evicted_below: list[int]
    touched: dict[int, Extent] = field(default_factory=dict)  # episodes this request opened or went on with
    ended: dict[int, int] = field(default_factory=dict)  # episode id -> the span (as sent) that ended it


def plan_insert(ring: RingSnapshot, open_episodes: Mapping[int, Extent], spans: Spans,
                request_index: np.ndarray, frames: FrameLengths = FrameLengths()) -> list[Op]:
    """The ops that store `spans` (checked by check_spans and check_frames_fit); raises before anything is
    written. `request_index`: each span's index in the request as sent (duplicates were dropped), for the
    messages. `frames`: the lengths of the request's compressed frames.

    Ops apply in order, each evicting what it needs first: a later op may evict an episode an earlier one
    wrote, as two requests would. Only a single write may not outgrow the ring (or an arena), so a run of whole
    episodes is written in blocks of at most capacity rows (and arena bytes).
    """
    cursor = _Cursor(ring.head, ring.next_seq, ring.head - ring.capacity, [a.head for a in ring.arenas],
                     [a.head - a.size for a in ring.arenas])
    whole = spans.begins & spans.ends
    row_offsets = np.concatenate([[0], np.cumsum(spans.rows)])
    ops: list[Op] = []
    i, count = 0, len(spans.rows)
    while i < count:
        if whole[i]:
            j = i + 1  # one episode fits (check_spans, check_frames_fit)
            while (j < count and whole[j] and row_offsets[j + 1] - row_offsets[i] <= ring.capacity
                   and (not ring.arenas or all(fits(lengths, arena.size) for arena, lengths in zip(
                       ring.arenas, frames.rows(int(row_offsets[i]), int(row_offsets[j + 1])), strict=True)))):
                j += 1
            ops.append(_block(cursor, ring, i, j, row_offsets, frames))
            i = j
        else:
            ops.append(_chunk(cursor, ring, open_episodes, spans, i, int(request_index[i]), row_offsets, frames))
            i += 1
    return ops


def _place(cursor: _Cursor, ring: RingSnapshot, op: Op, lengths: tuple[np.ndarray, ...]) -> None:
    """Gives the op's frames (per arena) their offsets at the arenas' heads, and moves the heads past them."""
    offsets, after = [], []
    for a, (arena, frame_lengths) in enumerate(zip(ring.arenas, lengths, strict=True)):
        placed, head = place(cursor.arena_heads[a], frame_lengths, arena.size)
        offsets.append(placed)
        after.append(head)
        cursor.arena_heads[a] = head
        cursor.arena_evicted_below[a] = max(cursor.arena_evicted_below[a], head - arena.size)
    op.frame_offsets, op.arena_after = tuple(offsets), tuple(after)


def _block(cursor: _Cursor, ring: RingSnapshot, i: int, j: int, row_offsets: np.ndarray, frames: FrameLengths) -> Op:
    """Whole episodes i..j-1, written at the head in one op."""
    size = int(row_offsets[j] - row_offsets[i])
    op = Op("block", i, j, int(row_offsets[i]), int(row_offsets[j]), head_before=cursor.head,
            head_after=cursor.head + size)
    _place(cursor, ring, op, frames.rows(op.row_lo, op.row_hi))
    cursor.head += size
    cursor.evicted_below = max(cursor.evicted_below, cursor.head - ring.capacity)
    cursor.next_seq += j - i
    return op


def _chunk(cursor: _Cursor, ring: RingSnapshot, open_episodes: Mapping[int, Extent], spans: Spans, i: int,
           sent: int, row_offsets: np.ndarray, frames: FrameLengths) -> Op:
    """The op of span i, a chunk of an open episode (its first, a later one, or its last)."""
    episode_id = int(spans.episode_ids[i])
    k = int(spans.rows[i])
    op = Op("open", i, i + 1, int(row_offsets[i]), int(row_offsets[i + 1]), closes=bool(spans.ends[i]),
            terminated=bool(spans.terminated[i]), head_before=cursor.head)
    current = None if episode_id in cursor.ended else cursor.touched.get(episode_id) or open_episodes.get(episode_id)
    if spans.begins[i]:
        if current is not None:
            raise InvalidArgument(f"insert: span {sent} begins episode {episode_id}, which is already open")
        reserve = min(2 * k, ring.capacity)
        extent = Extent(episode_id, cursor.next_seq, cursor.head, cursor.head + k - 1, cursor.head + reserve)
        cursor.next_seq += 1
        cursor.head += reserve
    else:
        _check_continuation(cursor, ring, current, episode_id, sent, k)
        extent = _continue(cursor, ring, op, current, k)
    extent = _with_frames(cursor, ring, op, extent, frames.rows(op.row_lo, op.row_hi), sent)
    if op.closes:
        if extent.landed < 2:
            raise InvalidArgument(
                f"insert: span {sent} ends episode {episode_id} after 1 row; an episode needs at least 2 rows"
            )
        if extent.reserved_end == cursor.head:  # the head extent gives its unused room back
            cursor.head = extent.last + 1
        extent.reserved_end = extent.last + 1
    op.extent = extent
    op.head_after = cursor.head
    cursor.evicted_below = max(cursor.evicted_below, cursor.head - ring.capacity)
    if op.closes:  # as for two requests: a later span may begin the id anew, not go on with it
        cursor.touched.pop(episode_id, None)
        cursor.ended[episode_id] = sent
    else:
        cursor.touched[episode_id] = extent
        cursor.ended.pop(episode_id, None)
    return op


def _check_continuation(cursor: _Cursor, ring: RingSnapshot, current: Extent | None, episode_id: int, sent: int,
                        k: int) -> None:
    if episode_id in cursor.ended:
        raise InvalidArgument(f"insert: span {sent} continues episode {episode_id}, which span "
                              f"{cursor.ended[episode_id]} of this request ended")
    if current is None:
        raise FailedPrecondition(
            f"insert: span {sent} continues episode {episode_id}, which is not open (never begun, "
            "already ended, or evicted)"
        )
    if current.start < cursor.evicted_below:
        raise ResourceExhausted(
            f"insert: open episode {episode_id} would be overwritten before span {sent} lands; "
            f"capacity_steps={ring.capacity} is too small for this many concurrently open episodes"
        )
    if current.landed + k > ring.capacity:
        raise InvalidArgument(
            f"insert: episode {episode_id} would have {current.landed + k} rows, more than "
            f"capacity_steps={ring.capacity}"
        )
    for a, arena in enumerate(ring.arenas):
        if current.arena_first[a] < cursor.arena_evicted_below[a]:
            raise ResourceExhausted(
                f"insert: open episode {episode_id} would be overwritten before span {sent} lands: field "
                f"{arena.name!r}'s arena of {arena.size} bytes (capacity_bytes) is too small for this many "
                "concurrently open episodes")


def _with_frames(cursor: _Cursor, ring: RingSnapshot, op: Op, extent: Extent, lengths: tuple[np.ndarray, ...],
                 sent: int) -> Extent:
    """The extent with the op's frames placed: a new extent's (opened, moved) from their first, an appended
    chunk's after its landed ones. Refuses an episode whose frames outgrow an arena, or would overwrite their
    own first ones."""
    if not ring.arenas:
        return extent
    if op.kind == "move":  # the landed frames are appended again first
        landed = ring.landed_lengths(op.moved_from.start, op.moved_from.landed)
        lengths = tuple(np.concatenate([old, new]) for old, new in zip(landed, lengths, strict=True))
    _place(cursor, ring, op, lengths)
    firsts = tuple(int(o[0]) for o in op.frame_offsets)
    appended = tuple(int(chunk.sum()) for chunk in lengths)
    if op.kind == "append":
        firsts, appended = extent.arena_first, tuple(map(sum, zip(extent.arena_bytes, appended, strict=True)))
    for a, arena in enumerate(ring.arenas):
        if appended[a] > arena.size:
            raise InvalidArgument(f"insert: episode {extent.episode_id}'s frames of field {arena.name!r} would take "
                                  f"{appended[a]} bytes, more than its arena of {arena.size} bytes (capacity_bytes)")
        if firsts[a] < cursor.arena_evicted_below[a]:
            raise ResourceExhausted(
                f"insert: open episode {extent.episode_id} would overwrite its own frames of field {arena.name!r} "
                f"with span {sent}: its arena of {arena.size} bytes (capacity_bytes) is too small for this many "
                "concurrently open episodes")
    return replace(extent, arena_first=firsts, arena_bytes=appended)


def _continue(cursor: _Cursor, ring: RingSnapshot, op: Op, current: Extent, k: int) -> Extent:
    """The extent of an open episode after k more rows: in its room, its room grown at the head, or moved."""
    landed = current.landed
    if current.last + k < current.reserved_end:
        op.kind = "append"
        return replace(current, last=current.last + k)
    if current.reserved_end == cursor.head:
        # Nothing was placed after it: the room grows in place (doubling), no rows are copied.
        op.kind = "append"
        room = max(min(2 * (landed + k), ring.capacity), landed + k)
        extent = replace(current, last=current.last + k, reserved_end=current.start + room)
        cursor.head = extent.reserved_end
        return extent
    op.kind = "move"
    op.moved_from = current
    reserve = min(2 * (landed + k), ring.capacity)
    extent = Extent(current.episode_id, cursor.next_seq, cursor.head, cursor.head + landed + k - 1,
                    cursor.head + reserve)
    cursor.next_seq += 1
    cursor.head += reserve
    return extent
