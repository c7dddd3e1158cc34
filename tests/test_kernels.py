"""The compiled sampling kernels never index off the ring, whatever the tables they read say, and refuse
arrays they cannot read safely.

A lock-free reader reads tables the writer is changing (a torn bound can lie laps ahead, the live range
it read can exceed the capacity) and a prioritized reader may draw a position that just became a hole.
The kernels do not bounds-check their table reads, so every row they compute must be wrapped onto the ring.
"""

import os

import numpy as np
import pytest

from service.buffers.episodic import EpisodicBuffer, Spans
from service.samplers import kernels
from service.schema import Field

CAPACITY = 10


def test_draw_uniform_rows_stay_on_the_ring_when_the_range_exceeds_it() -> None:
    row_end = np.full(CAPACITY, 10**9, np.int64)  # every row a step of a far-away episode
    tables = (CAPACITY, row_end, np.zeros(CAPACITY, np.int64), np.zeros(7, np.int64), 7,
              np.empty(0, np.int64), 0)
    located, closed = np.empty((4, 50), np.int64), np.empty(50, bool)
    assert kernels.draw_uniform(np.linspace(0, 0.999, 50), 5, 5 + 4 * CAPACITY, located, closed, 0, *tables) == 50
    positions, rows, _, _ = located
    np.testing.assert_array_equal(rows, positions % CAPACITY)


