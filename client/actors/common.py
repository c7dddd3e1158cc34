"""What every actor shares: its stop condition, weight refreshes, and episodes written with retries."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np
import torch

from replayd.client.episode_writer import EpisodeWriter
from replayd.client.params import load_module_bytes
from replayd.client.polling import RECONNECT, never, wait_until
from replayd.client.replay_client import FetchedWeights, ReplayClient
from replayd.client.sharded import connect as connect_to


def action_rng(seed: int) -> np.random.Generator:
    """The actor's random stream for its actions, apart from the env's: gymnasium (and GridWorld) seed the
    env's generator with SeedSequence(seed) too, so default_rng(seed) would repeat the env's own draws
    (a random action equal to the start state the env drew)."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])


class StopEvent(Protocol):
    def is_set(self) -> bool: ...


class EpsilonSchedule(Protocol):
    """An actor config's exploration schedule (see epsilon_at)."""

    epsilon_start: float
    epsilon_end: float
    epsilon_decay_steps: int


def epsilon_at(steps: int, config: EpsilonSchedule) -> float:
    """The exploration rate after `steps` env steps: linear from epsilon_start to epsilon_end over
    epsilon_decay_steps, then epsilon_end."""
    fraction = min(1.0, steps / config.epsilon_decay_steps)
    return config.epsilon_start + fraction * (config.epsilon_end - config.epsilon_start)


def explores(rng: np.random.Generator, epsilon: float) -> bool:
    """Whether this step takes a random action (probability `epsilon`) instead of the greedy one."""
    return bool(rng.random() < epsilon)


@dataclass
class ActorReport:
    """What an actor did: env steps taken, the newest weights version it acted with, data units pushed
    (episodes for episodic buffers, rollouts for PPO)."""

    env_steps: int = 0
    weights_version: int = 0
    pushed: int = 0


@dataclass
class EpsilonGreedyConfig:
    """What configures every epsilon-greedy actor (dqn, drqn, her); each algorithm's config adds its network's
    sizes and its own defaults."""

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


def stop_condition(seconds: float, stop: StopEvent | None) -> Callable[[], bool]:
    """True once `seconds` have passed or `stop` (e.g. a multiprocessing.Event of the demo) is set."""
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() > deadline or (stop is not None and stop.is_set())


def wait_for_buffer(client: ReplayClient, buffer: str, timeout: float, stopped: Callable[[], bool] = never) -> dict:
    """Polls until the learner has created `buffer` (TimeoutError at the deadline, None once stopped)."""
    return wait_until(lambda: client.describe(buffer), time.monotonic() + timeout, f"buffer {buffer!r} appearing",
                      stopped)


def connect(address: str, buffer: str, stopped: Callable[[], bool], timeout: float = 120,
            weights: str | None = None) -> ReplayClient | None:
    """A client once the learner has created `buffer` and, with `weights`, is running; None if the actor is
    stopped first (TimeoutError if neither happens within `timeout`).

    An earlier run leaves its buffer and its final weights on the server, and a learner started again reuses
    that buffer: an actor started before it would find both, take the old final weights for its own
    learner's and stop at once. So final weights found at the start are waited past (the new learner
    publishes above them)."""
    deadline = time.monotonic() + timeout
    client = connect_to(address, timeout=10)
    ready = False
    try:
        ready = wait_for_buffer(client, buffer, timeout, stopped) is not None and (
            weights is None or wait_for_running_learner(client, weights, deadline, stopped) is not None)
        return client if ready else None
    finally:
        if not ready:  # stopped, timed out or refused: the channel goes with the attempt
            client.close()


def wait_for_running_learner(client: ReplayClient, name: str, deadline: float,
                             stopped: Callable[[], bool] = never) -> bool | None:
    """True once the weights under `name` are not an earlier run's last (final) version; None once stopped."""
    left = client.fetch_weights(name)  # version 0 and not final while nothing is published
    if not left.final:
        return True
    return wait_until(lambda: client.fetch_weights(name, newer_than=left.version).version > 0 or None, deadline,
                      f"a learner publishing weights {name!r} above the final version {left.version} an earlier "
                      "run left", stopped, delay=0.05)


def newer_or_final(client: ReplayClient, name: str, version: int) -> FetchedWeights | None:
    """Weights newer than `version`, or the news that none will come (`final`); None while neither."""
    fetched = client.fetch_weights(name, newer_than=version)
    return fetched if fetched.version or fetched.final else None


