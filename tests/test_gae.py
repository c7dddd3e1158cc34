"""GAE against a plain float64 per-env, per-step loop, including exact truncation bootstrapping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replayd.server.gae import GaeWorkspace, block_size, compute_gae


def reference_gae(reward, value, terminated, truncated, final_value, bootstrap, gamma, lam):
    """The textbook loop, one env and one step at a time, in float64."""
    T, N = reward.shape
    advantage = np.zeros((T, N), np.float64)
    for env in range(N):
        next_advantage = 0.0
        for t in reversed(range(T)):
            if truncated[t, env]:
                next_value = float(final_value[t, env])
            elif t == T - 1:
                next_value = float(bootstrap[env])
            else:
                next_value = float(value[t + 1, env])
            not_terminated = 0.0 if terminated[t, env] else 1.0
            not_done = 0.0 if (terminated[t, env] or truncated[t, env]) else 1.0
            delta = float(reward[t, env]) + gamma * next_value * not_terminated - float(value[t, env])
            next_advantage = delta + gamma * lam * not_done * next_advantage
            advantage[t, env] = next_advantage
    return advantage, advantage + value.astype(np.float64)


def random_rollout(rng, T, N, end_prob=0.1):
    return dict(
        reward=rng.standard_normal((T, N)).astype(np.float32),
        value=rng.standard_normal((T, N)).astype(np.float32) * 5,
        terminated=rng.random((T, N)) < end_prob,
        truncated=rng.random((T, N)) < end_prob,
        final_value=rng.standard_normal((T, N)).astype(np.float32) * 5,
        bootstrap=rng.standard_normal(N).astype(np.float32) * 5,
    )


def run_gae(r, gamma, lam, block=None):
    T, N = r["reward"].shape
    advantage = np.full((T, N), np.nan, np.float32)
    returns = np.full((T, N), np.nan, np.float32)
    compute_gae(
        r["reward"], r["value"], r["terminated"], r["truncated"], r["final_value"], r["bootstrap"],
        gamma, lam, advantage, returns, GaeWorkspace(T, N, block),
    )
    return advantage, returns


def assert_matches_reference(r, gamma, lam, block=None):
    advantage, returns = run_gae(r, gamma, lam, block)
    ref_adv, ref_ret = reference_gae(
        r["reward"], r["value"], r["terminated"], r["truncated"], r["final_value"], r["bootstrap"], gamma, lam
    )
    # 1e-5 relative; the tiny absolute floor only covers exact zeros.
    np.testing.assert_allclose(advantage, ref_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(returns, ref_ret, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,N", [(1, 1), (1, 5), (2, 3), (25, 4), (64, 3), (129, 2), (300, 5)])
@pytest.mark.parametrize("block", [None, 1, 7, 10_000])
def test_matches_reference_loop(T, N, block):
    assert_matches_reference(random_rollout(np.random.default_rng(T * 100 + N), T, N), 0.99, 0.95, block)


def test_episode_ends_at_first_and_last_step():
    rng = np.random.default_rng(1)
    r = random_rollout(rng, 40, 6, end_prob=0.0)
    r["terminated"][0, 0] = r["terminated"][-1, 1] = True
    r["truncated"][0, 2] = r["truncated"][-1, 3] = True
    r["terminated"][-1, 4] = r["truncated"][-1, 4] = True  # both: termination wins
    r["terminated"][:, 5] = True  # every step ends
    assert_matches_reference(r, 0.99, 0.95)
    advantage, _ = run_gae(r, 0.99, 0.95)
    # Env 1 terminates at the last step: the bootstrap value must not enter.
    np.testing.assert_allclose(advantage[-1, 1], r["reward"][-1, 1] - r["value"][-1, 1], rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(1, 80),
    N=st.integers(1, 9),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    end_prob=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    block=st.one_of(st.none(), st.integers(1, 100)),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_matches_reference(T, N, gamma, lam, end_prob, block, seed):
    assert_matches_reference(random_rollout(np.random.default_rng(seed), T, N, end_prob), gamma, lam, block)


def test_truncation_bootstraps_from_final_value_termination_does_not():
    # Two envs, three steps, γ = 0.5, λ = 1 (hand-computed below).
    #  env 0: truncated at t = 1 with final_value 10; env 1: terminated at t = 1.
    r = dict(
        reward=np.array([[1, 1], [1, 1], [1, 1]], np.float32),
        value=np.array([[2, 2], [4, 4], [8, 8]], np.float32),
        terminated=np.array([[0, 0], [0, 1], [0, 0]], bool),
        truncated=np.array([[0, 0], [1, 0], [0, 0]], bool),
        final_value=np.array([[99, 99], [10, 10], [99, 99]], np.float32),  # 99s must be ignored
        bootstrap=np.array([6, 6], np.float32),
    )
    advantage, returns = run_gae(r, 0.5, 1.0)
    # t=2: δ = 1 + 0.5·6 − 8 = −4 (both envs), A = −4
    # env 0, t=1 (truncated): δ = 1 + 0.5·10 − 4 = 2, no carry over the boundary: A = 2
    # env 1, t=1 (terminated): δ = 1 − 4 = −3, A = −3
    # t=0: δ = 1 + 0.5·4 − 2 = 1; A = 1 + 0.5·A_1 → env 0: 2, env 1: −0.5
    expected = np.array([[2.0, -0.5], [2.0, -3.0], [-4.0, -4.0]], np.float32)
    np.testing.assert_array_equal(advantage, expected)
    np.testing.assert_array_equal(returns, expected + r["value"])
    # Treating truncation as termination (esper-lite's GAE does) would give A_1 = −3 for env 0.
    assert advantage[1, 0] != advantage[1, 1]


def test_long_horizon_accuracy_float32_inputs():
    # γ = λ = 1 with no episode end: A_0 sums 4096 deltas, where float32 accumulation would drift.
    r = random_rollout(np.random.default_rng(7), 4096, 3, end_prob=0.0)
    assert_matches_reference(r, 1.0, 1.0)


def test_workspace_shape_checked_and_reused():
    r = random_rollout(np.random.default_rng(3), 10, 4)
    ws = GaeWorkspace(10, 4)
    adv, ret = np.empty((10, 4), np.float32), np.empty((10, 4), np.float32)
    args = (r["reward"], r["value"], r["terminated"], r["truncated"], r["final_value"], r["bootstrap"])
    compute_gae(*args, 0.9, 0.8, adv, ret, ws)
    first = adv.copy()
    compute_gae(*args, 0.9, 0.8, adv, ret, ws)  # stale workspace contents must not leak in
    np.testing.assert_array_equal(adv, first)
    with pytest.raises(ValueError, match="workspace"):
        compute_gae(*args, 0.9, 0.8, adv, ret, GaeWorkspace(11, 4))


@pytest.mark.parametrize("T,expected", [(1, 1), (2, 2), (4, 2), (5, 3), (2048, 46)])
def test_block_size_is_ceil_sqrt(T, expected):
    assert block_size(T) == expected