def transition_outputs(count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """transition_targets' outputs (target rows, flags, targets), filled with values it must overwrite."""
    return np.full((2, count), -7, np.int64), np.ones((2, count), bool), np.full((2, count), np.nan, np.float32)


def test_transition_rows_stay_on_the_ring_for_torn_and_hole_bounds() -> None:
    positions = np.array([3, 7, 9, 25], np.int64)
    rows = positions % CAPACITY
    bounds = np.array([10**6, kernels.HOLE, 9 + 3 * CAPACITY, 24], np.int64)  # torn, hole, torn, behind
    target_rows, flags, targets = transition_outputs(4)
    kernels.transition_targets(
        positions, rows, bounds, np.ones(4, bool), 1000, 0.9 ** np.arange(1001), CAPACITY,
        np.ones(CAPACITY, np.float32), np.zeros(CAPACITY, np.int64), np.zeros(7, np.uint8), 7,
        target_rows, flags, targets)
    assert np.all((target_rows >= 0) & (target_rows < CAPACITY))  # next and bootstrap rows


def test_geometric_rows_stay_on_the_ring_for_torn_and_hole_bounds() -> None:
    positions = np.array([3, 7, 9, 25], np.int64)
    bounds = np.array([10**6, kernels.HOLE, 9 + 3 * CAPACITY, 24], np.int64)
    for discount in (0.0, 0.5, 1.0):
        offsets_and_future_rows = np.empty((2, 4), np.int64)
        kernels.geometric_offsets(np.full(4, 0.999), discount, positions, positions % CAPACITY, bounds, CAPACITY,
                                  offsets_and_future_rows)
        future_rows = offsets_and_future_rows[1]
        assert np.all((future_rows >= 0) & (future_rows < CAPACITY)), discount


@pytest.mark.parametrize("discount", [1e-300, 0.5, 1 - 1e-16, 1.0])
def test_geometric_offsets_stay_in_the_episode_for_extreme_draws(discount: float) -> None:
    """Exponential draws from 0 to far past any the generator makes (some overflow int64 once divided by
    -ln(discount)): every offset in 1..M."""
    count = 6
    positions = np.arange(count, dtype=np.int64) * 10
    bounds = positions + np.array([1, 2, 3, 7, 1000, 10**9])  # M per sample
    exponentials = np.array([0.0, 1e-300, 0.7, 40.0, 745.0, 1e30])  # -ln of the smallest double: 745
    offsets_and_future_rows = np.empty((2, count), np.int64)
    kernels.geometric_offsets(exponentials, discount, positions, positions % CAPACITY, bounds, CAPACITY,
                              offsets_and_future_rows)
    offsets, future_rows = offsets_and_future_rows
    assert np.all((offsets >= 1) & (offsets <= bounds - positions)), offsets
    np.testing.assert_array_equal(future_rows, (positions + offsets) % CAPACITY)


def test_bound_lookup_wraps_negative_and_huge_keys() -> None:
    row_end = np.arange(CAPACITY, dtype=np.int64) + 1
    keys = np.array([-1, -CAPACITY - 3, 10**12 + 4], np.int64)  # e.g. hostile keys of update_priorities
    rows, bounds, _, _ = kernels.episode_bounds(keys, CAPACITY, row_end, np.zeros(CAPACITY, np.int64),
                                                np.zeros(7, np.int64), 7, np.empty(0, np.int64), 0)
    np.testing.assert_array_equal(rows, keys % CAPACITY)
    np.testing.assert_array_equal(bounds, row_end[keys % CAPACITY])


def test_uniform_draw_tops_up_when_a_round_falls_short(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = EpisodicBuffer("topup", f"test{os.getpid()}", [Field("obs", "float32", (), observation=True)], 40)
    try:
        lengths = np.full(10, 3)  # 10 episodes of 3 steps: rows 3, 7, 11, ... are final observations
        buffer.insert({"obs": np.arange(40, dtype=np.float32)},
                      Spans.whole_episodes(lengths, np.arange(10), np.ones(10, bool)))
        final_rows = (np.arange(10) * 4 + 3 + 0.5) / 40  # uniforms whose candidate is a final row
        rounds = []
        real_uniforms = kernels.uniforms

        def first_round_on_final_rows(rng: np.random.Generator, count: int) -> np.ndarray:
            rounds.append(count)
            return np.resize(final_rows, count) if len(rounds) == 1 else real_uniforms(rng, count)

        monkeypatch.setattr(kernels, "uniforms", first_round_on_final_rows)
        draw = buffer.draw(64, np.random.default_rng(0))
        assert len(rounds) >= 2
        assert len(draw.positions) == 64
        assert np.all(draw.positions % 4 != 3) and np.all(draw.positions < draw.bounds)
    finally:
        buffer.close()


def test_transition_targets_stay_in_their_tables_for_a_far_position_on_a_hole() -> None:
    positions = np.array([10**9 + 3], np.int64)  # bound - position is about -1e9
    target_rows, flags, targets = transition_outputs(1)
    kernels.transition_targets(
        positions, positions % CAPACITY, np.array([kernels.HOLE], np.int64), np.ones(1, bool), 3,
        0.9 ** np.arange(4), CAPACITY, np.ones(CAPACITY, np.float32), np.zeros(CAPACITY, np.int64),
        np.zeros(7, np.uint8), 7, target_rows, flags, targets)
    assert np.all((target_rows >= 0) & (target_rows < CAPACITY))
    assert np.all(np.isfinite(targets))


def test_draws_are_the_generators_own() -> None:
    """kernels.uniforms and kernels.exponentials draw what Generator.random and standard_exponential would,
    and advance the generator as they do: a seeded request samples the same batch as before."""
    ours, numpy_own = np.random.default_rng(11), np.random.default_rng(11)
    np.testing.assert_array_equal(kernels.uniforms(ours, 300), numpy_own.random(300))
    np.testing.assert_array_equal(kernels.exponentials(ours, 257), numpy_own.standard_exponential(257))
    assert ours.random() == numpy_own.random()


@pytest.mark.parametrize(("dtype", "shape"), [("uint8", (84, 84, 4)), ("float32", (376,)), ("float32", (4,)),
                                              ("int64", ()), ("bool", ()), ("float64", (3, 5))])
def test_take_rows_is_numpy_take(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    column = rng.integers(0, 200, (50, *shape)).astype(dtype)
    column.flags.writeable = False  # a reader's shared memory
    rows = rng.integers(0, 50, 33)
    batch: dict[str, np.ndarray] = {"kept": np.zeros(1)}
    kernels.gather_columns(batch, rows, kernels.Columns(("obs", "again"), (column, column)), "next_")
    assert list(batch) == ["kept", "next_obs", "next_again"]
    for name in ("next_obs", "next_again"):
        assert batch[name].dtype == column.dtype and batch[name].flags.c_contiguous
        np.testing.assert_array_equal(batch[name], column.take(rows, axis=0))


def test_take_rows_refuses_rows_off_a_column_and_leaves_the_batch_as_it_was() -> None:
    column = np.arange(10, dtype=np.float32)
    batch: dict[str, np.ndarray] = {}
    for rows in ([0, 10], [-1]):
        with pytest.raises(IndexError, match=r"row -?\d+ is off a column of 10 rows"):
            kernels.take_rows(batch, ("a", "b"), np.array(rows, np.int64), (column, column))
        assert batch == {}


def test_kernels_refuse_arrays_they_cannot_read_and_name_the_argument() -> None:
    positions = np.arange(4, dtype=np.int64)
    tables = [CAPACITY, np.zeros(CAPACITY, np.int64), np.zeros(CAPACITY, np.int64), np.zeros(7, np.int64), 7,
              np.empty(0, np.int64), 0]
    located, closed = np.empty((4, 4), np.int64), np.empty(4, bool)

    def draw(**changes: object) -> None:
        arguments = {"uniforms": np.zeros(4), "located": located, "closed": closed}
        arguments.update(changes)
        kernels.draw_uniform(arguments["uniforms"], 0, 4, arguments["located"], arguments["closed"], 0, *tables)

    with pytest.raises(TypeError, match=r"uniforms: expected numpy\.float64 items, got numpy\.float32"):
        draw(uniforms=np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="uniforms: expected a numpy array, got list"):
        draw(uniforms=[0.0, 0.5])
    with pytest.raises(ValueError, match="located: expected a C-contiguous"):
        draw(located=np.empty((4, 8), np.int64)[:, ::2])
    with pytest.raises(ValueError, match="located: expected at least 16 items, got 8"):
        draw(located=np.empty((2, 4), np.int64))
    read_only = closed.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="closed: expected a writable array"):
        draw(closed=read_only)
    tables[1] = np.zeros(CAPACITY - 1, np.int64)  # a row_end shorter than the ring
    with pytest.raises(ValueError, match="row_end: expected at least 10 items, got 9"):
        kernels.episode_bounds(positions, *tables)
    tables[1] = np.zeros(CAPACITY, np.int32)
    with pytest.raises(TypeError, match=r"row_end: expected numpy\.int64 items, got numpy\.int32"):
        kernels.episode_bounds(positions, *tables)
