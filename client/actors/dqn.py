"""Epsilon-greedy DQN actor: one environment, whole episodes into an episodic buffer, newest Q-network."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from replayd.client.actors.common import (
    ActorReport,
    EpisodeRecorder,
    StopEvent,
    action_rng,
    connect,
    epsilon_at,
    explores,
    refresh_weights,
    stop_condition,
)
from replayd.client.trainers.q_network import QNetwork


@dataclass
class DQNActorConfig:
    address: str
    buffer: str = "cartpole"
    weights: str = "q"
    env_id: str = "CartPole-v1"
    seed: int = 0
    seconds: float = 3600.0
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    epsilon_decay_steps: int = 10_000
    fetch_every: int = 100  # env steps between weight checks
    hidden: tuple[int, ...] = (128, 128)


def run_dqn_actor(config: DQNActorConfig, stop: StopEvent | None = None) -> ActorReport:
    """Epsilon-greedy actor until `config.seconds` pass, `stop` is set or the learner publishes its final weights."""
    from replayd.client.envs import make

    torch.set_num_threads(1)
    env = make(config.env_id)
    rng = action_rng(config.seed)
    network = QNetwork(int(np.prod(env.observation_space.shape)), int(env.action_space.n), config.hidden)
    report = ActorReport()
    stopped = stop_condition(config.seconds, stop)
    client = connect(config.address, config.buffer, stopped, weights=config.weights)
    if client is None:
        return report
    recorder = EpisodeRecorder(client, config.buffer, retry_deadline=time.monotonic() + config.seconds)
    obs, _ = env.reset(seed=config.seed)
    steps = 0
    while not stopped():
        if steps % config.fetch_every == 0:
            report.weights_version, learner_finished = refresh_weights(client, config.weights,
                                                                       report.weights_version, network)
            if learner_finished:
                break
        if report.weights_version == 0 or explores(rng, epsilon_at(steps, config)):
            action = int(rng.integers(env.action_space.n))
        else:
            with torch.no_grad():
                action = int(network(torch.as_tensor(obs, dtype=torch.float32)[None]).argmax(1))
        next_obs, reward, terminated, truncated, _ = env.step(action)
        steps += 1
        if recorder.step(obs, action, reward, next_obs, terminated, truncated):
            next_obs, _ = env.reset()
        obs = next_obs
    report.pushed = recorder.close()
    report.env_steps = steps
    client.close()
    return report
