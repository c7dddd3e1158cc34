"""The compiled sampling kernels never index off the ring, whatever the tables they read say.

A lock-free reader reads tables the writer is changing (a torn bound can lie laps ahead, the live range
it read can exceed the capacity) and a prioritized reader may draw a position that just became a hole.
The kernels do not bounds-check, so every row they compute must be wrapped onto the ring.
"""

import os
import subprocess
import sys

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
        np.ones(CAPACITY, np.float32), np.zeros(CAPACITY, np.int64), np.zeros(7, np.int64), 7,
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


class FirstRoundOnFinalRows:
    """A generator stand-in whose first uniforms all land on final observations (rejected): the uniform
    sampler must top the batch up in further rounds."""

    def __init__(self, final_fraction_points: np.ndarray) -> None:
        self.first = final_fraction_points
        self.rng = np.random.default_rng(0)
        self.calls = 0

    def random(self, size: int) -> np.ndarray:
        self.calls += 1
        return np.resize(self.first, size) if self.calls == 1 else self.rng.random(size)


def test_uniform_draw_tops_up_when_a_round_falls_short() -> None:
    buffer = EpisodicBuffer("topup", f"test{os.getpid()}", [Field("obs", "float32", (), observation=True)], 40)
    try:
        lengths = np.full(10, 3)  # 10 episodes of 3 steps: rows 3, 7, 11, ... are final observations
        buffer.insert({"obs": np.arange(40, dtype=np.float32)},
                      Spans.whole_episodes(lengths, np.arange(10), np.ones(10, bool)))
        final_rows = (np.arange(10) * 4 + 3 + 0.5) / 40  # uniforms whose candidate is a final row
        rng = FirstRoundOnFinalRows(final_rows)
        draw = buffer.draw(64, rng)
        assert rng.calls >= 2
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
        np.zeros(7, np.int64), 7, target_rows, flags, targets)
    assert np.all((target_rows >= 0) & (target_rows < CAPACITY))
    assert np.all(np.isfinite(targets))


_NO_COMPILE_AT_SAMPLE = """
import os
import numpy as np
from service.buffers.episodic import EpisodicBuffer, Spans
from service.buffers.ring import EpisodicRing
from service.samplers import kernels
from service.samplers.geometric import GeometricMode
from service.samplers.prioritized import PrioritizedSampler
from service.samplers.states import StatesMode
from service.samplers.transitions import TransitionsMode
from service.schema import Field

compiled = {name: len(k.signatures) for name, k in vars(kernels).items() if hasattr(k, "signatures")}
modes = [TransitionsMode(1, 0.9), TransitionsMode(3, 0.9), GeometricMode(0.9), StatesMode()]
for reward_dtype in ("float32", "float64"):
    for sampler in (None, PrioritizedSampler(0.6)):
        fields = [Field("obs", "float32", (2,), observation=True), Field("reward", reward_dtype)]
        writer = EpisodicBuffer("w", f"kc{os.getpid()}", fields, 64, sampler=sampler)
        try:
            writer.insert({"obs": np.zeros((11, 2), np.float32), "reward": np.zeros(11, reward_dtype)},
                          Spans.whole_episodes(np.array([10]), np.array([1]), np.array([True])))
            reader = EpisodicRing.attach(writer.storage.header_name)
            try:
                for mode in modes:
                    writer.sample(8, mode, include_keys=True)
                    reader.sample_shared(8, mode, np.random.default_rng(0), include_keys=True)
            finally:
                reader.close()
        finally:
            writer.close()
grown = {name: (count, len(getattr(kernels, name).signatures)) for name, count in compiled.items()
         if len(getattr(kernels, name).signatures) != count}
print("compiled at sample time:", grown)
"""


def test_samples_by_writers_and_readers_use_only_kernels_compiled_at_import() -> None:
    """A kernel specialization first met at sample time is compiled there (a stall of seconds)."""
    result = subprocess.run([sys.executable, "-c", _NO_COMPILE_AT_SAMPLE], capture_output=True, text=True,
                            timeout=300, check=True)
    assert result.stdout.strip() == "compiled at sample time: {}", result.stdout + result.stderr
