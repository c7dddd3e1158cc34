"""Prioritized sampling through the buffer: P(i) = p_i^alpha / sum p^alpha (chi-square), importance weights,
stale keys, rejected priorities, and the gRPC round trip."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.kernels import HOLE
from replayd.server.modes.states import StatesMode
from replayd.server.removers import MaxTimesSampledRemover
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.wire.components import Prioritized
from replayd.wire.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from tests.test_episodic_buffer import FIELDS, _chi_square_critical, make_rows

ALPHA = 0.7


def new_buffer(capacity: int, alpha: float = ALPHA) -> EpisodicBuffer:
    return EpisodicBuffer("prio", f"test{os.getpid()}", FIELDS, capacity, sampler=PrioritizedSampler(alpha))


def insert_episodes(buffer: EpisodicBuffer, rng: np.random.Generator, lengths: list[int], first_id: int) -> None:
    parts = [make_rows(rng, 0, n + 1) for n in lengths]
    columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    ids = np.arange(first_id, first_id + len(lengths))
    buffer.insert(columns, Spans.whole_episodes(np.array(lengths), ids, np.ones(len(lengths), bool)))


def live_keys(buffer: EpisodicBuffer) -> np.ndarray:
    positions = np.arange(buffer.tail_position(), buffer.head)
    _, bounds, _ = buffer.ring.episode_bounds(positions)
    return positions[positions < bounds]


def assert_proportional(buffer: EpisodicBuffer, priority: dict[int, float], rng: np.random.Generator) -> None:
    keys = np.concatenate([buffer.sample(2000, StatesMode(), rng, include_keys=True)["key"] for _ in range(20)])
    expected_keys = np.array(sorted(priority))
    assert np.isin(keys, expected_keys).all(), "drew a non-sampleable position"
    counts = np.array([np.count_nonzero(keys == k) for k in expected_keys])
    p = np.array([priority[int(k)] for k in expected_keys]) ** ALPHA
    expected = len(keys) * p / p.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < _chi_square_critical(len(expected_keys) - 1), chi2


def test_distribution_follows_priorities_before_and_after_updates_across_wraparound() -> None:
    rng = np.random.default_rng(0)
    buffer = new_buffer(100)
    try:
        insert_episodes(buffer, rng, [5, 9, 14], 0)
        keys = live_keys(buffer)
        assert_proportional(buffer, {int(k): 1.0 for k in keys}, rng)  # new steps share the max priority
        priorities = rng.uniform(0.1, 5.0, keys.size)
        assert buffer.update_priorities(keys, priorities) == (keys.size, 0)
        assert_proportional(buffer, dict(zip(keys.tolist(), priorities.tolist(), strict=True)), rng)
        for i in range(40):  # wrap the ring several times; old keys go stale
            insert_episodes(buffer, rng, [int(rng.integers(3, 20))], 100 + i)
        keys = live_keys(buffer)
        assert buffer.head > 3 * buffer.capacity
        priorities = rng.uniform(0.1, 5.0, keys.size)
        buffer.update_priorities(keys, priorities)
        assert_proportional(buffer, dict(zip(keys.tolist(), priorities.tolist(), strict=True)), rng)
    finally:
        buffer.close()


def test_new_steps_get_the_max_priority_and_importance_weights_follow_the_formula() -> None:
    rng = np.random.default_rng(1)
    buffer = new_buffer(200)
    try:
        insert_episodes(buffer, rng, [10, 10], 0)
        keys = live_keys(buffer)
        priorities = rng.uniform(0.5, 3.0, keys.size)
        buffer.update_priorities(keys, priorities)
        insert_episodes(buffer, rng, [4], 2)  # 4 new steps at max priority
        priority = dict(zip(keys.tolist(), priorities.tolist(), strict=True))
        for key in live_keys(buffer)[-4:]:
            priority[int(key)] = priorities.max()
        beta = 0.4
        batch = buffer.sample(500, StatesMode(), rng, include_keys=True, importance_beta=beta)
        p = {k: v**ALPHA for k, v in priority.items()}
        total, n = sum(p.values()), len(p)
        probability = np.array([p[int(k)] / total for k in batch["key"]])
        np.testing.assert_allclose(batch["probability"], probability, rtol=1e-9)
        weight = (n * probability) ** -beta / (n * min(p.values()) / total) ** -beta
        np.testing.assert_allclose(batch["weight"], weight, rtol=1e-6)
        assert buffer.sample(10, StatesMode(), rng)["weight"].max() <= 1.0
    finally:
        buffer.close()


def test_stale_keys_are_ignored_and_never_reach_the_new_occupant() -> None:
    rng = np.random.default_rng(2)
    buffer = new_buffer(40)
    try:
        insert_episodes(buffer, rng, [9, 9], 0)
        old = buffer.sample(5, StatesMode(), rng, include_keys=True)["key"]
        insert_episodes(buffer, rng, [15, 15], 2)  # evicts the first two episodes; their rows are reused
        assert (old < buffer.tail_position()).all()
        fresh = live_keys(buffer)
        assert buffer.update_priorities(np.concatenate([old, fresh[:1]]), np.full(old.size + 1, 50.0)) == (1, 5)
        values = buffer.sampler.tree.get(fresh % buffer.capacity)
        assert values[0] == pytest.approx(50.0**ALPHA)
        np.testing.assert_array_equal(values[1:], 1.0)  # occupants of reused rows keep their own priority
        final_rows = np.setdiff1d(np.arange(buffer.capacity), fresh % buffer.capacity)
        assert (buffer.sampler.tree.get(final_rows) == 0).all()  # final observations and holes never drawn
        # A live position that is no step (an episode's final observation) is stale too: a priority there
        # would make the final observation drawable as if it had a successor.
        final_observations = np.setdiff1d(np.arange(buffer.tail_position(), buffer.head), fresh)
        assert final_observations.size == 2
        assert buffer.update_priorities(final_observations, np.full(2, 50.0)) == (0, 2)
        assert (buffer.sampler.tree.get(final_observations % buffer.capacity) == 0).all()
    finally:
        buffer.close()


def test_a_negative_key_is_refused_and_a_key_past_the_head_is_stale() -> None:
    """A negative key is no position a buffer hands out; one at or past the head may come from an earlier
    buffer of the same name, so it is stale, as an evicted one is."""
    rng = np.random.default_rng(5)
    buffer = new_buffer(40)
    try:
        insert_episodes(buffer, rng, [9], 0)
        before = buffer.sampler.tree.get(np.arange(buffer.capacity)).copy()
        with pytest.raises(InvalidArgument, match=r"update_priorities: keys\[1\] = -5; keys are the positions"):
            buffer.update_priorities(np.array([0, -5]), np.array([2.0, 2.0]))
        np.testing.assert_array_equal(buffer.sampler.tree.get(np.arange(buffer.capacity)), before)
        assert buffer.update_priorities(np.array([buffer.head, 10**12]), np.array([2.0, 2.0])) == (0, 2)
    finally:
        buffer.close()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0, 1e300])  # 1e300 ** 0.7 would make the tree total overflow
def test_bad_priorities_are_rejected_naming_the_index_and_change_nothing(bad: float) -> None:
    rng = np.random.default_rng(3)
    buffer = new_buffer(100)
    try:
        insert_episodes(buffer, rng, [8], 0)
        keys = live_keys(buffer)
        before = buffer.sampler.tree.sums.copy()
        priorities = np.full(keys.size, 2.0)
        priorities[3] = bad
        with pytest.raises(InvalidArgument, match=r"priorities\[3\]"):
            buffer.update_priorities(keys, priorities)
        np.testing.assert_array_equal(buffer.sampler.tree.sums, before)
    finally:
        buffer.close()


@pytest.mark.parametrize(("alpha", "tiny", "kept"), [(100.0, 1e-4, 0.5), (1e308, 0.5, 1.0), (1e19, 1 - 2**-53, 1.0)])
def test_positive_priorities_whose_leaf_underflows_are_rejected(alpha: float, tiny: float, kept: float) -> None:
    """tiny ** alpha underflows to 0: the step would never be drawn although its priority is positive."""
    rng = np.random.default_rng(6)
    buffer = new_buffer(100, alpha=alpha)
    try:
        insert_episodes(buffer, rng, [4], 0)
        keys = live_keys(buffer)
        before = buffer.sampler.tree.sums.copy()
        with pytest.raises(InvalidArgument, match=r"priorities\[2\] = .* could never be drawn"):
            buffer.update_priorities(keys, np.array([kept, 0.0, tiny, kept]))
        np.testing.assert_array_equal(buffer.sampler.tree.sums, before)
        assert buffer.update_priorities(keys, np.array([kept, 0.0, kept, kept])) == (4, 0)
        assert (buffer.sampler.tree.get(keys % buffer.capacity)[[0, 2, 3]] > 0).all()
    finally:
        buffer.close()


def test_a_sample_that_may_wait_waits_for_a_positive_priority() -> None:
    """Priority 0 steps are never drawn: with every step at 0 the buffer cannot be sampled yet, so a sample
    that may wait waits (until a priority update or an insert), and one that may not fails at once."""
    buffer = new_buffer(64)
    try:
        insert_episodes(buffer, np.random.default_rng(0), [5], first_id=1)
        keys = live_keys(buffer)
        buffer.update_priorities(keys, np.zeros(keys.size))
        with pytest.raises(FailedPrecondition, match="positive priority"):
            buffer.sample(4, StatesMode())
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=r"got no step to draw within 0\.2s"):
            buffer.sample(4, StatesMode(), wait_seconds=0.2)
        assert time.monotonic() - started >= 0.2
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(buffer.sample, 4, StatesMode(), include_keys=True, wait_seconds=60)
            buffer.update_priorities(keys[2:3], np.ones(1))
            assert (waiting.result(timeout=30)["key"] == keys[2]).all()
    finally:
        buffer.close()


def test_grpc_prioritized_sample_and_update_priorities(client) -> None:
    schema = {"obs": ("float32", (3,)), "action": ("int64", ()), "reward": ("float32", ())}
    info = client.create_buffer("per", 1000, schema, sampler=Prioritized(alpha=0.6))
    assert info["counters"]["prioritized.alpha"] == pytest.approx(0.6)
    rng = np.random.default_rng(4)
    client.insert_episode("per", True, obs=rng.normal(size=(11, 3)).astype(np.float32),
                          action=np.arange(10), reward=np.ones(10, np.float32))
    batch = client.sample("per", 64, include_keys=True, importance_beta=0.5, seed=1)
    assert {"probability", "weight", "key"} <= set(batch)
    np.testing.assert_allclose(batch["probability"], 0.1)
    priorities = np.where(batch["action"] == 0, 100.0, 1e-6)
    applied, ignored = client.update_priorities("per", batch["key"], priorities)
    assert (applied, ignored) == (64, 0)
    again = client.sample("per", 200, include_keys=True, seed=2)
    assert (again["action"] == 0).mean() > 0.95
    assert client.update_priorities("per", [999_999], [1.0]) == (0, 1)
    client.delete_buffer("per")


def test_descriptions_report_the_priority_mass_and_the_smallest_positive_leaf(client) -> None:
    """prioritized.total is the sum tree's root (sum of p^alpha), prioritized.min_positive its smallest positive
    leaf (0 when no step has a positive priority): what a client sampling several servers splits batches by."""
    schema = {"obs": ("float32", (3,)), "action": ("int64", ())}
    empty = client.create_buffer("per", 1000, schema, sampler=Prioritized(alpha=0.5))["counters"]
    assert (empty["prioritized.total"], empty["prioritized.min_positive"]) == (0.0, 0.0)
    client.insert_episode("per", True, obs=np.zeros((5, 3), np.float32), action=np.arange(4))
    fresh = client.describe("per")["counters"]
    assert (fresh["prioritized.total"], fresh["prioritized.min_positive"]) == (4.0, 1.0)  # new steps: priority 1
    keys = np.unique(client.sample("per", 64, include_keys=True, seed=0)["key"])
    assert keys.size == 4
    priorities = np.array([4.0, 9.0, 16.0, 0.0])
    client.update_priorities("per", keys, priorities)
    updated = client.describe("per")["counters"]
    assert updated["prioritized.total"] == pytest.approx(2 + 3 + 4)
    assert updated["prioritized.min_positive"] == pytest.approx(2.0)
    client.delete_buffer("per")


def test_importance_weights_survive_priority_ratios_beyond_float64() -> None:
    """Leaves from 1e-300 to 1e100: p / p_min overflows, and inf ** -beta made every weight 0."""
    rng = np.random.default_rng(5)
    buffer = new_buffer(100, alpha=1.0)
    try:
        insert_episodes(buffer, rng, [4], 0)
        keys = live_keys(buffer)
        buffer.update_priorities(keys, np.array([1e-300, 1e100, 1e100, 1e100]))
        batch = buffer.sample(64, StatesMode(), rng, include_keys=True, importance_beta=0.01)
        expected = np.exp(-0.01 * (np.log(1e100) - np.log(1e-300)))  # (p / p_min)^-beta, about 1e-4
        np.testing.assert_allclose(batch["weight"][batch["key"] != keys[0]], expected, rtol=1e-5)
    finally:
        buffer.close()


def test_draws_of_leaves_a_writer_zeroed_are_redrawn_then_marked_torn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock-free reader may land on a leaf the writer has since zeroed: such draws are drawn again, and
    those still zero get a HOLE bound (the reader then redraws the batch), with finite weights."""
    buffer = new_buffer(200)
    try:
        insert_episodes(buffer, np.random.default_rng(0), [20, 30], first_id=1)
        tree, real_get = buffer.sampler.tree, buffer.sampler.tree.get
        zeroed = int(live_keys(buffer)[0]) % buffer.capacity
        monkeypatch.setattr(tree, "get", lambda leaves: np.where(np.asarray(leaves) == zeroed, 0.0, real_get(leaves)))
        rng = np.random.default_rng(1)
        draw = buffer.draw(500, rng, importance_beta=0.5)
        assert zeroed not in draw.rows[draw.bounds != HOLE]  # redrawn away...
        assert np.isfinite(draw.extra["weight"]).all() and (draw.extra["probability"] > 0).all()
        monkeypatch.setattr(tree, "get", lambda leaves: np.zeros(len(leaves)))  # ...or, never positive, torn
        draw = buffer.draw(8, rng, importance_beta=0.5)
        assert (draw.bounds == HOLE).all() and np.isfinite(draw.extra["weight"]).all()
    finally:
        buffer.close()


