"""The PPO learner: owns the rollout buffer (T steps x actors * envs slots) and the policy versions.

Per version v: wait (poll, backoff) until every actor has pushed its part of rollout v, train `epochs`
epochs over the server's shuffled minibatches (advantages from the server's GAE, normalized per
minibatch as in CleanRL), then finish_rollout(v + 1) and publish weights v + 1, in that order: an actor holding
weights v + 1 always finds the buffer accepting v + 1. Evaluates the deterministic policy every
`eval_every` versions and stops at the target return or the time budget, publishing its weights once
more as final: the actors stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from replayd.client.actors.ppo import BUFFER, ENVS_PER_ACTOR, HIDDEN, ROLLOUT_STEPS, WEIGHTS
from replayd.client.learners.common import (
    STARTUP_SECONDS,
    CurvePlot,
    Progress,
    WeightsPublisher,
    create_or_reuse,
    evaluate_greedy,
    finish_learner,
    start_learner,
)
from replayd.client.loader import Loader
from replayd.client.polling import wait_until
from replayd.client.trainers.ppo import PPOTrainer


@dataclass
class PPOLearnerConfig:
    address: str
    run_dir: str = "runs/ppo"
    buffer: str = BUFFER
    weights: str = WEIGHTS
    env_id: str = "CartPole-v1"
    device: str = "cpu"
    seconds: float = 300.0  # time budget
    target_return: float = 475.0  # stop once the deterministic policy's mean over eval_episodes reaches this
    actors: int = 2
    num_envs: int = ENVS_PER_ACTOR  # per actor
    rollout_steps: int = ROLLOUT_STEPS
    epochs: int = 4
    minibatches: int = 4  # per epoch
    gamma: float = 0.99
    gae_lambda: float = 0.95
    lr: float = 1e-3
    hidden: tuple[int, ...] = HIDDEN
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    eval_every: int = 5  # policy versions between evaluations
    eval_episodes: int = 20
    seed: int = 0


def learn_ppo(config: PPOLearnerConfig, report: Callable[[Progress], None] = lambda progress: None,
              waiting: Callable[[], None] = lambda: None,
              finished: Callable[[dict], None] = lambda summary: None) -> dict:
    """`report` gets every curve point; `waiting` runs at every poll for data (see Tracker); `finished` gets the
    summary once the run folder is written, before the final weights stop the actors (see finish_learner)."""
    tracker, client = start_learner(config, "eval_return", report, waiting)
    import gymnasium as gym

    probe = gym.make(config.env_id)
    obs_shape, n_actions = probe.observation_space.shape, int(probe.action_space.n)
    slots = config.actors * config.num_envs
    schema = {"obs": ("float32", obs_shape), "action": ("int64", ()), "log_prob": ("float32", ())}
    trainer = PPOTrainer(int(torch.Size(obs_shape).numel()), n_actions, config.hidden, lr=config.lr,
                         clip_coef=config.clip_coef, vf_coef=config.vf_coef, ent_coef=config.ent_coef,
                         norm_adv=False, max_grad_norm=config.max_grad_norm, device=config.device)
    weights = WeightsPublisher(client, config.weights)
    # Actors fetch the weights once the buffer is there, and wait for finish_rollout to reach them.
    version = weights.publish_then_create(trainer.model, lambda: create_or_reuse(
        client, config.buffer, lambda: client.create_rollout_buffer(config.buffer, config.rollout_steps, slots,
                                                                    schema, config.gamma, config.gae_lambda),
        "rollout", config.rollout_steps * slots, schema,
        {"num_steps": config.rollout_steps, "num_envs": slots, "gamma": config.gamma,
         "gae_lambda": config.gae_lambda}))
    client.finish_rollout(config.buffer, version)
    minibatch_size = config.rollout_steps * slots // config.minibatches
    progress = tracker.progress
    rollouts, solved = 0, False

    def evaluate() -> None:
        nonlocal solved
        score = evaluate_greedy(lambda obs: trainer.model.actor(obs).argmax(1), config.env_id,
                                config.eval_episodes, config.seed, trainer.device)
        tracker.record(score, rollouts * config.rollout_steps * slots, policy_version=version)
        solved = score >= config.target_return

    def rollout_complete() -> bool:
        return client.describe(config.buffer)["rollout_complete"]

    # The first rollout: the actors coming up do not eat the budget (the clock starts once it is complete).
    wait_until(rollout_complete, time.monotonic() + STARTUP_SECONDS, "the actors' first rollout",
               tracker.still_waiting, delay=0.001, max_delay=0.02)
    tracker.start_clock()
    while not (solved or tracker.out_of_time()):
        try:
            wait_until(rollout_complete, tracker.deadline, f"rollout {version} complete", tracker.still_waiting,
                       delay=0.001, max_delay=0.02)
        except TimeoutError:
            break  # the budget ran out while actors were still collecting
        rollouts += 1
        loader = Loader(client.rollout_minibatches(config.buffer, minibatch_size, epochs=config.epochs,
                                                   normalize_advantages=True, seed=config.seed + version),
                        device=config.device)
        try:
            for batch in loader:
                trainer.step(batch)
                tracker.stepped()
        finally:
            loader.close()
        version += 1
        client.finish_rollout(config.buffer, version)
        weights.publish(trainer.model, version=version)
        if rollouts % config.eval_every == 0:
            evaluate()
    if not progress.curve or rollouts % config.eval_every:
        evaluate()  # the final policy: the summary's final_eval_return is never a stale or missing score
    plot = CurvePlot("eval_return", f"deterministic return (mean of {config.eval_episodes} episodes)",
                     f"PPO on {config.env_id} via replayd", config.target_return)
    # Published final once the run folder is written, the actors stop instead of collecting for it (no policy
    # version: no rollout uses it; a rollout they collect meanwhile for `version` is left unused).
    return finish_learner(config, client, tracker, plot, {
        "solved": solved, "final_eval_return": progress.score, "target_return": config.target_return,
        "env_steps": rollouts * config.rollout_steps * slots, "rollouts": rollouts, "weights_version": version},
        finished, lambda: weights.publish(trainer.model, final=True))
