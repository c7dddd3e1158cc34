"""Actors stop when the learner publishes its final weights, long before their own time budget."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from client import ReplayClient
from client.actors.common import ActorReport
from client.actors.dqn import DQNActorConfig, run_dqn_actor
from client.actors.ppo import PPOActorConfig, run_ppo_actor
from client.learners.dqn import CARTPOLE_SCHEMA
from client.params import module_to_bytes
from client.polling import wait_until
from client.trainers.dqn import QNetwork
from client.trainers.ppo import ActorCritic

BUDGET = 120.0  # the actors' own --seconds: far longer than these tests may take


def _run_until_final(actor: Callable[[object, threading.Event], ActorReport], config: object,
                     acted: Callable[[], bool], publish_final: Callable[[], object]) -> tuple[ActorReport, float]:
    """Starts the actor, waits until `acted()`, publishes final weights; the actor's report and the
    seconds it took to return after that."""
    stop = threading.Event()  # only for a failing test: it ends the actor's thread
    with ThreadPoolExecutor(1) as pool:
        try:
            report = pool.submit(actor, config, stop)
            wait_until(acted, time.monotonic() + 60, "the actor's first data")
            published = time.monotonic()
            publish_final()
            result = report.result(timeout=60)
            return result, time.monotonic() - published
        finally:
            stop.set()


def test_dqn_actor_stops_on_the_learners_final_weights(client: ReplayClient) -> None:
    client.create_buffer("cartpole", 20_000, CARTPOLE_SCHEMA)
    network = QNetwork(4, 2, (16,))
    client.publish_weights("q", 1, module_to_bytes(network))
    config = DQNActorConfig(address=client.address, seconds=BUDGET, fetch_every=10, hidden=(16,))
    report, took = _run_until_final(
        run_dqn_actor, config, lambda: client.describe("cartpole")["episodes"] > 0,
        lambda: client.publish_weights("q", 2, module_to_bytes(network), final=True))
    assert took < 30 and report.weights_version == 2  # it fetched the final weights, and returned
    assert report.pushed == client.describe("cartpole")["counters"]["inserted_episodes"]  # its episodes are in


def test_ppo_actor_stops_on_the_learners_final_weights(client: ReplayClient) -> None:
    steps, envs = 8, 2
    client.create_rollout_buffer("rollout", steps, envs,
                                 {"obs": ("float32", (4,)), "action": ("int64", ()), "log_prob": ("float32", ())})
    client.finish_rollout("rollout", 1)
    model = ActorCritic(4, 2, (16,))
    client.publish_weights("pi", 1, module_to_bytes(model))
    config = PPOActorConfig(address=client.address, buffer="rollout", weights="pi", num_envs=envs,
                            rollout_steps=steps, seconds=BUDGET, hidden=(16,))
    report, took = _run_until_final(
        run_ppo_actor, config, lambda: client.describe("rollout")["rollout_complete"],
        lambda: client.publish_weights("pi", 2, module_to_bytes(model), final=True))
    # No rollout for the final weights: nobody would train on it.
    assert took < 30 and report.weights_version == 1 and report.pushed == 1


def test_actors_started_alike_write_different_episodes(client: ReplayClient) -> None:
    """Two `replayd actor --algo allo` with the same command line (as one per actor, or compose's --scale,
    start them) wrote the same random walks: both used seed 0. Each now draws its own seed."""
    from client.actor import main as actor_main
    from client.learners.allo import GRID_SCHEMA

    client.create_buffer("fourrooms", 10_000, GRID_SCHEMA)
    for _ in range(2):
        actor_main(["--algo", "allo", "--address", client.address, "--episodes", "5"])
    assert client.describe("fourrooms")["episodes"] == 10
    batch = client.sample("fourrooms", 20_000, "states", include_keys=True)
    walks = {}
    for episode_id, key, obs in zip(batch["episode_id"].tolist(), batch["key"].tolist(), batch["obs"], strict=True):
        walks.setdefault(episode_id, {})[key] = tuple(obs.tolist())
    trajectories = {tuple(steps[key] for key in sorted(steps)) for steps in walks.values()}
    assert len(walks) == 10 and len(trajectories) == 10


def test_a_learner_publishes_above_an_earlier_runs_final_weights(client: ReplayClient, tmp_path) -> None:
    """A learner started on a server where an earlier run left its final weights (version 50): it
    published from version 1 (refused, unnoticed), and a new actor took the old final weights and stopped
    at once."""
    from client.learners.dqn import DQNLearnerConfig, learn_dqn

    client.publish_weights("q", 50, module_to_bytes(QNetwork(4, 2, (16,))), final=True)
    actor_config = DQNActorConfig(address=client.address, seconds=BUDGET, fetch_every=10, hidden=(16,))
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        try:
            actor = pool.submit(run_dqn_actor, actor_config, stop)
            summary = learn_dqn(DQNLearnerConfig(address=client.address, run_dir=str(tmp_path), seconds=2,
                                                 hidden=(16,), learning_starts=200, eval_every=10_000,
                                                 eval_episodes=1))
            report = actor.result(timeout=60)
        finally:
            stop.set()
    assert summary["weights_version"] > 51  # the first, some during training, the final one
    assert report.env_steps >= 200 and report.weights_version == summary["weights_version"]
