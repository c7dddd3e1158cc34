"""Deterministic interleavings of a lock-free reader's steps with the writer's stores.

Each test runs the reader's loads by hand between two of the writer's stores (a hook on the writer's
store helper, or on the reader's read of the head), in an order that two processes on x86 can produce,
and then runs the reader's own checks (bounds_kept, then drawn_live against a fresh tail). A batch that
passes both checks must be whole.
"""

from __future__ import annotations

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.buffers.reader import RingReader
from replayd.server.buffers.ring import HEAD, EpisodicRing
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.samplers.prioritized import PrioritizedSampler
from tests.conftest import TEST_INSTANCE
from tests.test_lock_free_reads import FIELDS

GAMMA = 0.9
E1, E2 = 111, 222


def rows_of(episode: int, lo: int, hi: int) -> dict[str, np.ndarray]:
    t = np.arange(lo, hi, dtype=np.float64)
    return {"obs": np.stack([np.full(hi - lo, episode, np.float64), t, t], axis=1), "reward": np.ones(hi - lo)}


def chunk(episode: int, lo: int, hi: int, begins: bool, ends: bool, terminated: bool = False):
    return rows_of(episode, lo, hi), Spans(np.array([episode], np.uint64), np.array([hi - lo]), np.array([begins]),
                                          np.array([ends]), np.array([terminated]))


def passes_checks(ring: EpisodicRing, draw) -> bool:
    """The reader's acceptance test, exactly as RingReader._sample_shared runs it (bounds, then tail)."""
    return bool(kernels.bounds_kept(draw.rows, draw.bounds, draw.closed, ring.row_end)
                and kernels.drawn_live(draw.positions, draw.bounds, ring.tail_position()))


def test_a_block_written_below_a_head_that_moved_back_is_read_whole_or_not_at_all() -> None:
    """Closing the head episode gives its unused room back: HEAD moves back (planner.py, `cursor.head =
    extent.last + 1`). A whole episode inserted next lands on positions below the HEAD a reader read a moment
    before, so HEAD does not publish its rows to that reader: the rows' bounds must, stored after their
    row_seq and extent record. The reader draws with its old HEAD at every point between the writer's stores
    of the block (and after them, before the new HEAD); each batch its checks accept must be right."""
    writer = EpisodicBuffer("back", f"{TEST_INSTANCE}back", FIELDS, 16)
    reader = None
    try:
        reader = RingReader.attach(writer.storage.header_name)
        writer.insert(*chunk(E1, 0, 4, begins=True, ends=False))  # rows 0..3 landed, room [0, 8)
        assert writer.head == 8
        stale = reader.ring.state.copy()  # the reader's draw reads tail, head (8) and sampleable_steps
        writer.insert(*chunk(E1, 4, 5, begins=False, ends=True, terminated=True))  # closes at 4: head 8 -> 5
        assert writer.head == 5
        mode, rng, reads = TransitionsMode(n_step=1, gamma=GAMMA), np.random.default_rng(0), []

        def read_with_stale_head() -> None:
            live_state, reader.ring.state = reader.ring.state, stale
            try:
                draw = reader.draw(64, rng)  # the draw with the head it read before the close
            finally:
                reader.ring.state = live_state
            reads.append((draw, reader.batch_of(draw, mode, rng, include_keys=True)))

        set_ring, rows_written = writer.writer.set_ring, writer.writer._rows_written

        def store(array: np.ndarray, pos: int, values: np.ndarray) -> None:  # reads before and after each
            read_with_stale_head()
            set_ring(array, pos, values)
            read_with_stale_head()  # after the last: every store of the block done, the new head not yet

        def written(lo: int, hi: int, bounds: np.ndarray | int) -> None:  # the priorities, before the bounds
            read_with_stale_head()
            rows_written(lo, hi, bounds)

        writer.writer.set_ring, writer.writer._rows_written = store, written
        # E2: 2 steps, terminated, at positions 5, 6, 7 (final row 7): 5 and 6 lie below the head 8 read above.
        writer.insert(rows_of(E2, 0, 3), Spans.whole_episodes(np.array([2]), np.array([E2]), np.array([True])))
        del writer.writer.set_ring, writer.writer._rows_written
        assert len(reads) >= 3
        e2_seen = False
        for draw, batch in reads:
            if not passes_checks(reader.ring, draw):  # checked after the writer finished, as the reader would
                continue
            of_e2 = batch["obs"][:, 0] == E2
            e2_seen |= bool(of_e2.any())
            assert np.all(batch["episode_id"][of_e2] == E2)
            last_step = of_e2 & (batch["obs"][:, 1] == 1)  # E2's transition 1 -> 2 ends it by termination
            assert np.all(batch["terminated"][last_step]) and not np.any(batch["truncated"][last_step])
            assert np.all(batch["bootstrap_discount"][last_step] == 0)
        assert e2_seen  # the draw after the bounds landed on E2's positions 5, 6
    finally:
        if reader is not None:
            reader.close()
        writer.close()


def test_a_prioritized_draw_reports_the_probability_of_the_step_its_row_held_before() -> None:
    """PrioritizedSampler.draw reads the leaf value (its probability and weight), then the head (which maps
    the leaf to a position). An eviction plus insert in between reuses the row: the returned item is the new
    step, live and whole, but its probability and weight are those of the evicted step."""
    writer = EpisodicBuffer("prio", f"{TEST_INSTANCE}prio", FIELDS, 16, sampler=PrioritizedSampler(1.0))
    reader = None
    try:
        reader = RingReader.attach(writer.storage.header_name)
        # E1: positions 0..7 (steps 0..6); E2, inserted in the gap below, fills the whole ring (positions
        # 8..23), evicting E1 and reusing its rows 0..7 for its own steps 16..22.
        writer.insert(rows_of(E1, 0, 8), Spans.whole_episodes(np.array([7]), np.array([E1]), np.array([True])))
        writer.update_priorities(np.arange(0, 7), np.full(7, 0.01))  # E1's steps: leaf 0.01, max priority 1
        hook = {}

        class Reader(EpisodicRing):
            @property
            def head(self) -> int:
                if "insert" in hook:  # between the leaf read and the head read: evict E1, insert E2
                    hook.pop("insert")()
                return self.state.item(HEAD)

        reader.ring.__class__ = Reader
        hook["insert"] = lambda: writer.insert(
            rows_of(E2, 0, 16), Spans.whole_episodes(np.array([15]), np.array([E2]), np.array([False])))
        draw = reader.draw(32, np.random.default_rng(0), importance_beta=1.0)
        reader.ring.__class__ = EpisodicRing
        batch = reader.batch_of(draw, TransitionsMode(), np.random.default_rng(0), include_keys=True)
        assert passes_checks(reader.ring, draw)
        of_e2 = batch["obs"][:, 0] == E2
        assert of_e2.all()  # E1 is gone: every item is E2's
        true_probability = writer.sampler.tree.get(draw.rows) / writer.sampler.tree.total
        assert np.allclose(batch["probability"], true_probability), (
            f"probability {batch['probability'][:3]} for E2's steps, whose leaves give {true_probability[:3]}")
    finally:
        if reader is not None:
            reader.close()
        writer.close()