def test_a_batch_drawn_in_rounds_weighs_equal_priorities_alike() -> None:
    """max_times_sampled=1 draws a batch in rounds, each retiring what it drew. Every round normalizes its
    weights against the first round's smallest priority: against the smallest priority left, once the 0.5
    step is retired, priority-1 steps drawn after it would get weight 1 while those drawn before got 0.5."""
    rounds_seen = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        buffer = EpisodicBuffer("rounds", f"test{os.getpid()}", FIELDS, 200, sampler=PrioritizedSampler(1.0),
                                remover=MaxTimesSampledRemover(1))
        try:
            insert_episodes(buffer, rng, [10], 0)
            keys = live_keys(buffer)
            priorities = np.ones(keys.size)
            priorities[0] = 0.5  # the smallest priority of the buffer
            buffer.update_priorities(keys, priorities)
            batch = buffer.sample(8, StatesMode(), rng, include_keys=True, importance_beta=1.0)
            expected = np.where(batch["key"] == keys[0], 1.0, 0.5)  # (p / p_min)^-beta
            np.testing.assert_array_equal(batch["weight"], expected.astype(np.float32), err_msg=f"seed {seed}")
            rounds_seen += int(keys[0] in batch["key"])
        finally:
            buffer.close()
    assert rounds_seen  # some batches drew the smallest priority, and so retired it in an early round
