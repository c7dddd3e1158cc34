"""The DRQN learner (R2D2-style recurrent replay): creates a prioritized episodic buffer whose steps carry the
actors' recurrent states, trains `DRQNTrainer` on `Sequences` batches from a prefetched sample stream, sends
each sequence's priority back, publishes weights (the last ones final: the actors stop), evaluates the
greedy recurrent policy, and writes a learning curve and a summary into a run folder.

Sequences are R2D2's, scaled to CartPole (whose hidden velocities a few steps of memory recover): burn_in +
length = 5 + 15 rows, starting every 5 steps of an episode (overlapping by 15), zero-padded at the episode's
end; 5-step Double DQN targets; priorities eta * max + (1 - eta) * mean of |td| per sequence, keyed by the
start step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from replayd.client.actors.drqn import BUFFER, ENCODER, HIDDEN, WEIGHTS
from replayd.client.envs import CARTPOLE_POMDP
from replayd.client.learners.common import (
    CurvePlot,
    Progress,
    Tracker,
    WeightsPublisher,
    create_or_reuse,
    env_spaces,
    env_steps,
    evaluate_recurrent,
    finish_learner,
    start_learner,
    wait_for_steps,
)
from replayd.client.loader import Loader
from replayd.client.replay_client import ReplayClient
from replayd.client.trainers.drqn import DRQNTrainer
from replayd.wire.components import Prioritized, Sequences

PRIORITY_EPSILON = 1e-3  # added to each sequence's priority: a sequence whose errors are all 0 stays drawable


def sequence_schema(obs_shape: tuple[int, ...], hidden: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The buffer's fields: observations, discrete actions, rewards and the actor's recurrent state `h`."""
    return {"obs": ("float32", obs_shape), "action": ("int64", ()), "reward": ("float32", ()),
            "h": ("float32", (hidden,))}


@dataclass
class DRQNLearnerConfig:
    address: str
    run_dir: str = "runs/drqn"
    buffer: str = BUFFER
    weights: str = WEIGHTS
    env_id: str = CARTPOLE_POMDP
    device: str = "cpu"
    seconds: float = 600.0  # time budget
    target_return: float = 475.0  # stop once the greedy policy's mean over eval_episodes reaches this
    capacity_steps: int = 500_000  # about 4 minutes of 2 actors' steps
    batch_size: int = 32  # sequences
    burn_in: int = 5
    length: int = 15  # trained rows per sequence
    period: int = 5  # sequences start every `period` steps of an episode
    n_step: int = 5
    gamma: float = 0.99
    lr: float = 1e-3
    hidden: int = HIDDEN
    encoder: tuple[int, ...] = ENCODER
    target_update_every: int = 250
    priority_alpha: float = 0.9  # R2D2's priority exponent
    importance_beta: float = 0.6
    eta: float = 0.9  # priority = eta * max |td| + (1 - eta) * mean |td| over a sequence
    learning_starts: int = 2_000  # sampleable steps before the first update
    publish_every: int = 50  # learner steps between weight broadcasts
    eval_every: int = 500  # learner steps between evaluations
    eval_episodes: int = 20
    seed: int = 0


def learn_drqn(config: DRQNLearnerConfig, report: Callable[[Progress], None] = lambda progress: None,
               waiting: Callable[[], None] = lambda: None,
               finished: Callable[[dict], None] = lambda summary: None) -> dict:
    """`report` gets every curve point; `waiting` runs at every poll for data (see Tracker); `finished` gets the
    summary once the run folder is written, before the final weights stop the actors (see finish_learner)."""
    tracker, client = start_learner(config, "eval_return", report, waiting)
    obs_shape, n_actions = env_spaces(config.env_id)
    schema = sequence_schema(obs_shape, config.hidden)
    trainer = DRQNTrainer(int(np.prod(obs_shape)), n_actions, config.burn_in, hidden=config.hidden,
                          encoder=config.encoder, lr=config.lr, eta=config.eta,
                          target_update_every=config.target_update_every, device=config.device)
    weights = WeightsPublisher(client, config.weights)
    weights.publish_then_create(trainer.online, lambda: create_or_reuse(
        client, config.buffer, lambda: client.create_buffer(config.buffer, config.capacity_steps, schema,
                                                            sampler=Prioritized(config.priority_alpha)),
        "episodic", config.capacity_steps, schema))
    wait_for_steps(client, config.buffer, config.learning_starts, tracker)
    train(config, client, trainer, tracker, weights)
    progress = tracker.progress
    if not progress.curve or progress.learner_steps % config.eval_every:
        evaluate(config, client, trainer, tracker)  # the final policy: final_eval_return is never stale
    plot = CurvePlot("eval_return", f"greedy return (mean of {config.eval_episodes} episodes)",
                     f"DRQN on {config.env_id} via replayd", config.target_return)
    final_version, publish_final = weights.final_later(trainer.online)
    return finish_learner(config, client, tracker, plot, {
        "solved": progress.score >= config.target_return, "final_eval_return": progress.score,
        "target_return": config.target_return, "weights_version": final_version}, finished, publish_final)


def train(config: DRQNLearnerConfig, client: ReplayClient, trainer: DRQNTrainer, tracker: Tracker,
          weights: WeightsPublisher) -> None:
    """Steps on sequence batches until the greedy policy reaches the target or the budget runs out."""
    mode = Sequences(config.length, burn_in=config.burn_in, period=config.period, n_step=config.n_step,
                     gamma=config.gamma)
    stream = client.sample_stream(config.buffer, config.batch_size, mode, include_keys=True,
                                  importance_beta=config.importance_beta, wait=True, timeout=config.seconds + 60)
    progress = tracker.progress
    tracker.start_clock()  # the budget is training time
    with Loader(stream, device=config.device, prefetch=4) as loader:
        for batch in loader:
            out = trainer.step(batch)
            client.update_priorities(config.buffer, batch["key"].cpu().numpy(),
                                     out["priority"].cpu().numpy() + PRIORITY_EPSILON)
            tracker.stepped()
            if progress.learner_steps % config.publish_every == 0:
                weights.publish(trainer.online)
            if progress.learner_steps % config.eval_every == 0 and evaluate(config, client, trainer, tracker):
                break
            if tracker.out_of_time():
                break


def evaluate(config: DRQNLearnerConfig, client: ReplayClient, trainer: DRQNTrainer, tracker: Tracker) -> bool:
    """Scores the greedy recurrent policy (a curve point); whether it reaches the target."""
    steps_so_far = env_steps(client.describe(config.buffer))
    score = evaluate_recurrent(trainer.act, trainer.online.initial_state(config.eval_episodes), config.env_id,
                               config.eval_episodes, config.seed, trainer.device)
    tracker.record(score, steps_so_far)
    return score >= config.target_return
