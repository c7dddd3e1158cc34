"""Gridworld dynamics, exact Laplacian eigenvectors, cosine metric, and the ALLO data sampler."""

from __future__ import annotations

import numpy as np
import pytest

from bench.allo_paper_check import collect_episodes, make_numpy_sampler, sampled_laplacian_eigenvectors
from replayd.client.gridworld import GridWorld, cosine_similarities, parse_layout


def test_four_rooms_shape_and_observations():
    env = GridWorld("four_rooms")
    assert env.n_states == 104
    obs = env.all_observations()
    assert obs.shape == (104, 2) and obs.dtype == np.float32
    assert obs.min() >= 0.0 and obs.max() <= 1.0
    assert len({tuple(o) for o in obs}) == 104
    o, _ = env.reset(seed=0)
    assert env.observation_space.contains(o)


def test_walls_block_moves():
    env = GridWorld("#####\n#   #\n#####", max_episode_steps=3)
    env.reset(seed=0)
    env._state = 0  # leftmost free cell
    _, _, term, trunc, info = env.step(2)  # left: wall
    assert info["state"] == 0 and not term and not trunc
    _, _, _, _, info = env.step(0)  # right
    assert info["state"] == 1
    _, _, _, trunc, info = env.step(1)  # up: wall
    assert info["state"] == 1 and trunc  # third step truncates
    with pytest.raises(ValueError):
        env.step(4)
    with pytest.raises(ValueError):
        parse_layout("###\n###")


@pytest.mark.parametrize("discount", [None, 0.9])
def test_eigenvectors_satisfy_eigen_equation(discount):
    env = GridWorld("four_rooms")
    L = env.laplacian(discount)
    vals, vecs = env.laplacian_eigenvectors(10, discount)
    np.testing.assert_allclose(L @ vecs, vecs * vals, atol=1e-10)
    np.testing.assert_allclose(vecs.T @ vecs, np.eye(10), atol=1e-10)
    assert np.all(np.diff(vals) >= -1e-12)
    assert abs(vals[0]) < 1e-10
    # First eigenvector is constant (uniform random walk with self-loops is doubly stochastic).
    np.testing.assert_allclose(vecs[:, 0], np.full(104, 1 / np.sqrt(104)), atol=1e-8)


def test_transition_matrix_symmetric_stochastic():
    P = GridWorld("four_rooms").transition_matrix()
    np.testing.assert_allclose(P, P.T)
    np.testing.assert_allclose(P.sum(1), 1.0)


def test_geometric_operator_has_same_eigenvectors():
    env = GridWorld("four_rooms")
    _, v = env.laplacian_eigenvectors(10)
    _, vg = env.laplacian_eigenvectors(10, discount=0.9)
    np.testing.assert_allclose(cosine_similarities(v, vg), 1.0, atol=1e-6)


def test_cosine_metric_truth_sign_and_scale_invariant():
    env = GridWorld("four_rooms")
    _, v = env.laplacian_eigenvectors(10)
    np.testing.assert_allclose(cosine_similarities(v, v), 1.0)
    flipped = v * np.array([1, -1] * 5) * 3.7
    np.testing.assert_allclose(cosine_similarities(flipped, v), 1.0)
    # Swapping two dimensions gives ~0 on those dimensions (orthogonal eigenvectors).
    swapped = v[:, [0, 2, 1, 3, 4, 5, 6, 7, 8, 9]]
    cos = cosine_similarities(swapped, v)
    assert cos[1] < 1e-8 and cos[2] < 1e-8 and np.allclose(cos[[0, 3]], 1.0)
    rng = np.random.default_rng(0)
    assert cosine_similarities(v + 0.1 * rng.standard_normal(v.shape), v).mean() < 0.999
    with pytest.raises(ValueError):
        cosine_similarities(v, v[:, :3])


def test_collect_and_sample():
    env = GridWorld("four_rooms", max_episode_steps=20)
    eps = collect_episodes(env, 30, seed=1)
    assert len(eps) == 30
    for ep in eps:
        assert ep["obs"].shape == (21, 2) and ep["action"].shape == (20,) and ep["reward"].shape == (20,)
    sample = make_numpy_sampler(eps, 0.9, seed=0)
    b = sample("geometric", 20000)
    k = b["offset"]
    assert k.min() >= 1 and k.max() <= 20
    # Future obs is a state reachable in k steps: Manhattan distance (in cells) <= k.
    cells = np.abs(b["future_obs"] - b["obs"]) * np.array([env.width - 1, env.height - 1])
    assert np.all(cells.sum(1) <= k + 1e-4)
    # Offset law: start uniform over the 20 transitions, so M = 20 - t is uniform on 1..20 and
    # P(k) = mean_M gamma^(k-1) (1-gamma) / (1-gamma^M) 1{k <= M}.
    g, Ms = 0.9, np.arange(1, 21)
    for kk in range(1, 6):
        expected = np.mean(np.where(kk <= Ms, g ** (kk - 1) * (1 - g) / (1 - g**Ms), 0.0))
        assert (k == kk).mean() == pytest.approx(expected, abs=0.01), kk
    assert sample("states", 7)["obs"].shape == (7, 2)
    with pytest.raises(ValueError):
        sample("bogus", 1)


