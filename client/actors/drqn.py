"""Epsilon-greedy DRQN actor: one partially observed environment (CartPole without velocities), whole episodes
into an episodic buffer, newest recurrent Q-network.

The actor carries the network's recurrent state through each episode (zeros at its start, kept across weight
refreshes) and stores, with every step, the state it held before that step's observation (step field `h`):
the learner starts each sampled sequence from the state stored at its first row (R2D2's stored state).
"""

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
from replayd.client.envs import CARTPOLE_POMDP
from replayd.client.trainers.drqn import RecurrentQNetwork

BUFFER = "cartpole_pomdp_sequences"
WEIGHTS = "drqn"
HIDDEN = 64  # GRU units: the stored state's size
ENCODER = (64,)


@dataclass
class DRQNActorConfig(EpsilonGreedyConfig):
    buffer: str = BUFFER
    weights: str = WEIGHTS
    env_id: str = CARTPOLE_POMDP
    hidden: int = HIDDEN
    encoder: tuple[int, ...] = ENCODER


def run_drqn_actor(config: DRQNActorConfig, stop: StopEvent | None = None) -> ActorReport:
    """Epsilon-greedy recurrent actor until `config.seconds` pass, `stop` is set or the learner publishes its
    final weights."""
    from replayd.client.envs import make

    torch.set_num_threads(1)
    env = make(config.env_id)
    rng = action_rng(config.seed)
    network = RecurrentQNetwork(int(env.observation_space.shape[0]), int(env.action_space.n), config.hidden,
                                config.encoder)
    run = EpisodeActorRun.start(config, stop)
    if run is None:
        return ActorReport()
    obs, _ = env.reset(seed=config.seed)
    state = network.initial_state(1)  # (1, H) before the episode's first observation
    steps = 0
    while not run.stopped() and not run.learner_finished(steps, network):
        with torch.no_grad():  # every step moves the state, a random action's too
            q, next_state = network(torch.as_tensor(obs, dtype=torch.float32)[None, None], state)  # (1, 1, A)
        if explores(rng, epsilon_at(steps, config)):
            action = int(rng.integers(env.action_space.n))
        else:
            action = int(q[0, 0].argmax())
        next_obs, reward, terminated, truncated, _ = env.step(action)
        steps += 1
        if run.recorder.record({"obs": obs}, {"action": action, "reward": reward, "h": state[0].numpy()},
                               {"obs": next_obs}, terminated, truncated):
            next_obs, _ = env.reset()
            next_state = network.initial_state(1)
        obs, state = next_obs, next_state
    return run.close(steps)
