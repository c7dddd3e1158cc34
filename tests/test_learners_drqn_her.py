"""The DRQN and HER actors and learners against a test server, for a few seconds: what the actors store, what the
learners sample, train on and send back (the plumbing; the scores are the demo's)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from replayd.client import Hindsight, ReplayClient, Sequences
from replayd.client.actors.drqn import DRQNActorConfig, run_drqn_actor
from replayd.client.actors.her import HERActorConfig, run_her_actor
from replayd.client.envs import BitFlippingEnv
from replayd.client.learners.drqn import DRQNLearnerConfig, learn_drqn, sequence_schema
from replayd.client.learners.her import GOAL_FIELDS, OBSERVATION_FIELDS, HERLearnerConfig, goal_schema, learn_her
from replayd.client.params import module_to_bytes
from replayd.client.trainers.dqn import DQNTrainer
from replayd.client.trainers.drqn import RecurrentQNetwork
from tests.test_actors import BUDGET, _run_until_final

HIDDEN = 16


def test_the_drqn_actor_stores_the_state_its_network_held_before_each_step(client: ReplayClient) -> None:
    """Unrolling the acting network from a sequence's first stored state gives the states stored at its other
    steps: a learner starting from h[:, 0] starts where the actor was."""
    config = DRQNActorConfig(address=client.address, seconds=BUDGET, fetch_every=10, hidden=HIDDEN, encoder=(8,),
                             epsilon_start=0.5, epsilon_end=0.5)
    client.create_buffer(config.buffer, 20_000, sequence_schema((2,), HIDDEN))
    network = RecurrentQNetwork(2, 2, HIDDEN, (8,))
    client.publish_weights(config.weights, 1, module_to_bytes(network))
    report, _ = _run_until_final(run_drqn_actor, config, lambda: client.describe(config.buffer)["episodes"] >= 5,
                                 lambda: client.publish_weights(config.weights, 2, module_to_bytes(network),
                                                                final=True))
    assert report.weights_version == 2 and report.pushed == client.describe(config.buffer)["episodes"]
    batch = {name: torch.tensor(array) for name, array in
             client.sample(config.buffer, 64, Sequences(12), seed=0).items()}
    state = batch["h"][:, 0]
    assert not state[batch["is_first"][:, 0]].any()  # an episode starts from zeros
    with torch.no_grad():
        for t in range(12):
            steps = batch["mask"][:, t]
            torch.testing.assert_close(batch["h"][steps, t], state[steps], rtol=1e-5, atol=1e-6)
            _, state = network(batch["obs"][:, t:t + 1], state)


def test_the_drqn_learner_trains_on_its_actors_sequences_and_sends_their_priorities(
        client: ReplayClient, tmp_path, monkeypatch) -> None:
    sent: list[tuple[str, int, int]] = []
    update_priorities = ReplayClient.update_priorities

    def record(self: ReplayClient, buffer: str, keys, priorities, timeout=None) -> tuple[int, int]:
        applied, ignored = update_priorities(self, buffer, keys, priorities, timeout)
        sent.append((buffer, len(keys), applied + ignored))
        assert (np.asarray(priorities) > 0).all()
        return applied, ignored

    monkeypatch.setattr(ReplayClient, "update_priorities", record)
    actor_config = DRQNActorConfig(address=client.address, seconds=BUDGET, fetch_every=10, hidden=HIDDEN,
                                   encoder=(8,))
    learner_config = DRQNLearnerConfig(address=client.address, run_dir=str(tmp_path), seconds=4, hidden=HIDDEN,
                                       encoder=(8,), capacity_steps=50_000, batch_size=8, learning_starts=300,
                                       eval_every=50, eval_episodes=2)
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        try:
            actor = pool.submit(run_drqn_actor, actor_config, stop)
            summary = learn_drqn(learner_config)
            report = actor.result(timeout=60)  # the learner's final weights stop it
        finally:
            stop.set()
    steps = summary["learner_steps"]
    assert steps > 0 and summary["curve"] and summary["final_eval_return"] == summary["curve"][-1]["eval_return"]
    assert sent == [(learner_config.buffer, 8, 8)] * steps  # every batch's priorities, one per sequence
    assert summary["buffer"]["counters"]["sampled_items"] >= 8 * steps
    assert summary["buffer"]["sampler"].alpha == learner_config.priority_alpha
    assert report.weights_version == summary["weights_version"] > 1


def test_the_her_actor_stores_goal_episodes_whose_rewards_are_the_envs(client: ReplayClient) -> None:
    config = HERActorConfig(address=client.address, seconds=BUDGET, fetch_every=10, hidden=(16,))
    client.create_buffer(config.buffer, 20_000, goal_schema(15), observation_fields=OBSERVATION_FIELDS,
                         goal_fields=GOAL_FIELDS)
    network = DQNTrainer(30, 15, hidden=(16,)).online
    client.publish_weights(config.weights, 1, module_to_bytes(network))
    report, _ = _run_until_final(run_her_actor, config, lambda: client.describe(config.buffer)["episodes"] >= 5,
                                 lambda: client.publish_weights(config.weights, 2, module_to_bytes(network),
                                                                final=True))
    assert report.pushed == client.describe(config.buffer)["episodes"]
    batch = client.sample(config.buffer, 512, Hindsight(relabel_ratio=0.0), seed=0)
    env = BitFlippingEnv()
    np.testing.assert_array_equal(batch["reward"], env.compute_reward(batch["next_achieved_goal"],
                                                                      batch["desired_goal"], None))
    np.testing.assert_array_equal(batch["terminated"], env.compute_terminated(batch["next_achieved_goal"],
                                                                              batch["desired_goal"], None))
    np.testing.assert_array_equal(batch["next_observation"], batch["next_achieved_goal"])
    flipped = (batch["next_observation"] != batch["observation"]).sum(1)
    assert (flipped == 1).all() and (np.argmax(batch["next_observation"] != batch["observation"], 1)
                                     == batch["action"]).all()


def test_the_her_learner_trains_on_relabeled_goals_with_their_recomputed_rewards(
        client: ReplayClient, tmp_path, monkeypatch) -> None:
    batches: list[dict[str, torch.Tensor]] = []
    step = DQNTrainer.step

    def record(self: DQNTrainer, batch: dict[str, torch.Tensor], log: bool = False) -> dict:
        batches.append({name: tensor.clone() for name, tensor in batch.items()})
        return step(self, batch, log)

    monkeypatch.setattr(DQNTrainer, "step", record)
    actor_config = HERActorConfig(address=client.address, seconds=BUDGET, fetch_every=10, hidden=(32,))
    learner_config = HERLearnerConfig(address=client.address, run_dir=str(tmp_path), seconds=3, hidden=(32,),
                                      capacity_steps=50_000, batch_size=32, learning_starts=300, eval_every=50,
                                      eval_episodes=5)
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        try:
            actor = pool.submit(run_her_actor, actor_config, stop)
            summary = learn_her(learner_config)
            report = actor.result(timeout=60)
        finally:
            stop.set()
    assert summary["learner_steps"] == len(batches) > 0 and report.weights_version == summary["weights_version"]
    assert 0 <= summary["final_success_rate"] <= 1 and summary["curve"][-1]["success_rate"] == summary[
        "final_success_rate"]
    batch = {name: torch.cat([b[name] for b in batches]) for name in batches[0]}
    obs, boot = batch["obs"], batch["bootstrap_obs"]  # [observation, goal] at t and t + 1
    assert obs.shape[1] == 30 and torch.equal(obs[:, 15:], boot[:, 15:])
    reached = (boot[:, :15] == boot[:, 15:]).all(1)  # the next state is the transition's goal
    assert torch.equal(batch["n_step_return"], torch.where(reached, 0.0, -1.0))
    assert torch.equal(batch["bootstrap_discount"], torch.where(reached, 0.0, learner_config.gamma))
    # Goals relabeled to the next state's (offset 1, about 1 in 8 of future ones) are reached; the episodes' own
    # goals of 15 bits hardly ever are in these few seconds.
    assert reached.float().mean() > 0.05
