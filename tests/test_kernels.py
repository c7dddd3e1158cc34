"""The compiled sampling kernels never index off the ring, whatever the tables they read say, and refuse
arrays they cannot read safely.

A lock-free reader reads tables the writer is changing (a torn bound can lie laps ahead, the live range
it read can exceed the capacity) and a prioritized reader may draw a position that just became a hole.
The kernels do not bounds-check their table reads, so every row they compute must be wrapped onto the ring.
"""

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from replayd.server import kernels
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.kernels import _kernels
from replayd.server.modes.geometric import GeometricMode
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.samplers.uniform import UniformSampler
from replayd.server.schema import Field
from replayd.wire.codec import ALLOWED_DTYPES
from replayd.wire.errors import RingChanged

CAPACITY = 10


# A kernel takes a generator's capsule, which does not keep the generator alive: hold the generator while the
# kernel runs (`capsule(rng)` on a generator bound to a name).
def capsule(rng: np.random.Generator) -> object:
    return rng.bit_generator.capsule


def test_draw_uniform_rows_stay_on_the_ring_when_the_range_exceeds_it() -> None:
    row_end = np.full(CAPACITY, 10**9, np.int64)  # every row a step of a far-away episode
    tables = (CAPACITY, row_end, np.zeros(CAPACITY, np.int64), np.zeros(7, np.int64), 7,
              np.empty(0, np.int64), 0)
    rng = np.random.default_rng(0)
    positions, rows, *_ = kernels.draw_uniform(capsule(rng), 50, 5, 5 + 4 * CAPACITY, 1.0, 1, *tables)
    assert np.all((positions >= 5) & (positions < 5 + 4 * CAPACITY))
    np.testing.assert_array_equal(rows, positions % CAPACITY)


def test_draw_uniform_keeps_the_steps_among_the_generators_uniforms_in_order() -> None:
    """The candidates are low + floor(u * span) for the uniforms Generator.random would draw, round after round,
    and the draw keeps the steps among them in order: a seeded sample is the one numpy's draws give."""
    capacity = 64
    row_end = np.repeat(np.arange(3, 64, 4), 4)  # episodes of 3 steps: rows 3, 7, ... are final observations
    tables = (capacity, row_end, np.zeros(capacity, np.int64), np.zeros(7, np.int64), 7, np.empty(0, np.int64), 0)
    rng = np.random.default_rng(3)
    positions, _, bounds, closed, open_seq = kernels.draw_uniform(capsule(rng), 40, 0, capacity, 0.25, 64, *tables)
    numpy_own, expected = np.random.default_rng(3), []
    while len(expected) < 40:  # the rounds: int(missing * 0.25) + 8 candidates each
        candidates = (numpy_own.random(int((40 - len(expected)) * 0.25) + 8) * capacity).astype(np.int64)
        expected += [int(c) for c in candidates if c % 4 != 3][:40 - len(expected)]
    np.testing.assert_array_equal(positions, expected)
    np.testing.assert_array_equal(bounds, row_end[expected])
    assert closed.all() and np.all(open_seq == -1)


def test_draw_uniform_gives_up_after_max_rounds() -> None:
    row_end = np.full(CAPACITY, kernels.HOLE, np.int64)  # no step anywhere (evictions emptied a reader's range)
    tables = (CAPACITY, row_end, np.zeros(CAPACITY, np.int64), np.zeros(7, np.int64), 7, np.empty(0, np.int64), 0)
    rng = np.random.default_rng(0)
    assert kernels.draw_uniform(capsule(rng), 8, 0, CAPACITY, 2.0, 3, *tables) is None


def transition_batch(positions: np.ndarray, bounds: np.ndarray, n_step: int, reward: np.ndarray | None = None,
                     **changes: object) -> dict[str, np.ndarray]:
    """A transitions batch over a ring whose observation at row r is r (so next_obs and bootstrap_obs name
    the rows the kernel read), every drawn episode closed."""
    arguments = {"positions": positions, "rows": changes.get("rows", np.asarray(positions) % CAPACITY),
                 "closed": np.ones(len(positions), bool),
                 "reward": np.ones(CAPACITY, np.float32) if reward is None else reward,
                 "sources": (np.arange(CAPACITY, dtype=np.float32),), "powers": 0.9 ** np.arange(n_step + 1)}
    batch: dict[str, np.ndarray] = changes.pop("batch", {})
    arguments.update(changes)
    kernels.transition_batch(batch, arguments["positions"], arguments["rows"], bounds, arguments["closed"], n_step,
                             arguments["powers"], CAPACITY, arguments["reward"], np.zeros(CAPACITY, np.int64),
                             np.zeros(7, np.uint8), 7, ("obs",), arguments["sources"], ("next_obs",),
                             ("bootstrap_obs",))
    return batch


