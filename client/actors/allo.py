"""ALLO actor: a uniform random policy in a gridworld (four rooms by default); whole episodes go into an
episodic buffer, from which the learner samples geometric pairs and uniform states."""

from __future__ import annotations

import time
from dataclasses import dataclass

from replayd.client.actors.common import ActorReport, EpisodeRecorder, StopEvent, action_rng, connect, stop_condition
from replayd.client.gridworld import GridWorld

BUFFER = "fourrooms"
LAYOUT = "four_rooms"


@dataclass
class AlloActorConfig:
    address: str
    buffer: str = BUFFER
    layout: str = LAYOUT
    episode_steps: int = 50
    episodes: int = 1_000  # random walks are stationary: after this many the actor is done
    seed: int = 0
    seconds: float = 3600.0


def run_allo_actor(config: AlloActorConfig, stop: StopEvent | None = None) -> ActorReport:
    """Random-walk episodes until `config.episodes` are written, `config.seconds` pass or `stop` is set."""
    env = GridWorld(config.layout, max_episode_steps=config.episode_steps)
    rng = action_rng(config.seed)
    report = ActorReport()
    stopped = stop_condition(config.seconds, stop)
    client = connect(config.address, config.buffer, stopped)
    if client is None:
        return report
    recorder = EpisodeRecorder(client, config.buffer, retry_deadline=time.monotonic() + config.seconds, batch_rows=4096)
    obs, _ = env.reset(seed=config.seed)
    episodes = 0
    while episodes < config.episodes and not stopped():
        action = int(rng.integers(env.n_actions))
        next_obs, reward, terminated, truncated, _ = env.step(action)
        report.env_steps += 1
        if recorder.step(obs, action, reward, next_obs, terminated, truncated):
            episodes += 1
            next_obs, _ = env.reset()
        obs = next_obs
    report.pushed = recorder.close()
    client.close()
    return report
