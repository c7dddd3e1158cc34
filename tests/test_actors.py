"""Actors stop when the learner publishes its final weights, long before their own time budget."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from replayd.client import ReplayClient
from replayd.client.actors.common import ActorReport, EpisodeRecorder, action_rng, epsilon_at, explores, refresh_weights
from replayd.client.actors.dqn import DQNActorConfig, run_dqn_actor
from replayd.client.actors.ppo import PPOActorConfig, Rollout, collect, run_ppo_actor
from replayd.client.learners.dqn import CARTPOLE_SCHEMA
from replayd.client.params import module_to_bytes
from replayd.client.polling import wait_until
from replayd.client.trainers.ppo import ActorCritic
from replayd.client.trainers.q_network import QNetwork
from replayd.wire.components import States, Transitions
from tests.test_episode_writer import unreachable_for_first_inserts

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
    start them) write different random walks: each draws its own seed, where a fixed default would give both
    the same walks."""
    from replayd.client.actor import main as actor_main
    from replayd.client.learners.allo import GRID_SCHEMA

    client.create_buffer("fourrooms", 10_000, GRID_SCHEMA)
    for _ in range(2):
        actor_main(["--algo", "allo", "--address", client.address, "--episodes", "5"])
    assert client.describe("fourrooms")["episodes"] == 10
    batch = client.sample("fourrooms", 20_000, States(), include_keys=True)
    walks = {}
    for episode_id, key, obs in zip(batch["episode_id"].tolist(), batch["key"].tolist(), batch["obs"], strict=True):
        walks.setdefault(episode_id, {})[key] = tuple(obs.tolist())
    trajectories = {tuple(steps[key] for key in sorted(steps)) for steps in walks.values()}
    assert len(walks) == 10 and len(trajectories) == 10


def test_a_learner_publishes_above_an_earlier_runs_final_weights(client: ReplayClient, tmp_path) -> None:
    """A learner started on a server where an earlier run left its final weights (version 50) publishes above
    them: publishing from version 1 would be refused unnoticed, and a new actor would take the old final
    weights and stop at once."""
    from replayd.client.learners.dqn import DQNLearnerConfig, learn_dqn

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