def test_numpy_sampler_draws_states_like_the_server_never_an_episodes_final_observation():
    """The server's "states" mode draws steps (service/samplers/states.py): an episode's final observation, where
    no step starts, is never drawn. The numpy sampler, a cross-check of the server's sampling, does the same."""
    eps = [{"obs": start + np.arange(length + 1, dtype=np.float32)[:, None], "action": np.zeros(length, np.int64),
            "reward": np.zeros(length, np.float32)} for start, length in ((0, 4), (10, 7))]
    drawn = make_numpy_sampler(eps, 0.9, seed=0)("states", 20000)["obs"][:, 0].astype(np.int64)
    assert not np.isin(drawn, [4, 17]).any()  # the final observations
    # Uniform over the 11 steps (0..3 and 10..16).
    counts = np.bincount(drawn, minlength=18) / len(drawn)
    np.testing.assert_allclose(counts[[0, 1, 2, 3, 10, 11, 12, 13, 14, 15, 16]], 1 / 11, atol=0.01)


def test_state_indices_invert_observations():
    env = GridWorld("four_rooms")
    obs = env.all_observations()
    np.testing.assert_array_equal(env.state_indices(obs), np.arange(env.n_states))
    np.testing.assert_array_equal(env.state_indices(obs[[5, 3, 5]]), [5, 3, 5])
    with pytest.raises(ValueError, match="free cell"):
        env.state_indices(np.array([[0.0, 0.0]], dtype=np.float32))  # the corner is a wall


def test_sampled_laplacian_is_the_samplers_operator():
    # A 4-cell corridor (distinct eigenvalues): with many walks the operator the samplers induce
    # has the true eigenvectors; with few it is still a D_u-orthonormal eigenbasis of that operator.
    env = GridWorld("######\n#    #\n######", max_episode_steps=10)
    _, true = env.laplacian_eigenvectors(4)
    vals, vecs = sampled_laplacian_eigenvectors(env, collect_episodes(env, 4000, seed=0), 0.9, 4)
    assert np.all(np.diff(vals) > 0) and abs(vals[0]) < 1e-10
    assert cosine_similarities(vecs, true).min() > 0.99
    few = collect_episodes(GridWorld("four_rooms", max_episode_steps=50), 300, seed=0)
    env4 = GridWorld("four_rooms", max_episode_steps=50)
    _, v4 = sampled_laplacian_eigenvectors(env4, few, 0.9, 10)
    # Orthonormal under the law of the server's "states" mode: observations of steps, each episode's final one
    # (no step starts there) left out.
    visits = np.bincount(np.concatenate([env4.state_indices(ep["obs"][:-1]) for ep in few]), minlength=env4.n_states)
    np.testing.assert_allclose(v4.T @ (v4 * (visits / visits.sum())[:, None]), np.eye(10), atol=1e-8)
    with pytest.raises(ValueError, match="never visited"):
        sampled_laplacian_eigenvectors(env4, few[:1], 0.9, 10)


def test_actions_move_right_up_left_down_with_y_growing_downward():
    env = GridWorld("one_room")
    env.reset(seed=0)
    center = env.n_states // 2
    moved = []
    for action in range(4):
        env._state = center
        obs, _, _, _, _ = env.step(action)
        moved.append(np.sign(obs - env.all_observations()[center]).tolist())
    assert moved == [[1, 0], [0, -1], [-1, 0], [0, 1]]  # (x, y) per action: right, up, left, down


@pytest.mark.parametrize("layout", ["four_rooms", "one_room", "two_rooms"])
@pytest.mark.parametrize("discount", [None, 0.9])
def test_each_eigenvectors_largest_entry_is_positive(layout, discount):
    """The sign convention makes eigenvectors comparable across runs (eigh's signs are arbitrary)."""
    _, eigvecs = GridWorld(layout).laplacian_eigenvectors(8, discount)
    largest = eigvecs[np.abs(eigvecs).argmax(axis=0), np.arange(8)]
    assert (largest > 0).all(), largest


def test_reset_with_a_seed_repeats_the_start_states():
    def starts(env):
        first, _ = env.reset(seed=123)
        return [first.tolist()] + [env.reset()[0].tolist() for _ in range(7)]

    assert starts(GridWorld("four_rooms")) == starts(GridWorld("four_rooms"))
