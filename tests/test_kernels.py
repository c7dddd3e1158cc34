"""The compiled sampling kernels never index off the ring, whatever the tables they read say.

A lock-free reader reads tables the writer is changing (a torn bound can lie laps ahead, the live range
it read can exceed the capacity) and a prioritized reader may draw a position that just became a hole.
The kernels do not bounds-check, so every row they compute must be wrapped onto the ring.
"""

import numpy as np

from service.samplers import kernels

CAPACITY = 10


def test_draw_uniform_rows_stay_on_the_ring_when_the_range_exceeds_it() -> None:
    row_end = np.full(CAPACITY, 10**9, np.int64)  # every row a step of a far-away episode
    tables = (CAPACITY, row_end, np.zeros(CAPACITY, np.int64), np.zeros(7, np.int64), 7,
              np.empty(0, np.int64), 0)
    positions, rows, _, _ = kernels.draw_uniform(np.linspace(0, 0.999, 50), 5, 5 + 4 * CAPACITY, 50,
                                                 *tables)
    assert len(positions) == 50
    np.testing.assert_array_equal(rows, positions % CAPACITY)


def test_transition_rows_stay_on_the_ring_for_torn_and_hole_bounds() -> None:
    positions = np.array([3, 7, 9, 25], np.int64)
    rows = positions % CAPACITY
    bounds = np.array([10**6, kernels.HOLE, 9 + 3 * CAPACITY, 24], np.int64)  # torn, hole, torn, behind
    next_rows, _, _, _, _, bootstrap_rows = kernels.transition_targets(
        positions, rows, bounds, np.ones(4, bool), 1000, 0.9 ** np.arange(1001), CAPACITY,
        np.ones(CAPACITY, np.float32), np.zeros(CAPACITY, np.int64), np.zeros(7, np.int64), 7)
    assert np.all((next_rows >= 0) & (next_rows < CAPACITY))
    assert np.all((bootstrap_rows >= 0) & (bootstrap_rows < CAPACITY))


def test_geometric_rows_stay_on_the_ring_for_torn_and_hole_bounds() -> None:
    positions = np.array([3, 7, 9, 25], np.int64)
    bounds = np.array([10**6, kernels.HOLE, 9 + 3 * CAPACITY, 24], np.int64)
    for discount in (0.0, 0.5, 1.0):
        _, future_rows = kernels.geometric_offsets(np.full(4, 0.999), discount, positions, positions % CAPACITY,
                                                   bounds, CAPACITY)
        assert np.all((future_rows >= 0) & (future_rows < CAPACITY)), discount


def test_bound_lookup_wraps_negative_and_huge_keys() -> None:
    row_end = np.arange(CAPACITY, dtype=np.int64) + 1
    keys = np.array([-1, -CAPACITY - 3, 10**12 + 4], np.int64)  # e.g. hostile keys of update_priorities
    rows, bounds, _ = kernels.episode_bounds(keys, CAPACITY, row_end, np.zeros(CAPACITY, np.int64),
                                             np.zeros(7, np.int64), 7, np.empty(0, np.int64), 0)
    np.testing.assert_array_equal(rows, keys % CAPACITY)
    np.testing.assert_array_equal(bounds, row_end[keys % CAPACITY])
