"""Epsilon-greedy goal-conditioned actor for hindsight replay: bit flipping (15 bits), whole episodes of its
goal observation (`observation`, `achieved_goal`, `desired_goal`) into an episodic buffer whose goal fields
the learner relabels, newest Q-network (input: observation and desired goal side by side)."""

from __future__ import annotations

from dataclasses import dataclass

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
from replayd.client.envs import BIT_FLIPPING
from replayd.client.trainers.her import goal_input
from replayd.client.trainers.q_network import QNetwork

BUFFER = "bit_flipping"
WEIGHTS = "her_q"
HIDDEN = (256,)


@dataclass
class HERActorConfig(EpsilonGreedyConfig):
    buffer: str = BUFFER
    weights: str = WEIGHTS
    env_id: str = BIT_FLIPPING
    epsilon_end: float = 0.1
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
    run = EpisodeActorRun.start(config, stop)
    if run is None:
        return ActorReport()
    obs, _ = env.reset(seed=config.seed)
    steps = 0
    while not run.stopped() and not run.learner_finished(steps, network):
        if explores(rng, epsilon_at(steps, config)):
            action = int(rng.integers(env.action_space.n))
        else:
            with torch.no_grad():
                action = int(network(torch.from_numpy(goal_input(obs["observation"], obs["desired_goal"]))[None])
                             .argmax(1))
        next_obs, reward, terminated, truncated, _ = env.step(action)
        steps += 1
        if run.recorder.record(obs, {"action": action, "reward": reward}, next_obs, terminated, truncated):
            next_obs, _ = env.reset()
        obs = next_obs
    return run.close(steps)