def test_an_actor_started_before_a_learner_restarted_on_an_earlier_runs_buffer_waits_for_it(
        client: ReplayClient, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier run left its buffer (which a learner started again reuses) and its final weights: an actor
    started before the new learner waits for the new learner's weights instead of taking the old final ones
    for its own learner's (which would stop it at once, with no env step, and leave the new learner training
    on the old data alone)."""
    from replayd.client.learners.dqn import DQNLearnerConfig, learn_dqn

    learner_config = DQNLearnerConfig(address=client.address, run_dir=str(tmp_path), seconds=2, hidden=(16,),
                                      learning_starts=200, eval_every=10_000, eval_episodes=1)
    client.create_buffer("cartpole", learner_config.capacity_steps, CARTPOLE_SCHEMA)
    client.publish_weights("q", 50, module_to_bytes(QNetwork(4, 2, (16,))), final=True)
    actor_config = DQNActorConfig(address=client.address, seconds=BUDGET, fetch_every=10, hidden=(16,))
    fetched = threading.Event()  # the actor has read the old final weights: only then does the learner start
    fetch_weights = ReplayClient.fetch_weights

    def fetch_and_tell(self: ReplayClient, *args, **kwargs) -> object:
        weights = fetch_weights(self, *args, **kwargs)
        fetched.set()
        return weights

    monkeypatch.setattr(ReplayClient, "fetch_weights", fetch_and_tell)
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        try:
            actor = pool.submit(run_dqn_actor, actor_config, stop)
            assert fetched.wait(timeout=60), "the actor never fetched weights"
            monkeypatch.setattr(ReplayClient, "fetch_weights", fetch_weights)
            summary = learn_dqn(learner_config)
            report = actor.result(timeout=60)
        finally:
            stop.set()
    assert report.env_steps >= 200 and report.weights_version == summary["weights_version"] > 51


SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}


def _record(recorder: EpisodeRecorder, length: int, first: float, terminated: bool) -> None:
    """One episode of `length` steps whose last step terminates it or (terminated=False) truncates it."""
    for t in range(length):
        last = t == length - 1
        ended = recorder.step(np.full(4, first + t, np.float32), 1, 1.0, np.full(4, first + t + 1, np.float32),
                              terminated=last and terminated, truncated=last and not terminated)
        assert ended == last


def test_a_truncated_episode_is_stored_truncated_and_keeps_its_bootstrap(client: ReplayClient) -> None:
    client.create_buffer("b", 1000, SCHEMA)
    recorder = EpisodeRecorder(client, "b", retry_deadline=time.monotonic() + 30)
    _record(recorder, 3, first=0, terminated=False)
    _record(recorder, 3, first=100, terminated=True)
    assert recorder.close() == 2
    batch = client.sample("b", 256, mode=Transitions(n_step=1, gamma=0.9), seed=0)
    last_of_truncated, last_of_terminated = batch["next_obs"][:, 0] == 3, batch["next_obs"][:, 0] == 103
    assert last_of_truncated.any() and last_of_terminated.any()
    np.testing.assert_array_equal(batch["truncated"], last_of_truncated)
    np.testing.assert_array_equal(batch["terminated"], last_of_terminated)
    np.testing.assert_allclose(batch["bootstrap_discount"], np.where(last_of_terminated, 0.0, 0.9), rtol=1e-6)


def test_closing_a_recorder_retries_the_flush_while_the_server_is_unreachable(
        client: ReplayClient, monkeypatch: pytest.MonkeyPatch) -> None:
    client.create_buffer("b", 1000, SCHEMA)
    recorder = EpisodeRecorder(client, "b", retry_deadline=time.monotonic() + 30)
    _record(recorder, 4, first=0, terminated=True)
    calls = unreachable_for_first_inserts(client, monkeypatch)
    assert recorder.close() == 1
    assert len(calls) == 2 and client.describe("b")["episodes"] == 1


def test_refreshed_weights_are_the_ones_the_actor_acts_with(client: ReplayClient) -> None:
    """The actor reports the version it fetched: its network must then compute with those weights."""
    acting, published = QNetwork(4, 2, (16,)), QNetwork(4, 2, (16,))
    with torch.no_grad():  # action 1 whatever the observation
        head = published.layers[-1]
        head.weight.zero_()
        head.bias.copy_(torch.tensor([0.0, 100.0]))
    client.publish_weights("q", 3, module_to_bytes(published))
    assert refresh_weights(client, "q", 0, acting) == (3, False)
    acting_now = acting.state_dict()
    assert all(torch.equal(acting_now[name], value) for name, value in published.state_dict().items())
    obs = torch.as_tensor(np.random.default_rng(0).normal(size=(64, 4)), dtype=torch.float32)
    with torch.no_grad():
        assert (acting(obs).argmax(1) == 1).all()
    assert refresh_weights(client, "q", 3, QNetwork(4, 2, (16,))) == (3, False)  # nothing newer: kept


def test_the_dqn_actors_epsilon_decays_linearly_then_stays_at_its_end() -> None:
    config = DQNActorConfig(address="unused", epsilon_start=1.0, epsilon_end=0.1, epsilon_decay_steps=100)
    for steps, epsilon in ((0, 1.0), (50, 0.55), (100, 0.1), (10_000, 0.1)):
        assert epsilon_at(steps, config) == pytest.approx(epsilon), steps


def test_the_dqn_actor_explores_with_probability_epsilon() -> None:
    rng = np.random.default_rng(0)
    for epsilon, low, high in ((0.0, 0, 0), (1.0, 1000, 1000), (0.25, 200, 300)):
        explored = sum(explores(rng, epsilon) for _ in range(1000))
        assert low <= explored <= high, (epsilon, explored)


class _TruncatingEnvs:
    """Two environments in SAME_STEP autoreset: env 0 is truncated at its second step (its final observation
    in info["final_obs"], the reset one returned); nothing else ends."""

    num_envs = 2

    def __init__(self) -> None:
        self.t = 0

    def step(self, actions: np.ndarray):
        self.t += 1
        truncated = np.array([self.t == 2, False])
        info = {"final_obs": np.full((2, 4), -self.t, np.float32)} if truncated.any() else {}
        return (np.full((2, 4), self.t, np.float32), np.ones(2, np.float32), np.zeros(2, bool), truncated, info)


def test_ppo_collect_bootstraps_truncations_and_the_rollouts_end_with_the_critics_value() -> None:
    value = 2.5
    model = ActorCritic(4, 2, (8,))
    with torch.no_grad():  # V(s) = value everywhere
        model.critic[-1].weight.zero_()
        model.critic[-1].bias.fill_(value)
    rollout = Rollout(4, 2, (4,))
    obs, bootstrap = collect(_TruncatingEnvs(), model, np.zeros((2, 4), np.float32), rollout)
    columns = rollout.columns
    np.testing.assert_array_equal(columns["truncated"], [[False, False], [True, False], [False, False],
                                                         [False, False]])
    np.testing.assert_allclose(columns["final_value"], [[0, 0], [value, 0], [0, 0], [0, 0]])
    np.testing.assert_allclose(columns["value"], np.full((4, 2), value))
    np.testing.assert_allclose(bootstrap, [value, value])
    np.testing.assert_array_equal(obs, np.full((2, 4), 4, np.float32))


def test_a_dqn_actor_started_without_a_seed_draws_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Like allo actors (above), dqn actors started alike must not play the same episodes."""
    import dataclasses

    from replayd.client.actor import main as actor_main
    from replayd.client.algos import ALGOS

    seeds = []
    monkeypatch.setitem(ALGOS, "dqn", dataclasses.replace(
        ALGOS["dqn"], actor=lambda config, stop: seeds.append(config.seed) or ActorReport()))
    for _ in range(2):
        actor_main(["--algo", "dqn", "--address", "127.0.0.1:1"])
    assert len(seeds) == 2 and seeds[0] != seeds[1]
    actor_main(["--algo", "dqn", "--address", "127.0.0.1:1", "--seed", "5"])
    assert seeds[2] == 5


