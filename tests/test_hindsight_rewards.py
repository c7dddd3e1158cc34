"""Rewards and terminations of relabeled goals, recomputed on the client from the batch's goals."""

from __future__ import annotations

import numpy as np
import pytest

from replayd.client.envs import BitFlippingEnv
from replayd.client.hindsight import recompute_rewards, recompute_terminations
from tests.spec_batches import Episode, hindsight_batch


def bit_flipping_episode(seed: int) -> Episode:
    """An episode of the bit-flipping env under random actions."""
    env = BitFlippingEnv(n_bits=4)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    rows, actions, rewards = [obs], [], []
    while True:
        action = int(rng.integers(4))
        obs, reward, terminated, truncated, _ = env.step(action)
        rows.append(obs)
        actions.append(action)
        rewards.append(reward)
        if terminated or truncated:
            break
    return Episode({name: np.stack([row[name] for row in rows]) for name in rows[0]},
                   {"action": np.array(actions), "reward": np.array(rewards, np.float32)}, terminated)


def read_only(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for array in batch.values():
        array.flags.writeable = False  # as decoded server batches are
    return batch


def test_relabeled_rewards_and_terminations_are_the_envs_for_the_relabeled_goal() -> None:
    episodes = [bit_flipping_episode(seed) for seed in range(4)]
    picks = [(e, t, k) for e, episode in enumerate(episodes) for t in range(episode.length)
             for k in range(episode.length - t + 1)]  # every step, its stored goal and every later achieved one
    batch = read_only(hindsight_batch(episodes, picks))
    stored_reward = batch["reward"].copy()
    env = BitFlippingEnv(n_bits=4)
    out = recompute_terminations(env.compute_terminated)(recompute_rewards(env.compute_reward)(batch))
    reached = np.all(batch["next_achieved_goal"] == batch["desired_goal"], axis=1)
    np.testing.assert_array_equal(out["reward"], np.where(reached, 0.0, -1.0))
    np.testing.assert_array_equal(out["terminated"], reached)
    assert out["reward"].dtype == np.float32 and out["terminated"].dtype == bool
    relabeled_to_next = batch["goal_offset"] == 1  # the goal is the state the step reaches: success
    assert relabeled_to_next.any() and (out["reward"][relabeled_to_next] == 0).all()
    kept = ~batch["relabeled"]  # the stored goal: the env's own reward and termination
    np.testing.assert_array_equal(out["reward"][kept], stored_reward[kept])
    np.testing.assert_array_equal(out["terminated"][kept], batch["terminated"][kept])
    np.testing.assert_array_equal(batch["reward"], stored_reward)  # the batch itself is left as it was


def test_other_field_names_are_read_and_written() -> None:
    batch = {"next_pos": np.array([[1.0], [2.0]]), "target": np.array([[1.0], [5.0]]),
             "r": np.zeros(2, np.float64)}
    out = recompute_rewards(lambda a, d, info: -np.abs(a - d)[:, 0], achieved="pos", desired="target",
                            reward="r")(batch)
    np.testing.assert_array_equal(out["r"], [0.0, -3.0])


def test_a_compute_reward_of_the_wrong_shape_is_refused() -> None:
    batch = {"next_achieved_goal": np.zeros((3, 2)), "desired_goal": np.zeros((3, 2)),
             "reward": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"compute_reward for batch\['reward'\]: expected shape \(3,\) .*got \(3, 2\)"):
        recompute_rewards(lambda a, d, info: a - d)(batch)
