"""Exactly-once inserts: which spans of an insert request an episodic buffer already stored.

A span is named by (episode id, row index of its first row within its episode): a whole episode is
(id, 0), a chunk of an open episode (id, rows landed before it). Clients retry a failed insert stream
whole, so a request may repeat spans the server already stored; those are acknowledged, counted, and not
stored again.

What is remembered: the last `window` stored span names (with their row counts) in insertion order, and,
for open episodes, the rows landed so far (which the buffer's extent table knows). A span is a duplicate
when its name is remembered with the same rows, or when it lies inside the landed rows of its open
episode. A span that starts inside landed rows but reaches past them, or that reuses a remembered name
with other rows, is rejected ("overlaps"); a continuing chunk that starts past the landed rows is
rejected too (a chunk before it is missing). A whole episode retried after `window` newer spans were
stored is no longer recognized and is stored again.

The caller holds the buffer's lock across `screen`, the insert, and `remember`, so that concurrent
requests carrying the same spans store them once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from replayd.wire.errors import InvalidArgument
from replayd.wire.frame_fields import CompressedFrames

if TYPE_CHECKING:
    from replayd.server.buffers.planner import Spans

DEFAULT_WINDOW = 65_536
UNKNOWN = -1  # offset of a span inserted without offsets: never deduplicated
_CLOSED = -2  # local marker in `screen`: the episode was closed by an earlier span of the request
# The offset under which a recovered buffer remembers a closed episode whole (remember_closed): how its spans
# were chunked is not known, so any span within its rows is a duplicate, one at offset 0 included.
RECOVERED_WHOLE = -3


def span_offsets(spans: Spans) -> np.ndarray:
    """Validated offsets of every span; without `spans.offsets` (an in-process insert, or a request without
    span_offsets) every span is UNKNOWN: stored as sent, never deduplicated."""
    count = len(spans.rows)
    if spans.offsets is None:
        return np.full(count, UNKNOWN, dtype=np.int64)
    offsets = np.asarray(spans.offsets, dtype=np.int64)
    if len(offsets) != count:
        raise InvalidArgument(f"insert: span_offsets has {len(offsets)} entries, span_rows has {count}")
    if np.any(offsets < 0):
        bad = int(np.argmax(offsets < 0))
        raise InvalidArgument(f"insert: span_offsets[{bad}] = {int(offsets[bad])}, expected >= 0")
    wrong = spans.begins & (offsets != 0)
    if wrong.any():
        bad = int(np.argmax(wrong))
        raise InvalidArgument(
            f"insert: span {bad} begins its episode, so span_offsets[{bad}] must be 0, got {int(offsets[bad])}"
        )
    return offsets


class SpanDedup:
    """The recently stored span names of one buffer (not thread-safe: used under the buffer's lock)."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 0:
            raise ValueError(f"dedup window must be >= 0, got {window}")
        self.window = window
        self._recent: OrderedDict[tuple[int, int], int] = OrderedDict()  # (episode id, offset) -> rows

    def __len__(self) -> int:
        return len(self._recent)

    def screen(self, spans: Spans, offsets: np.ndarray, landed: Callable[[int], int | None]) -> np.ndarray:
        """A mask of the spans not stored yet. `landed(episode_id)`: rows landed of an open episode, or None.

        Raises InvalidArgument for a span that overlaps stored rows without repeating them.
        """
        count = len(spans.rows)
        new = np.ones(count, dtype=bool)
        local: dict[int, int] = {}  # episode -> rows landed once the request's earlier new spans land
        for i in range(count):
            offset = int(offsets[i])
            episode_id = int(spans.episode_ids[i])
            rows = int(spans.rows[i])
            if offset == UNKNOWN:
                local.pop(episode_id, None)
                continue
            remembered = self._recent.get((episode_id, offset))
            if remembered is None and episode_id not in local and landed(episode_id) is None:
                # A recovered buffer remembers its closed episodes whole (remember_closed): a retried chunk
                # of one lies within them.
                whole = self._recent.get((episode_id, RECOVERED_WHOLE))
                if whole is not None and offset + rows <= whole:
                    new[i] = False
                    continue
            if remembered is not None:
                if remembered != rows:
                    raise InvalidArgument(
                        f"insert: span {i} (episode {episode_id}, rows {offset}..{offset + rows - 1}) overlaps a "
                        f"stored span of {remembered} rows at the same offset"
                    )
                new[i] = False
                continue
            base = local[episode_id] if episode_id in local else landed(episode_id)
            if base is not None and base != _CLOSED:
                if offset + rows <= base:
                    new[i] = False
                    continue
                if offset < base:
                    raise InvalidArgument(
                        f"insert: span {i} (episode {episode_id}, rows {offset}..{offset + rows - 1}) overlaps "
                        f"the {base} rows already stored for that open episode"
                    )
                if offset > base and not spans.begins[i]:
                    raise InvalidArgument(
                        f"insert: span {i} continues episode {episode_id} at row {offset}, but {base} rows of it "
                        f"are stored; expected span_offsets[{i}] = {base} (a chunk is missing)"
                    )
            local[episode_id] = _CLOSED if spans.ends[i] else offset + rows
        return new

    def snapshot(self) -> list[list[int]]:
        return [[episode_id, offset, rows] for (episode_id, offset), rows in self._recent.items()]

    def restore(self, entries: list[list[int]]) -> None:
        self._recent = OrderedDict(((int(e), int(o)), int(r)) for e, o, r in entries)

    def remember_closed(self, episode_ids: np.ndarray, rows: np.ndarray) -> None:
        """Remembers stored whole episodes (a recovered buffer rebuilds its memory from its extents, which do
        not say how their episodes were chunked: a span of a remembered whole episode that lies within its rows
        is stored)."""
        for episode_id, count in zip(episode_ids.tolist(), rows.tolist(), strict=True):
            self._recent[(int(episode_id), RECOVERED_WHOLE)] = int(count)
        while len(self._recent) > self.window:
            self._recent.popitem(last=False)

    def remember(self, spans: Spans, offsets: np.ndarray) -> None:
        """Records stored spans (call after the insert succeeded, still under the lock)."""
        if self.window == 0:
            return
        recent = self._recent
        for episode_id, offset, rows in zip(spans.episode_ids.tolist(), offsets.tolist(), spans.rows.tolist(),
                                            strict=True):
            if offset == UNKNOWN:
                continue
            recent[(episode_id, offset)] = rows
            recent.move_to_end((episode_id, offset))
        while len(recent) > self.window:
            recent.popitem(last=False)


def select(columns: Mapping[str, np.ndarray | CompressedFrames], spans: Spans, offsets: np.ndarray,
           keep: np.ndarray) -> tuple[dict[str, np.ndarray | CompressedFrames], Spans, np.ndarray]:
    """The kept spans, their rows of `columns`, and their offsets (no copy when every span is kept)."""
    if keep.all():
        return dict(columns), spans, offsets
    rows = np.repeat(keep, spans.rows)
    kept = replace(spans, episode_ids=spans.episode_ids[keep], rows=spans.rows[keep], begins=spans.begins[keep],
                   ends=spans.ends[keep], terminated=spans.terminated[keep],
                   offsets=None if spans.offsets is None else np.asarray(spans.offsets)[keep])
    return ({name: column[rows] if isinstance(column, CompressedFrames) else np.asarray(column)[rows]
             for name, column in columns.items()}, kept, offsets[keep])