def test_transition_rows_stay_on_the_ring_for_torn_and_hole_bounds() -> None:
    positions = np.array([3, 7, 9, 25], np.int64)
    bounds = np.array([10**6, kernels.HOLE, 9 + 3 * CAPACITY, 24], np.int64)  # torn, hole, torn, behind
    batch = transition_batch(positions, bounds, 1000)
    assert list(batch) == ["obs", "next_obs", "terminated", "truncated", "n_step_return", "bootstrap_discount",
                           "bootstrap_obs"]
    np.testing.assert_array_equal(batch["next_obs"], (positions + 1) % CAPACITY)
    assert np.all((batch["bootstrap_obs"] >= 0) & (batch["bootstrap_obs"] < CAPACITY))


def test_transition_batch_without_rewards_and_with_one_step() -> None:
    """No reward column: no targets and no bootstrap observation. n_step = 1: bootstrap_obs is next_obs."""
    positions = np.array([3, 7], np.int64)
    bounds = positions + np.array([1, 5])
    batch = transition_batch(positions, bounds, 1, reward=np.empty(0, np.float32))
    assert list(batch) == ["obs", "next_obs", "terminated", "truncated"]
    np.testing.assert_array_equal(batch["truncated"], [True, False])  # row 3 is its episode's last step
    batch = transition_batch(positions, bounds, 1)
    assert batch["bootstrap_obs"] is batch["next_obs"]
    np.testing.assert_array_equal(batch["bootstrap_discount"], np.float32([0.9, 0.9]))  # truncation bootstraps


