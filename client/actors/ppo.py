"""PPO actor: a gymnasium vector env acting with the newest policy; each rollout of T steps goes into
the actor's slots [actor_index * num_envs, +num_envs) of the learner's rollout buffer.

Versions: the weights version the actor acted with is the rollout's policy version. After a push the
actor polls (backoff, deadline) for the next version, which the learner publishes once every actor's
part is in and it has trained on them. Truncation is exact: with SAME_STEP autoreset the final
observation of a truncated episode is in info["final_obs"], and its value goes into `final_value`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import grpc
import numpy as np
import torch

from replayd.client.actors.common import ActorReport, StopEvent, connect, newer_or_final, stop_condition
from replayd.client.params import load_module_bytes
from replayd.client.polling import wait_until
from replayd.client.replay_client import ReplayClient
from replayd.client.trainers.ppo import ActorCritic

ROLLOUT_STEPS = 128  # T, shared by actors and the learner (the buffer is T x actors * num_envs)
ENVS_PER_ACTOR = 4
BUFFER = "cartpole_ppo"
WEIGHTS = "pi"
HIDDEN = (64, 64)


@dataclass
class PPOActorConfig:
    address: str
    actor_index: int = 0  # which slots of the rollout this actor owns
    buffer: str = BUFFER
    weights: str = WEIGHTS
    env_id: str = "CartPole-v1"
    num_envs: int = ENVS_PER_ACTOR
    rollout_steps: int = ROLLOUT_STEPS
    seed: int | None = None  # defaults to 1000 * actor_index
    seconds: float = 3600.0
    hidden: tuple[int, ...] = HIDDEN


class Rollout:
    """(T, N) columns of one rollout, filled step by step."""

    def __init__(self, steps: int, envs: int, obs_shape: tuple[int, ...]) -> None:
        self.columns = {
            "obs": np.zeros((steps, envs, *obs_shape), np.float32),
            "action": np.zeros((steps, envs), np.int64),
            "log_prob": np.zeros((steps, envs), np.float32),
            "value": np.zeros((steps, envs), np.float32),
            "reward": np.zeros((steps, envs), np.float32),
            "terminated": np.zeros((steps, envs), bool),
            "truncated": np.zeros((steps, envs), bool),
            "final_value": np.zeros((steps, envs), np.float32),
        }

    def set(self, t: int, **values: np.ndarray) -> None:
        for name, value in values.items():
            self.columns[name][t] = value


@torch.no_grad()
def collect(envs, model: ActorCritic, obs: np.ndarray, rollout: Rollout) -> tuple[np.ndarray, np.ndarray]:
    """Steps `envs` for the rollout's T steps from `obs`; returns (next obs, bootstrap value V(s_T))."""
    steps = rollout.columns["action"].shape[0]
    for t in range(steps):
        dist, value = model(torch.as_tensor(obs))
        action = dist.sample()
        next_obs, reward, terminated, truncated, info = envs.step(action.numpy())
        final_value = np.zeros(len(obs), np.float32)
        if truncated.any():  # V(final observation): the episode was cut, not ended
            final_obs = np.stack(info["final_obs"][truncated]).astype(np.float32)
            final_value[truncated] = model.value(torch.as_tensor(final_obs)).numpy()
        rollout.set(t, obs=obs, action=action.numpy(), log_prob=dist.log_prob(action).numpy(), value=value.numpy(),
                    reward=reward, terminated=terminated, truncated=truncated, final_value=final_value)
        obs = next_obs.astype(np.float32)
    return obs, model.value(torch.as_tensor(obs)).numpy()


def run_ppo_actor(config: PPOActorConfig, stop: StopEvent | None = None) -> ActorReport:
    """Collects and pushes one rollout per policy version until `config.seconds` pass, `stop` is set or the
    learner publishes its final weights."""
    import gymnasium as gym

    torch.set_num_threads(1)
    envs = gym.vector.SyncVectorEnv([partial(gym.make, config.env_id) for _ in range(config.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_shape = envs.single_observation_space.shape
    model = ActorCritic(int(np.prod(obs_shape)), int(envs.single_action_space.n), config.hidden)
    rollout = Rollout(config.rollout_steps, config.num_envs, obs_shape)
    seed = 1000 * config.actor_index if config.seed is None else config.seed
    torch.manual_seed(seed)  # action sampling: a seeded actor's run is reproducible
    obs = envs.reset(seed=seed)[0].astype(np.float32)
    report = ActorReport()
    stopped = stop_condition(config.seconds, stop)
    deadline = time.monotonic() + config.seconds
    client = connect(config.address, config.buffer, stopped, weights=config.weights)
    if client is None:
        return report
    pushed_before = 0  # the policy version of this actor's last push
    while True:
        fetched = wait_until(lambda: newer_or_final(client, config.weights, report.weights_version),
                             deadline, f"weights {config.weights!r} newer than {report.weights_version}", stopped)
        if fetched is None or fetched.final:  # stopped, or the learner finished: nobody trains on more rollouts
            break
        load_module_bytes(model, fetched.safetensors)
        report.weights_version = fetched.version
        obs, bootstrap = collect(envs, model, obs, rollout)
        report.env_steps += config.rollout_steps * config.num_envs
        if push(client, config, report.weights_version, rollout, bootstrap, deadline, stopped, pushed_before):
            report.pushed += 1
            pushed_before = report.weights_version
    envs.close()
    client.close()
    return report


def push(client: ReplayClient, config: PPOActorConfig, version: int, rollout: Rollout, bootstrap: np.ndarray,
         deadline: float, stopped, pushed_before: int = 0) -> bool:
    """Pushes the actor's part; False when the learner has moved past `version` (the part is stale) or the
    actor is stopped first.

    If the buffer has not reached `version` yet (weights published before finish_rollout), waits for it.
    While the server is unreachable (UNAVAILABLE, DEADLINE_EXCEEDED), the push is retried with backoff
    until `deadline`: a retry after a lost response is refused as "already pushed", which means the first
    attempt landed. A buffer that is gone, or back below `pushed_before` (the version of this actor's last
    push: the buffer was created again), raises: the learner restarted, and this actor's run with it ends.
    """

    def attempt() -> str | None:
        try:
            client.push_rollout(config.buffer, version, config.actor_index * config.num_envs, 0,
                                bootstrap_value=bootstrap, **rollout.columns)
            return "pushed"
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise  # wait_until retries UNAVAILABLE and DEADLINE_EXCEEDED
            if "already pushed" in (exc.details() or ""):  # our cells of this version: an earlier push arrived
                return "pushed"
        current = client.describe(config.buffer)["policy_version"]
        if current < pushed_before:
            raise RuntimeError(f"rollout buffer {config.buffer!r} went back to policy version {current} after this "
                               f"actor pushed version {pushed_before}: it was created again (the learner restarted)")
        if current > version:
            return "stale"
        return None  # refused as too new: push again once the learner has finished the current rollout

    outcome = wait_until(attempt, deadline, f"pushing the rollout part of policy version {version}", stopped,
                         retry_codes=(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED),
                         delay=0.005, max_delay=1.0)
    return outcome == "pushed"
