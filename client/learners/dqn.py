"""The DQN learner: creates its buffer, trains from a prefetched sample stream, publishes weights (the
last ones final: the actors stop), evaluates the greedy policy, and writes a learning curve and a
summary into a run folder."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from replayd.client.learners.common import (
    CurvePlot,
    Progress,
    WeightsPublisher,
    create_or_reuse,
    env_spaces,
    env_steps,
    evaluate_greedy,
    finish_learner,
    start_learner,
    wait_for_steps,
)
from replayd.client.loader import Loader
from replayd.client.local_reader import LocalReader
from replayd.client.trainers.dqn import DQNTrainer
from replayd.wire.components import Transitions


def transition_schema(obs_shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The buffer's fields for an env with float observations of `obs_shape` and discrete actions."""
    return {"obs": ("float32", obs_shape), "action": ("int64", ()), "reward": ("float32", ())}


CARTPOLE_SCHEMA = transition_schema((4,))


@dataclass
class DQNLearnerConfig:
    address: str
    run_dir: str = "runs/dqn"
    buffer: str = "cartpole"
    weights: str = "q"
    env_id: str = "CartPole-v1"
    device: str = "cpu"
    seconds: float = 300.0  # time budget
    target_return: float = 475.0  # stop once the greedy policy's mean over eval_episodes reaches this
    capacity_steps: int = 100_000
    batch_size: int = 128
    n_step: int = 3
    gamma: float = 0.99
    lr: float = 5e-4
    hidden: tuple[int, ...] = (128, 128)
    target_update_every: int = 500
    learning_starts: int = 1_000  # sampleable steps before the first update
    publish_every: int = 50  # learner steps between weight broadcasts
    eval_every: int = 1_000  # learner steps between evaluations
    eval_episodes: int = 20
    seed: int = 0
    local: bool = False  # sample the server's shared memory directly (same host) instead of over gRPC
    compile_loss: bool = False  # the Q-loss compiled ahead by inductor (CPU; needs a C++ compiler)


def learn_dqn(config: DQNLearnerConfig, report: Callable[[Progress], None] = lambda progress: None,
              waiting: Callable[[], None] = lambda: None,
              finished: Callable[[dict], None] = lambda summary: None) -> dict:
    """`report` gets every curve point; `waiting` runs at every poll for data (see Tracker); `finished` gets the
    summary once the run folder is written, before the final weights stop the actors (see finish_learner)."""
    tracker, client = start_learner(config, "eval_return", report, waiting)
    obs_shape, n_actions = env_spaces(config.env_id)
    schema = transition_schema(obs_shape)
    trainer = DQNTrainer(int(np.prod(obs_shape)), n_actions, hidden=config.hidden, lr=config.lr, double=True,
                         target_update_every=config.target_update_every, max_grad_norm=10.0, device=config.device,
                         loss_strategy="compiled" if config.compile_loss else "auto")
    weights = WeightsPublisher(client, config.weights)
    weights.publish_then_create(trainer.online, lambda: create_or_reuse(
        client, config.buffer, lambda: client.create_buffer(config.buffer, config.capacity_steps, schema),
        "episodic", config.capacity_steps, schema))
    wait_for_steps(client, config.buffer, config.learning_starts, tracker)

    progress = tracker.progress
    solved = False

    def evaluate() -> None:
        nonlocal solved
        steps_so_far = env_steps(client.describe(config.buffer))
        score = evaluate_greedy(lambda obs: trainer.online(obs).argmax(1), config.env_id, config.eval_episodes,
                                config.seed, trainer.device)
        tracker.record(score, steps_so_far)
        solved = score >= config.target_return

    reader = LocalReader(client, config.buffer) if config.local else None
    loader = None
    try:
        mode = Transitions(n_step=config.n_step, gamma=config.gamma)
        if reader is not None:
            stream = reader.sample_stream(config.batch_size, mode)
        else:
            # The deadline also covers compiling on the first batch (about 15 s on a cold cache, before the clock).
            stream = client.sample_stream(config.buffer, config.batch_size, mode, wait=True,
                                          timeout=config.seconds + (600 if config.compile_loss else 60))
        loader = Loader(stream, device=config.device, prefetch=4)
        batches = iter(loader)
        first = next(batches, None) if config.compile_loss else None
        if first is not None:  # compiling takes seconds, which are not training time; the batch trains next
            trainer.compile_for(first)
            batches = itertools.chain([first], batches)
        tracker.start_clock()  # the budget is training time
        for batch in batches:
            trainer.step(batch)
            tracker.stepped()
            if progress.learner_steps % config.publish_every == 0:
                weights.publish(trainer.online)
            if progress.learner_steps % config.eval_every == 0:
                evaluate()
            if solved or tracker.out_of_time():
                break
    finally:
        if loader is not None:
            loader.close()
        if reader is not None:
            reader.close()
    if not progress.curve or progress.learner_steps % config.eval_every:
        evaluate()  # the final policy: the summary's final_eval_return is never a stale or missing score
    plot = CurvePlot("eval_return", f"greedy return (mean of {config.eval_episodes} episodes)",
                     f"DQN on {config.env_id} via replayd", config.target_return)
    final_version, publish_final = weights.final_later(trainer.online)
    return finish_learner(config, client, tracker, plot, {
        "solved": solved, "final_eval_return": progress.score, "target_return": config.target_return,
        "weights_version": final_version}, finished, publish_final)
