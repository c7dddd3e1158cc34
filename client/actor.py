"""Actors: step gymnasium environments with the newest published weights and push experience.

`python -m client.actor --algo dqn --address HOST:PORT` (or `replayd actor ...`). An actor waits for its
buffer to exist, refreshes its policy whenever the learner publishes a newer version, and keeps going
across server restarts: a failed flush is retried with backoff, so no finished episode is dropped.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from client.episode_writer import EpisodeWriter
from client.params import load_module_bytes
from client.replay_client import ReplayClient
from client.trainers.dqn import QNetwork

RECONNECT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED)


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


def wait_for_buffer(client: ReplayClient, buffer: str, timeout: float) -> None:
    """Polls until the learner has created `buffer` (or raises TimeoutError at the deadline)."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            client.describe(buffer)
            return
        except grpc.RpcError as exc:
            if exc.code() not in RECONNECT or time.monotonic() > deadline:
                raise TimeoutError(f"buffer {buffer!r} did not appear within {timeout}s: {exc.details()}") from exc
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def run_dqn_actor(config: DQNActorConfig) -> tuple[int, int]:
    """Epsilon-greedy CartPole actor; returns (env steps taken, newest weights version it acted with)."""
    import gymnasium as gym

    torch.set_num_threads(1)
    env = gym.make(config.env_id)
    rng = np.random.default_rng(config.seed)
    network = QNetwork(int(np.prod(env.observation_space.shape)), int(env.action_space.n), config.hidden)
    version = 0
    client = ReplayClient(config.address, timeout=10)
    wait_for_buffer(client, config.buffer, timeout=120)
    writer = EpisodeWriter(client, config.buffer, batch_rows=1024, auto_flush=False)
    obs, _ = env.reset(seed=config.seed)
    deadline = time.monotonic() + config.seconds
    steps = 0
    while time.monotonic() < deadline:
        if steps % config.fetch_every == 0:
            version = refresh_weights(client, config.weights, version, network)
        fraction = min(1.0, steps / config.epsilon_decay_steps)
        epsilon = config.epsilon_start + fraction * (config.epsilon_end - config.epsilon_start)
        if version == 0 or rng.random() < epsilon:
            action = int(rng.integers(env.action_space.n))
        else:
            with torch.no_grad():
                action = int(network(torch.as_tensor(obs, dtype=torch.float32)[None]).argmax(1))
        next_obs, reward, terminated, truncated, _ = env.step(action)
        writer.append(obs=obs, action=action, reward=reward)
        steps += 1
        obs = next_obs
        if terminated or truncated:
            writer.end_episode(terminated=terminated, obs=obs)
            obs, _ = env.reset()
            if writer.pending_rows >= writer.batch_rows:
                flush_with_retry(writer, deadline)
    flush_with_retry(writer, deadline + 30)
    client.close()
    return steps, version


def refresh_weights(client: ReplayClient, name: str, version: int, network: torch.nn.Module) -> int:
    try:
        newer = client.fetch_weights(name, newer_than=version)
    except grpc.RpcError as exc:
        if exc.code() in RECONNECT:
            return version  # the server is restarting; act with the weights we have
        raise
    if newer is None:
        return version
    load_module_bytes(network, newer[1])
    return newer[0]


def flush_with_retry(writer: EpisodeWriter, deadline: float) -> None:
    """Flushes pending episodes, retrying while the server is unreachable (e.g. restarting)."""
    delay = 0.1
    while True:
        try:
            writer.flush()
            return
        except grpc.RpcError as exc:
            if exc.code() not in RECONNECT or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="replayd actor")
    parser.add_argument("--algo", choices=["dqn"], default="dqn")
    parser.add_argument("--address", required=True)
    parser.add_argument("--buffer", default="cartpole")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=3600.0)
    args = parser.parse_args(argv)
    steps, version = run_dqn_actor(DQNActorConfig(args.address, args.buffer, env_id=args.env, seed=args.seed,
                                                  seconds=args.seconds))
    print(f"actor {args.seed}: {steps} env steps, weights version {version}", flush=True)


if __name__ == "__main__":
    main()
