"""The demos' environments: CartPole without velocities, and bit flipping as a goal env."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from replayd.client.envs import BIT_FLIPPING, CARTPOLE_POMDP, BitFlippingEnv, HideVelocities


def test_the_pomdp_keeps_cart_position_and_pole_angle_of_cartpoles_state() -> None:
    env = gym.make(CARTPOLE_POMDP)
    full = gym.make("CartPole-v1")
    assert env.observation_space.shape == (2,)
    np.testing.assert_array_equal(env.observation_space.high, full.observation_space.high[[0, 2]])
    obs, _ = env.reset(seed=3)
    state, _ = full.reset(seed=3)
    np.testing.assert_array_equal(obs, state[[0, 2]])
    for action in [0, 1, 1, 0, 1]:
        obs, reward, terminated, truncated, _ = env.step(action)
        state, full_reward, full_terminated, full_truncated, _ = full.step(action)
        np.testing.assert_array_equal(obs, state[[0, 2]])
        assert (reward, terminated, truncated) == (full_reward, full_terminated, full_truncated)
    assert obs.dtype == np.float32 and env.observation_space.contains(obs)


def test_the_pomdp_keeps_cartpoles_time_limit() -> None:
    env = gym.make(CARTPOLE_POMDP)
    env.reset(seed=0)
    env.unwrapped.theta_threshold_radians = np.inf  # never falls: the episode is cut at 500 steps
    env.unwrapped.x_threshold = np.inf
    steps, truncated = 0, False
    while not truncated:
        _, _, terminated, truncated, _ = env.step(steps % 2)
        steps += 1
        assert not terminated
    assert steps == 500


def test_hide_velocities_refuses_entries_the_observation_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"kept must name entries in 0..3, got \[0, 4\]"):
        HideVelocities(gym.make("CartPole-v1"), kept=(0, 4))


def test_bit_flipping_spaces() -> None:
    env = gym.make(BIT_FLIPPING)
    assert env.action_space == gym.spaces.Discrete(15)
    assert set(env.observation_space.spaces) == {"observation", "achieved_goal", "desired_goal"}
    for space in env.observation_space.spaces.values():
        assert space == gym.spaces.MultiBinary(15)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs) and info == {"is_success": False}


def test_bit_flipping_flips_the_chosen_bit_and_ends_on_the_goal() -> None:
    env = BitFlippingEnv(n_bits=5)
    obs, _ = env.reset(seed=1)
    differing = np.flatnonzero(obs["observation"] != obs["desired_goal"])
    assert len(differing) >= 1  # never solved at reset
    for i, bit in enumerate(differing):
        before = obs["observation"].copy()
        obs, reward, terminated, truncated, info = env.step(int(bit))
        flipped = before.copy()
        flipped[bit] ^= 1
        np.testing.assert_array_equal(obs["observation"], flipped)
        np.testing.assert_array_equal(obs["achieved_goal"], flipped)
        last = i == len(differing) - 1
        assert (reward, terminated, truncated, info["is_success"]) == ((0.0, True, False, True) if last else
                                                                      (-1.0, False, False, False))


def test_bit_flipping_is_truncated_after_n_steps() -> None:
    env = BitFlippingEnv(n_bits=4)
    obs, _ = env.reset(seed=2)
    wrong = int(np.flatnonzero(obs["observation"] == obs["desired_goal"])[0])  # flipping it twice changes nothing
    ended = [env.step(wrong)[2:4] for _ in range(4)]
    assert ended == [(False, False)] * 3 + [(False, True)]


def test_compute_reward_agrees_with_the_steps_rewards() -> None:
    env = BitFlippingEnv(n_bits=6)
    rng = np.random.default_rng(0)
    achieved, desired, rewards, ends = [], [], [], []
    for episode in range(30):
        obs, _ = env.reset(seed=episode)
        done = False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(int(rng.integers(6)))
            achieved.append(obs["achieved_goal"])
            desired.append(obs["desired_goal"])
            rewards.append(reward)
            ends.append(terminated)
            done = terminated or truncated
    assert 0.0 in rewards  # some random episodes reach their goal
    achieved_goal, desired_goal = np.stack(achieved), np.stack(desired)
    np.testing.assert_array_equal(env.compute_reward(achieved_goal, desired_goal, None), rewards)
    np.testing.assert_array_equal(env.compute_terminated(achieved_goal, desired_goal, None), ends)
    leading = env.compute_reward(achieved_goal[:12].reshape(3, 4, 6), desired_goal[:12].reshape(3, 4, 6), None)
    np.testing.assert_array_equal(leading, np.reshape(rewards[:12], (3, 4)))


def test_bit_flipping_resets_reproducibly_from_a_seed() -> None:
    first, second = BitFlippingEnv(), BitFlippingEnv()
    for seed in (0, 1, 123):
        a, _ = first.reset(seed=seed)
        b, _ = second.reset(seed=seed)
        assert all(np.array_equal(a[name], b[name]) for name in a)
    c, _ = first.reset(seed=0)
    d, _ = first.reset(seed=1)
    assert not np.array_equal(c["desired_goal"], d["desired_goal"])


@pytest.mark.parametrize(("options", "message"), [
    ({"n_bits": 0}, "n_bits must be >= 1, got 0"),
    ({"max_episode_steps": 0}, "max_episode_steps must be >= 1, got 0"),
])
def test_bit_flipping_refuses_bad_sizes(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        BitFlippingEnv(**options)


def test_bit_flipping_refuses_an_action_that_names_no_bit() -> None:
    env = BitFlippingEnv(n_bits=3)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"action: expected an integer in 0..2, got 3"):
        env.step(3)
