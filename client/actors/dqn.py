"""Epsilon-greedy DQN actor: one environment, whole episodes into an episodic buffer, newest Q-network."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from replayd.client.actors.common import (
    ActorReport,
    EpisodeActorRun,
    EpsilonGreedyConfig,
    StopEvent,
    action_rng,
    epsilon_at,
    explores,
)
from replayd.client.trainers.q_network import QNetwork


@dataclass
class DQNActorConfig(EpsilonGreedyConfig):
    hidden: tuple[int, ...] = (128, 128)


def run_dqn_actor(config: DQNActorConfig, stop: StopEvent | None = None) -> ActorReport:
    """Epsilon-greedy actor until `config.seconds` pass, `stop` is set or the learner publishes its final weights."""
    from replayd.client.envs import make

    torch.set_num_threads(1)
    env = make(config.env_id)
    rng = action_rng(config.seed)
    network = QNetwork(int(np.prod(env.observation_space.shape)), int(env.action_space.n), config.hidden)
    run = EpisodeActorRun.start(config, stop)
    if run is None:
        return ActorReport()
    obs, _ = env.reset(seed=config.seed)
    steps = 0
    while not run.stopped() and not run.learner_finished(steps, network):
        if run.report.weights_version == 0 or explores(rng, epsilon_at(steps, config)):
            action = int(rng.integers(env.action_space.n))
        else:
            with torch.no_grad():
                action = int(network(torch.as_tensor(obs, dtype=torch.float32)[None]).argmax(1))
        next_obs, reward, terminated, truncated, _ = env.step(action)
        steps += 1
        if run.recorder.step(obs, action, reward, next_obs, terminated, truncated):
            next_obs, _ = env.reset()
        obs = next_obs
    return run.close(steps)
