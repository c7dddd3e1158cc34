"""The insert planner on its own: from a snapshot of ring metadata and a request's spans to the ops that store
them, without shared memory."""

from __future__ import annotations

import numpy as np
import pytest

from replayd.server.buffers.planner import Extent, RingSnapshot, Spans, check_spans, plan_insert
from replayd.wire.errors import FailedPrecondition, InvalidArgument, ResourceExhausted


def spans(rows: list[int], ids: list[int], begins: list[bool], ends: list[bool]) -> Spans:
    count = len(rows)
    return Spans(np.array(ids, np.uint64), np.array(rows, np.int64), np.array(begins), np.array(ends),
                 np.zeros(count, bool))


def plan(ring: RingSnapshot, request: Spans, open_episodes: dict[int, Extent] | None = None) -> list:
    check_spans(request, int(request.rows.sum()), ring.capacity)
    return plan_insert(ring, open_episodes or {}, request, np.arange(len(request.rows)))


def test_whole_episodes_go_in_blocks_no_larger_than_the_ring() -> None:
    ops = plan(RingSnapshot(head=0, next_seq=0, capacity=100), Spans.whole_episodes(
        np.array([30, 30, 30, 50]), np.arange(4), np.ones(4, bool)))
    assert [(op.kind, op.span_lo, op.span_hi, op.head_before, op.head_after) for op in ops] == [
        ("block", 0, 3, 0, 93), ("block", 3, 4, 93, 144)]
    assert [(op.row_lo, op.row_hi) for op in ops] == [(0, 93), (93, 144)]


def test_a_first_chunk_reserves_twice_its_rows_and_later_chunks_land_in_place() -> None:
    ring = RingSnapshot(head=10, next_seq=3, capacity=1000)
    [opened] = plan(ring, spans([8], [7], [True], [False]))
    assert (opened.kind, opened.extent.start, opened.extent.last, opened.extent.reserved_end) == ("open", 10, 17, 26)
    assert opened.extent.seq == 3 and opened.head_after == 26
    [appended] = plan(RingSnapshot(26, 4, 1000), spans([5], [7], [False], [False]), {7: opened.extent})
    assert (appended.kind, appended.extent.last, appended.head_after) == ("append", 22, 26)
    [closed] = plan(RingSnapshot(26, 4, 1000), spans([2], [7], [False], [True]), {7: appended.extent})
    assert closed.closes and closed.extent.reserved_end == closed.head_after == 25  # the unused room is given back


def test_an_open_episode_that_outgrows_its_room_grows_at_the_head_or_moves() -> None:
    extent = Extent(7, seq=3, start=10, last=17, reserved_end=26)
    [grown] = plan(RingSnapshot(26, 4, 1000), spans([20], [7], [False], [False]), {7: extent})
    assert (grown.kind, grown.extent.start, grown.extent.last, grown.extent.reserved_end) == ("append", 10, 37, 66)
    [moved] = plan(RingSnapshot(40, 5, 1000), spans([20], [7], [False], [False]), {7: extent})  # another after it
    assert moved.kind == "move" and moved.moved_from is extent
    assert (moved.extent.seq, moved.extent.start, moved.extent.last, moved.head_after) == (5, 40, 67, 96)


@pytest.mark.parametrize(("request_spans", "open_episodes", "error", "message"), [
    (spans([4], [7], [False], [True]), {}, FailedPrecondition, "continues episode 7, which is not open"),
    (spans([4], [7], [True], [False]), {7: Extent(7, 0, 0, 3, 8)}, InvalidArgument, "begins episode 7, which is "
                                                                                     "already open"),
    (spans([60], [7], [False], [False]), {7: Extent(7, 0, 0, 59, 120)}, InvalidArgument, "would have 120 rows"),
    (spans([4, 4], [7, 7], [False, False], [True, False]), {7: Extent(7, 0, 0, 3, 8)}, InvalidArgument,
     "span 1 continues episode 7, which span 0 of this request ended"),
])
def test_requests_that_cannot_land_are_refused_before_any_op(request_spans: Spans, open_episodes: dict,
                                                           error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        plan(RingSnapshot(head=20, next_seq=1, capacity=100), request_spans, open_episodes)


def test_an_open_episode_the_request_itself_would_evict_is_refused() -> None:
    old = Extent(7, seq=0, start=0, last=9, reserved_end=20)
    request = Spans(np.array([1, 7], np.uint64), np.array([95, 2]), np.array([True, False]),
                    np.array([True, False]), np.array([False, False]))
    with pytest.raises(ResourceExhausted, match="open episode 7 would be overwritten before span 1 lands"):
        plan(RingSnapshot(head=20, next_seq=1, capacity=100), request, {7: old})