def test_the_allo_actor_walks_in_all_four_directions(client: ReplayClient) -> None:
    from replayd.client.actors.allo import AlloActorConfig, run_allo_actor
    from replayd.client.learners.allo import GRID_SCHEMA

    client.create_buffer("fourrooms", 10_000, GRID_SCHEMA)
    report = run_allo_actor(AlloActorConfig(address=client.address, episodes=2, seed=0, seconds=BUDGET))
    assert report.pushed == 2
    actions = client.sample("fourrooms", 4_000, seed=0)["action"]
    assert set(actions.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1])
def test_an_actors_actions_do_not_repeat_its_envs_draws(seed: int) -> None:
    """gymnasium seeds an env's generator with SeedSequence(seed), as default_rng(seed) does: actions drawn
    from default_rng(seed) would be the env's own draws (in the ALLO actor, every random action would equal a
    start state the gridworld drew), so actors draw their actions from a generator of their own."""
    from gymnasium.utils.seeding import np_random

    env_draws = np_random(seed)[0].integers(4, size=256)
    np.testing.assert_array_equal(np.random.default_rng(seed).integers(4, size=256), env_draws)  # the trap
    assert not np.array_equal(action_rng(seed).integers(4, size=256), env_draws)
    np.testing.assert_array_equal(action_rng(seed).random(4), action_rng(seed).random(4))  # still reproducible


def test_sigterm_ends_an_actor_process_as_its_budget_does(client: ReplayClient) -> None:
    """At SIGTERM (docker stop) `replayd actor` finishes its step, flushes the episodes it has written but not
    yet sent, and reports, as when its time is up, instead of dying with them."""
    client.create_buffer("cartpole", 50_000, CARTPOLE_SCHEMA)
    client.publish_weights("q", 1, module_to_bytes(QNetwork(4, 2, DQNActorConfig(address="").hidden)))
    actor = subprocess.Popen([sys.executable, "-m", "replayd.client.actor", "--algo", "dqn",
                              "--address", client.address, "--seconds", str(BUDGET)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Its first batch of episodes is in: it is stepping, with more written since.
        wait_until(lambda: actor.poll() is not None or client.describe("cartpole")["episodes"] > 0,
                   time.monotonic() + 90, "the actor's first batch of episodes")
        actor.send_signal(signal.SIGTERM)
        out, err = actor.communicate(timeout=90)
    finally:
        actor.kill()
    assert actor.returncode == 0, err
    pushed = int(re.search(r"(\d+) pushed", out).group(1))
    assert pushed == client.describe("cartpole")["episodes"] > 0