def refresh_weights(client: ReplayClient, name: str, version: int, network: torch.nn.Module) -> tuple[int, bool]:
    """Loads a newer published version into `network` if there is one; returns the version acted with
    and whether the learner has finished (its last version is published: the actor stops)."""
    try:
        fetched = client.fetch_weights(name, newer_than=version)
    except grpc.RpcError as exc:
        if exc.code() in RECONNECT:
            return version, False  # the server is restarting; act with the weights we have
        raise
    if fetched.version:
        load_module_bytes(network, fetched.safetensors)
        version = fetched.version
    return version, fetched.final


def flush_with_retry(writer: EpisodeWriter, deadline: float) -> None:
    """Flushes pending episodes, retrying while the server is unreachable (e.g. restarting)."""

    def flushed() -> bool:
        writer.flush()
        return True

    wait_until(flushed, deadline, f"flushing episodes into {writer.buffer!r}", delay=0.1, max_delay=2.0)


class EpisodeRecorder:
    """One actor's episodes into an episodic buffer: whole episodes go out in batches, and a batch that
    fails because the server is restarting is retried (no finished episode is dropped)."""

    def __init__(self, client: ReplayClient, buffer: str, retry_deadline: float, batch_rows: int = 1024) -> None:
        self.writer = EpisodeWriter(client, buffer, batch_rows=batch_rows, auto_flush=False)
        self.retry_deadline = retry_deadline  # monotonic time until which failed flushes are retried

    def step(self, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: bool, truncated: bool) -> bool:
        """Records one step of a buffer whose observation field is `obs`; returns whether the episode ended
        (the caller resets its environment)."""
        return self.record({"obs": obs}, {"action": action, "reward": reward}, {"obs": next_obs}, terminated,
                           truncated)

    def record(self, observation: Mapping[str, Any], step: Mapping[str, Any], next_observation: Mapping[str, Any],
               terminated: bool, truncated: bool) -> bool:
        """Records one step given as its observation fields, its step fields (action, reward, a recurrent
        state, ...) and the observation fields after it; returns whether the episode ended."""
        self.writer.append(**observation, **step)
        if not (terminated or truncated):
            return False
        self.writer.end_episode(terminated=bool(terminated), **next_observation)
        if self.writer.pending_rows >= self.writer.batch_rows:
            flush_with_retry(self.writer, self.retry_deadline)
        return True

    def close(self) -> int:
        """Flushes what is pending, and delivers what waits for a shard that was down (retrying up to 30 s past the
        deadline); returns episodes written."""
        deadline = max(self.retry_deadline, time.monotonic()) + 30
        flush_with_retry(self.writer, deadline)

        def delivered() -> bool:
            self.writer.deliver_held()
            return True

        wait_until(delivered, deadline, f"delivering the held spans of {self.writer.buffer!r}", delay=0.1,
                   max_delay=2.0)
        return self.writer.episodes_written


@dataclass
class EpisodeActorRun:
    """An episode actor's connection, recorder and report from its start to its end: `learner_finished` between
    steps, `close` at the end."""

    config: EpsilonGreedyConfig
    stopped: Callable[[], bool]
    client: ReplayClient
    recorder: EpisodeRecorder
    report: ActorReport

    @classmethod
    def start(cls, config: EpsilonGreedyConfig, stop: StopEvent | None) -> EpisodeActorRun | None:
        """Connected to the buffer and its weights; None when stopped before they were there."""
        stopped = stop_condition(config.seconds, stop)
        client = connect(config.address, config.buffer, stopped, weights=config.weights)
        if client is None:
            return None
        recorder = EpisodeRecorder(client, config.buffer, retry_deadline=time.monotonic() + config.seconds)
        return cls(config, stopped, client, recorder, ActorReport())

    def learner_finished(self, steps: int, network: torch.nn.Module) -> bool:
        """Every `fetch_every` env steps, loads newer weights into `network`; True once the learner's last
        version is published (the actor stops)."""
        if steps % self.config.fetch_every:
            return False
        self.report.weights_version, finished = refresh_weights(self.client, self.config.weights,
                                                                self.report.weights_version, network)
        return finished

    def close(self, steps: int) -> ActorReport:
        """Flushes the recorder's episodes and closes the connection; the run's report."""
        self.report.pushed = self.recorder.close()
        self.report.env_steps = steps
        self.client.close()
        return self.report
