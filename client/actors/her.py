"""Epsilon-greedy goal-conditioned actor for hindsight replay: bit flipping (15 bits), whole episodes of its
goal observation (`observation`, `achieved_goal`, `desired_goal`) into an episodic buffer whose goal fields
the learner relabels, newest Q-network (input: observation and desired goal side by side)."""

from __future__ import annotations

import time
from dataclasses import dataclass

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
from replayd.client.envs import BIT_FLIPPING
from replayd.client.trainers.her import goal_input
from replayd.client.trainers.q_network import QNetwork

BUFFER = "bit_flipping"
WEIGHTS = "her_q"
HIDDEN = (256,)


@dataclass
class HERActorConfig:
    address: str
    buffer: str = BUFFER
    weights: str = WEIGHTS
    env_id: str = BIT_FLIPPING
    seed: int = 0
    seconds: float = 3600.0
    epsilon_start: float = 1.0
    epsilon_end: float = 0.1
    epsilon_decay_steps: int = 10_000
    fetch_every: int = 100  # env steps between weight checks
    hidden: tuple[int, ...] = HIDDEN


def run_her_actor(config: HERActorConfig, stop: StopEvent | None = None) -> ActorReport:
    """Epsilon-greedy goal-conditioned actor until `config.seconds` pass, `stop` is set or the learner publishes
    its final weights."""
    from replayd.client.envs import make

    torch.set_num_threads(1)
    env = make(config.env_id)
    rng = action_rng(config.seed)
    bits = int(env.observation_space["observation"].n)
    network = QNetwork(2 * bits, int(env.action_space.n), config.hidden)
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
        if explores(rng, epsilon_at(steps, config)):
            action = int(rng.integers(env.action_space.n))
        else:
            with torch.no_grad():
                action = int(network(torch.from_numpy(goal_input(obs["observation"], obs["desired_goal"]))[None])
                             .argmax(1))
        next_obs, reward, terminated, truncated, _ = env.step(action)
        steps += 1
        if recorder.record(obs, {"action": action, "reward": reward}, next_obs, terminated, truncated):
            next_obs, _ = env.reset()
        obs = next_obs
    report.pushed = recorder.close()
    report.env_steps = steps
    client.close()
    return report