def geometric_batch(rng: np.random.Generator, discount: float, positions: np.ndarray, bounds: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, future rows) of geometric pairs over a ring whose observation at row r is r."""
    batch: dict[str, np.ndarray] = {}
    kernels.geometric_batch(batch, capsule(rng), discount, positions, positions % CAPACITY, bounds, CAPACITY,
                            ("obs",), ("future_obs",), (np.arange(CAPACITY),))
    assert list(batch) == ["obs", "future_obs", "offset"]
    np.testing.assert_array_equal(batch["obs"], positions % CAPACITY)
    return batch["offset"], batch["future_obs"]


def test_geometric_rows_stay_on_the_ring_for_torn_and_hole_bounds() -> None:
    positions = np.array([3, 7, 9, 25], np.int64)
    bounds = np.array([10**6, kernels.HOLE, 9 + 3 * CAPACITY, 24], np.int64)
    for discount in (0.0, 0.5, 1.0):
        _, future_rows = geometric_batch(np.random.default_rng(0), discount, positions, bounds)
        assert np.all((future_rows >= 0) & (future_rows < CAPACITY)), discount


@pytest.mark.parametrize("discount", [1e-300, 0.5, 1 - 1e-16, 1.0])
def test_geometric_offsets_stay_in_the_episode_for_extreme_discounts(discount: float) -> None:
    """Discounts from ~0 to the largest double below 1 (where E / -ln g passes 2^53 for E > 1, the remainder's
    floating-point path): every offset in 1..M, for M from 1 to 1e9."""
    count = 6000
    positions = np.arange(count, dtype=np.int64) * 10
    bounds = positions + np.tile([1, 2, 3, 7, 1000, 10**9], count // 6)  # M per sample
    offsets, future_rows = geometric_batch(np.random.default_rng(1), discount, positions, bounds)
    assert np.all((offsets >= 1) & (offsets <= bounds - positions)), offsets
    np.testing.assert_array_equal(future_rows, (positions + offsets) % CAPACITY)


@pytest.mark.parametrize("discount", [0.3, 0.99, 0.999999, 1 - 1e-12, 1 - 1e-16])
def test_geometric_offsets_are_one_plus_k_mod_m_of_the_generators_exponentials(discount: float) -> None:
    """d = 1 + (floor(E / -ln g) mod M) for the E Generator.standard_exponential draws, computed with Python's
    integers: the kernel's floating-point remainder is exact (for K past 2^53 too), its exponentials are
    numpy's own, and it advances the generator as numpy does: a seeded request samples the batch numpy's
    draws give."""
    count = 4000
    positions = np.zeros(count, np.int64)
    sizes = np.random.default_rng(5)
    bounds = sizes.integers(2, 10**sizes.integers(1, 13, count), dtype=np.int64)  # M from 2 to ~1e12
    ours, numpy_own = np.random.default_rng(6), np.random.default_rng(6)
    offsets, _ = geometric_batch(ours, discount, positions, bounds)
    scale = -1.0 / math.log(discount)  # the C library's log, as the kernel's
    expected = [1 + math.floor(float(e) * scale) % int(m)
                for e, m in zip(numpy_own.standard_exponential(count), bounds, strict=True)]
    np.testing.assert_array_equal(offsets, expected)
    assert ours.random() == numpy_own.random()


def test_bound_lookup_wraps_negative_and_huge_keys() -> None:
    row_end = np.arange(CAPACITY, dtype=np.int64) + 1
    keys = np.array([-1, -CAPACITY - 3, 10**12 + 4], np.int64)  # e.g. hostile keys of update_priorities
    rows, bounds, _, _ = kernels.episode_bounds(keys, CAPACITY, row_end, np.zeros(CAPACITY, np.int64),
                                                np.zeros(7, np.int64), 7, np.empty(0, np.int64), 0)
    np.testing.assert_array_equal(rows, keys % CAPACITY)
    np.testing.assert_array_equal(bounds, row_end[keys % CAPACITY])


def test_uniform_draw_tops_up_when_a_round_falls_short() -> None:
    buffer = EpisodicBuffer("topup", f"test{os.getpid()}", [Field("obs", "float32", (), observation=True)], 40)
    try:
        lengths = np.full(10, 3)  # 10 episodes of 3 steps: rows 3, 7, 11, ... are final observations
        buffer.insert({"obs": np.arange(40, dtype=np.float32)},
                      Spans.whole_episodes(lengths, np.arange(10), np.ones(10, bool)))
        # Draws of 64 from 40 positions, 30 of them steps: a first round of int(64 * 1.0625 * 40 / 30) + 8 = 98
        # candidates holds fewer than 64 steps for 6 of these 400 seeds, which take a second round.
        for seed in range(400):
            draw = buffer.draw(64, np.random.default_rng(seed))
            assert len(draw.positions) == 64
            assert np.all(draw.positions % 4 != 3) and np.all(draw.positions < draw.bounds)
    finally:
        buffer.close()


def test_transition_targets_stay_in_their_tables_for_a_far_position_on_a_hole() -> None:
    positions = np.array([10**9 + 3], np.int64)  # bound - position is about -1e9
    batch = transition_batch(positions, np.array([kernels.HOLE], np.int64), 3)
    assert np.all((batch["bootstrap_obs"] >= 0) & (batch["bootstrap_obs"] < CAPACITY))
    assert np.all(np.isfinite(batch["n_step_return"])) and np.all(np.isfinite(batch["bootstrap_discount"]))


@pytest.mark.parametrize(("dtype", "shape"), [("uint8", (84, 84, 4)), ("float32", (376,)), ("float32", (4,)),
                                              ("int64", ()), ("bool", ()), ("float64", (3, 5))]
                         + [(dtype, (3,)) for dtype in sorted(ALLOWED_DTYPES)])
def test_take_rows_is_numpy_take(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    column = rng.integers(0, 200, (50, *shape)).astype(dtype)
    column.flags.writeable = False  # a reader's shared memory
    rows = rng.integers(0, 50, 33)
    batch: dict[str, np.ndarray] = {"kept": np.zeros(1)}
    kernels.take_rows(batch, ("next_obs", "next_again"), rows, (column, column))
    assert list(batch) == ["kept", "next_obs", "next_again"]
    for name in ("next_obs", "next_again"):
        assert batch[name].dtype == column.dtype and batch[name].flags.c_contiguous
        np.testing.assert_array_equal(batch[name], column.take(rows, axis=0))


def test_kernels_write_into_the_arrays_the_batch_already_holds() -> None:
    """A column the caller put in the batch (a view of the message it is sent in) is written into, in place."""
    rng = np.random.default_rng(0)
    column = rng.integers(0, 200, (50, 6, 2)).astype(np.uint8)
    rows = rng.integers(0, 50, 33)
    message = np.zeros(33 * 12 + 8, np.uint8)
    given = message[8:].reshape(33, 6, 2)
    batch = {"obs": given}
    kernels.take_rows(batch, ("obs", "next_obs"), rows, (column, column))
    assert batch["obs"] is given and list(batch) == ["obs", "next_obs"]
    np.testing.assert_array_equal(message[8:].reshape(33, 6, 2), column.take(rows, axis=0))

    positions, bounds = np.array([3, 7], np.int64), np.array([4, 12], np.int64)
    outputs = {"terminated": np.zeros(2, bool), "n_step_return": np.zeros(2, np.float32)}
    fresh = transition_batch(positions, bounds, 2)
    batch = dict(outputs)
    kernels.transition_batch(batch, positions, positions % CAPACITY, bounds, np.ones(2, bool), 2, 0.9 ** np.arange(3),
                             CAPACITY, np.ones(CAPACITY, np.float32), np.zeros(CAPACITY, np.int64),
                             np.zeros(7, np.uint8), 7, ("obs",), (np.arange(CAPACITY, dtype=np.float32),),
                             ("next_obs",), ("bootstrap_obs",))
    assert all(batch[name] is outputs[name] for name in outputs) and list(batch)[:2] == list(outputs)
    for name in fresh:
        np.testing.assert_array_equal(batch[name], fresh[name])
    offsets = np.zeros(2, np.int64)
    batch = {"offset": offsets}
    rng = np.random.default_rng(0)
    kernels.geometric_batch(batch, capsule(rng), 0.5, positions, positions % CAPACITY, bounds, CAPACITY,
                            ("obs",), ("future_obs",), (np.arange(CAPACITY),))
    assert batch["offset"] is offsets and np.all(offsets >= 1)


@pytest.mark.parametrize("given", [np.zeros((4, 3), np.float64), np.zeros((5, 3), np.float32),
                                   np.zeros((4, 3, 1), np.float32), np.zeros((3, 4), np.float32).T,
                                   np.frombuffer(bytes(48), np.float32).reshape(4, 3), [[0.0] * 3] * 4],
                         ids=["dtype", "rows", "rank", "not contiguous", "read-only", "not an array"])
def test_kernels_refuse_a_given_output_they_cannot_write_and_name_it(given: object) -> None:
    with pytest.raises(ValueError, match=r"kernel output batch\['obs'\]: expected a writable C-contiguous array "
                                         r"of dtype dtype\('float32'\) and 2 dimensions \(4 rows\)"):
        kernels.take_rows({"obs": given}, ("obs",), np.zeros(4, np.int64), (np.zeros((9, 3), np.float32),))
    with pytest.raises(ValueError, match=r"kernel output batch\['terminated'\]"):
        transition_batch(np.array([3], np.int64), np.array([9], np.int64), 1, batch={"terminated": np.zeros(1)})


def test_new_bytes_are_written_through_their_buffer() -> None:
    message, buffer = kernels.new_bytes(5)
    buffer[:] = np.frombuffer(b"bytes", np.uint8)
    assert type(message) is bytes and message == b"bytes" and buffer.base is message and buffer.flags.writeable
    assert kernels.new_bytes(0)[0] == b""
    with pytest.raises(ValueError, match="new_bytes: size must be in"):
        kernels.new_bytes(-1)


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
    bounds = positions + 1

    def targets_of(**changes: object) -> None:
        transition_batch(changes.pop("positions", positions), bounds, 1, **changes)

    with pytest.raises(TypeError, match=r"positions: expected numpy\.int64 items, got numpy\.float64"):
        targets_of(positions=positions.astype(float))
    with pytest.raises(TypeError, match="positions: expected a numpy array, got list"):
        targets_of(positions=[0, 1, 2, 3], rows=positions)
    with pytest.raises(TypeError, match="reward: expected no items, or >= 10 float32 or float64"):
        targets_of(reward=np.ones(CAPACITY, np.int64))
    with pytest.raises(ValueError, match="rows: expected a C-contiguous"):
        targets_of(rows=np.zeros(8, np.int64)[::2])
    with pytest.raises(ValueError, match="closed: expected at least 4 items, got 2"):
        targets_of(closed=np.ones(2, bool))
    with pytest.raises(ValueError, match=r"powers: expected n_step \+ 1 = 2 items, got 1"):
        targets_of(powers=np.ones(1))
    with pytest.raises(ValueError, match=r"sources\[0\]: expected a column of at least 10 rows"):
        targets_of(sources=(np.zeros(CAPACITY - 1, np.float32),))
    with pytest.raises(IndexError, match="row 10 is off the ring of 10 rows"):
        targets_of(rows=np.array([0, 1, 2, 10], np.int64))
    read_only = np.empty(4, bool)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="closed: expected a writable array"):
        _kernels.episode_bounds(positions, *tables, np.empty((3, 4), np.int64), read_only)
    with pytest.raises(TypeError, match="bit_generator: expected a BitGenerator's capsule"):
        kernels.draw_uniform(object(), 4, 0, 4, 1.0, 1, *tables)
    tables[1] = np.zeros(CAPACITY - 1, np.int64)  # a row_end shorter than the ring
    with pytest.raises(ValueError, match="row_end: expected at least 10 items, got 9"):
        kernels.episode_bounds(positions, *tables)
    tables[1] = np.zeros(CAPACITY, np.int32)
    with pytest.raises(TypeError, match=r"row_end: expected numpy\.int64 items, got numpy\.int32"):
        kernels.episode_bounds(positions, *tables)


def test_large_batches_take_the_paths_that_release_the_gil() -> None:
    """Batches over 4096 samples run the loops with the GIL released: they give whole, correct batches."""
    fields = [Field("obs", "float32", (2,), observation=True), Field("reward", "float32")]
    buffer = EpisodicBuffer("large", f"test{os.getpid()}large", fields, 2000)
    try:
        lengths = np.full(40, 49)  # rows t of episode e hold obs (e, t)
        obs = np.stack([np.repeat(np.arange(40), 50), np.tile(np.arange(50), 40)], axis=1).astype(np.float32)
        buffer.insert({"obs": obs, "reward": np.ones(2000, np.float32)},
                      Spans.whole_episodes(lengths, np.arange(40), np.ones(40, bool)))
        batch = buffer.sample(5000, TransitionsMode(3, 0.5), np.random.default_rng(1))
        np.testing.assert_array_equal(batch["next_obs"][:, 1], batch["obs"][:, 1] + 1)
        n_eff = np.minimum(3, 49 - batch["obs"][:, 1])
        np.testing.assert_array_equal(batch["bootstrap_obs"][:, 1], batch["obs"][:, 1] + n_eff)
        np.testing.assert_allclose(batch["n_step_return"], (1 - 0.5**n_eff) / 0.5, rtol=1e-6)
        pairs = buffer.sample(5000, GeometricMode(0.9), np.random.default_rng(2))
        np.testing.assert_array_equal(pairs["future_obs"][:, 0], pairs["obs"][:, 0])  # same episode
        np.testing.assert_array_equal(pairs["future_obs"][:, 1] - pairs["obs"][:, 1], pairs["offset"])
        assert np.all((pairs["offset"] >= 1) & (pairs["obs"][:, 1] + pairs["offset"] <= 49))
    finally:
        buffer.close()


class EmptyRangeRing:
    """What a lock-free reader can read while a writer evicts every live extent for a long episode: the
    tail already at the head, the sampleable count not yet dropped."""

    name = "racing"
    bound_tables = (CAPACITY, np.zeros(CAPACITY, np.int64), np.zeros(CAPACITY, np.int64), np.zeros(7, np.int64), 7,
                    np.empty(0, np.int64), 0)

    def live_range(self) -> tuple[int, int, int]:
        return 11, 11, 10  # tail, head, sampleable steps


def test_a_draw_over_an_empty_live_range_is_a_ring_change_the_reader_redraws() -> None:
    rng = np.random.default_rng(0)
    assert kernels.draw_uniform(capsule(rng), 8, 11, 11, 1.0, 64, *EmptyRangeRing.bound_tables) is None
    with pytest.raises(RingChanged, match="found no sampleable step"):
        UniformSampler().draw(EmptyRangeRing(), 8, np.random.default_rng(0))


def test_kernels_refuse_what_would_read_or_copy_unsafely() -> None:
    positions = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match=r"powers: expected n_step \+ 1 = -?\d+ items, got 2"):
        transition_batch(positions, positions + 1, 2**63 - 1, powers=np.ones(2))
    batch: dict[str, np.ndarray] = {}
    rows = np.zeros(2, np.int64)
    for column in (np.array([object(), "x"], dtype=object), np.array(["a", "b"], dtype=np.dtypes.StringDType()),
                   np.array(["a", "b"])):  # references, pointers to managed memory, not numbers
        with pytest.raises(TypeError, match="expected numbers or bools"):
            kernels.take_rows(batch, ("name",), rows, (column,))

    class Hashing(str):
        def __hash__(self) -> int:  # would run while the kernel holds checked rows
            return 0

    with pytest.raises(TypeError, match="names: expected a tuple of str"):
        kernels.take_rows(batch, (Hashing("name"),), rows, (np.zeros(2),))
    assert batch == {}


@pytest.mark.parametrize(("closed", "bound", "row_end_now", "kept"), [
    (True, 7, 7, True),  # a closed episode keeps its bound until evicted
    (True, 7, 9, False),  # ... a new bound means the row was evicted and reused
    (True, 7, kernels.HOLE, False),
    (False, 7, kernels.OPEN, True),  # still open
    (False, 7, kernels.HOLE, True),  # moved to the head: the batch is what the open episode held
    (False, 7, 12, True),  # closed after the draw, past the rows the draw read
    (False, 7, 7, False),  # closed at the last row the draw read: it may have ended there (terminated)
    (False, 7, 5, False),  # a bound behind the draw's: the row was reused
], ids=lambda value: str(value))
def test_bounds_kept_tells_which_bound_changes_a_lock_free_batch_survives(closed: bool, bound: int, row_end_now: int,
                                                                          kept: bool) -> None:
    row_end = np.full(10, kernels.OPEN, np.int64)
    row_end[3] = row_end_now
    rows, bounds = np.array([1, 3], np.int64), np.array([bound, bound], np.int64)
    flags = np.array([False, closed])  # row 1: an open row that kept its bound, beside the row under test
    assert kernels.bounds_kept(rows, bounds, flags, row_end) is kept


def test_tree_find_keeps_a_node_past_its_level_bounded_over_many_short_levels() -> None:
    """tree_find accepts any levels of whole rows; under a parent larger than its children (here the top
    level's last node over levels of one zero row each) the node it carries past a level's rows must not
    grow K-fold per level until it wraps negative and indexes off the array (it read 8 items before a level
    here; other targets read gigabytes away)."""
    levels = 24  # the root, a top level of 8 nodes, then 22 levels of one row of 8 nodes each
    starts = np.array([0, *range(1, 8 * levels, 8)], np.int64)
    sums = np.zeros(int(starts[-1]))
    sums[8] = 1.0  # the top level's last node: 7, 63, ..., 8**21 - 1, then 8**22 - 1 wraps to -1
    nodes = np.empty(1, np.int64)
    assert _kernels.tree_find(sums, starts, np.array([0.5]), nodes)
    assert 0 <= nodes[0] <= sums.size + 8


def test_transition_batch_releases_its_arrays_when_a_later_gather_runs_out_of_memory() -> None:
    """Memory running out at the next observations' gather (the first gather took what was left) raises
    MemoryError, and the terminated and truncated columns the kernel made for the batch are released (not
    leaked, 2 bytes a sample per failed call). In a child process: it caps its own address space."""
    code = textwrap.dedent("""
        import gc, resource, tracemalloc
        import numpy as np
        from replayd.server import kernels

        capacity, row_bytes, count = 4, 100, 1_000_000  # a 100 MB observation gather, 1 MB per target column
        positions = np.zeros(count, np.int64)
        arguments = (positions, positions, positions + 1, np.ones(count, bool), 1, np.ones(2), capacity,
                     np.ones(capacity, np.float32), np.zeros(capacity, np.int64), np.zeros(7, np.uint8), 7,
                     ("obs",), (np.zeros((capacity, row_bytes), np.uint8),), ("next_obs",), ("bootstrap_obs",))
        kernels.transition_batch({}, *arguments)
        tracemalloc.start()
        with open("/proc/self/status") as status:
            used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (used + 150 * 2**20, resource.RLIM_INFINITY))  # one gather
        traced = []
        for _ in range(4):
            try:
                kernels.transition_batch({}, *arguments)
            except MemoryError:
                gc.collect()
                traced.append(tracemalloc.get_traced_memory()[0])
            else:
                raise SystemExit("no MemoryError: the cap let both gathers through")
        print(traced[-1] - traced[0])
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == 0, child.stderr
    assert int(child.stdout) < 100_000  # leaking, 3 calls left 6 MB
