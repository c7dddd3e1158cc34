"""Real Atari frames: Pong and Breakout through gymnasium's AtariPreprocessing (84x84 grayscale) and
FrameStackObservation(4), played by a random policy. An actor inserts single frames (EpisodeWriter keeps the
newest frame of each stacked observation); every sampled stacked `obs`, `next_obs` and `bootstrap_obs` must
equal, byte for byte, the stacked observation the wrapper produced at that step, across episode starts."""

from __future__ import annotations

import ale_py
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

from replayd.client import EpisodeWriter, Frames, ReplayClient, Sequences, Transitions

gym.register_envs(ale_py)
STEPS = 240  # per game
EPISODE_STEPS = 40  # episodes are truncated after this many steps: many episode starts among the samples


def atari(game: str) -> gym.Env:
    env = gym.make(f"ALE/{game}-v5", frameskip=1)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True)
    return FrameStackObservation(env, 4, padding_type="reset")


def play(client: ReplayClient, buffer: str, game: str) -> dict[tuple[int, int], np.ndarray]:
    """Plays STEPS steps into `buffer`; returns each state's stacked observation by (episode id, step)."""
    env = atari(game)
    env.action_space.seed(0)
    stacks: dict[tuple[int, int], np.ndarray] = {}
    obs, _ = env.reset(seed=0)
    t = 0
    with EpisodeWriter(client, buffer, chunk_rows=25) as writer:
        for _ in range(STEPS):
            stacks[(writer._episode_id, t)] = obs
            action = int(env.action_space.sample())
            next_obs, reward, terminated, truncated, _ = env.step(action)
            writer.append(obs=obs, t=t, action=action, reward=float(reward))
            obs, t = next_obs, t + 1
            if terminated or truncated or t == EPISODE_STEPS:
                stacks[(writer._episode_id, t)] = obs
                writer.end_episode(terminated=terminated, obs=obs)
                obs, _ = env.reset()
                t = 0
    env.close()
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
    return stacks


@pytest.mark.parametrize("game", ["Pong", "Breakout"])
def test_sampled_stacks_are_the_wrappers_stacks_byte_for_byte(client: ReplayClient, game: str) -> None:
    schema = {"obs": ("uint8", (84, 84), Frames(stack=4, stack_axis=0)), "t": ("int64", ()),
              "action": ("int64", ()), "reward": ("float32", ())}
    client.create_buffer("atari", 2 * STEPS, schema, observation_fields=("obs",))
    stacks = play(client, "atari", game)
    near_start = 0
    for mode in (Transitions(1), Transitions(3, 0.9)):
        for batch in client.sample_stream("atari", 32, mode, num_batches=8, include_keys=True, seed=1):
            for i, (episode_id, t) in enumerate(zip(batch["episode_id"].tolist(), batch["t"].tolist(), strict=True)):
                np.testing.assert_array_equal(batch["obs"][i], stacks[(episode_id, t)])
                np.testing.assert_array_equal(batch["next_obs"][i], stacks[(episode_id, t + 1)])
                last = max(step for episode, step in stacks if episode == episode_id)
                bootstrap = t + min(mode.n_step, last - t)
                np.testing.assert_array_equal(batch["bootstrap_obs"][i], stacks[(episode_id, bootstrap)])
                near_start += t < 3
    assert near_start > 0, "some samples lie at an episode's start, where the wrapper repeats the first frame"
    sequences = client.sample("atari", 8, Sequences(EPISODE_STEPS // 2), include_keys=True, seed=2)
    for i, episode_id in enumerate(sequences["episode_id"].tolist()):
        for j, t in enumerate(sequences["t"][i].tolist()):
            if sequences["mask"][i, j]:
                np.testing.assert_array_equal(sequences["obs"][i, j], stacks[(episode_id, t)])
