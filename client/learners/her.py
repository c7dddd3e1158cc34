"""The HER learner: DQN with hindsight relabeling on bit flipping. Creates an episodic buffer with goal fields
(`achieved_goal`, `desired_goal`), trains a goal-conditioned `DQNTrainer` on `Hindsight` batches (the server
relabels goals; the loader's thread recomputes rewards and terminations with the env's `compute_reward` and
`compute_terminated`, client/trainers/her.py), publishes weights (the last ones final: the actors stop),
evaluates the greedy policy's success rate, and writes a learning curve and a summary into a run folder.

With `relabel_ratio=0` every goal is the episode's own: plain goal-conditioned DQN, the demo's baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from replayd.client.actors.her import BUFFER, HIDDEN, WEIGHTS
from replayd.client.envs import BIT_FLIPPING
from replayd.client.learners.common import (
    CurvePlot,
    Progress,
    Tracker,
    WeightsPublisher,
    create_or_reuse,
    env_steps,
    finish_learner,
    start_learner,
    wait_for_steps,
)
from replayd.client.loader import Loader
from replayd.client.replay_client import ReplayClient
from replayd.client.trainers.dqn import DQNTrainer
from replayd.client.trainers.her import goal_input, her_prepare
from replayd.wire.components import Hindsight

OBSERVATION_FIELDS = ("observation", "achieved_goal", "desired_goal")
GOAL_FIELDS = ("achieved_goal", "desired_goal")


def goal_schema(bits: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The buffer's fields: the env's three bit vectors (int8), the flipped bit, the stored reward."""
    return {**{name: ("int8", (bits,)) for name in OBSERVATION_FIELDS}, "action": ("int64", ()),
            "reward": ("float32", ())}


@dataclass
class HERLearnerConfig:
    address: str
    run_dir: str = "runs/her"
    buffer: str = BUFFER
    weights: str = WEIGHTS
    env_id: str = BIT_FLIPPING
    device: str = "cpu"
    seconds: float = 300.0  # time budget
    target_success: float = 0.95  # stop once the greedy policy succeeds in this fraction of eval_episodes
    capacity_steps: int = 500_000
    batch_size: int = 128
    strategy: str = "future"
    relabel_ratio: float = 0.8  # 0: no relabeling (plain DQN)
    gamma: float = 0.98
    lr: float = 1e-3
    hidden: tuple[int, ...] = HIDDEN
    target_update_every: int = 500
    learning_starts: int = 1_000  # sampleable steps before the first update
    publish_every: int = 50  # learner steps between weight broadcasts
    eval_every: int = 500  # learner steps between evaluations
    eval_episodes: int = 100
    seed: int = 0


def learn_her(config: HERLearnerConfig, report: Callable[[Progress], None] = lambda progress: None,
              waiting: Callable[[], None] = lambda: None,
              finished: Callable[[dict], None] = lambda summary: None) -> dict:
    """`report` gets every curve point; `waiting` runs at every poll for data (see Tracker); `finished` gets the
    summary once the run folder is written, before the final weights stop the actors (see finish_learner)."""
    from replayd.client.envs import make

    tracker, client = start_learner(config, "success_rate", report, waiting)
    env = make(config.env_id).unwrapped
    bits, n_actions = int(env.observation_space["observation"].n), int(env.action_space.n)
    schema = goal_schema(bits)
    trainer = DQNTrainer(2 * bits, n_actions, hidden=config.hidden, lr=config.lr, double=True,
                         target_update_every=config.target_update_every, max_grad_norm=10.0, device=config.device)
    weights = WeightsPublisher(client, config.weights)
    weights.publish_then_create(trainer.online, lambda: create_or_reuse(
        client, config.buffer, lambda: client.create_buffer(config.buffer, config.capacity_steps, schema,
                                                            observation_fields=OBSERVATION_FIELDS,
                                                            goal_fields=GOAL_FIELDS),
        "episodic", config.capacity_steps, schema, {"goal_fields": GOAL_FIELDS}))
    wait_for_steps(client, config.buffer, config.learning_starts, tracker)
    loader = Loader(client.sample_stream(config.buffer, config.batch_size,
                                         Hindsight(config.strategy, config.relabel_ratio), wait=True,
                                         timeout=config.seconds + 60),
                    device=config.device, prefetch=4,
                    prepare=her_prepare(env.compute_reward, env.compute_terminated, config.gamma))
    train(config, client, trainer, tracker, weights, loader)
    progress = tracker.progress
    if not progress.curve or progress.learner_steps % config.eval_every:
        evaluate(config, client, trainer, tracker)  # the final policy: final_success_rate is never stale
    relabeling = f"HER ({config.strategy}, ratio {config.relabel_ratio})" if config.relabel_ratio else "no relabeling"
    plot = CurvePlot("success_rate", f"greedy success rate ({config.eval_episodes} episodes)",
                     f"DQN, {relabeling}, on {config.env_id} via replayd", config.target_success)
    final_version, publish_final = weights.final_later(trainer.online)
    return finish_learner(config, client, tracker, plot, {
        "solved": progress.score >= config.target_success, "final_success_rate": progress.score,
        "target_success": config.target_success, "weights_version": final_version}, finished, publish_final)


def train(config: HERLearnerConfig, client: ReplayClient, trainer: DQNTrainer, tracker: Tracker,
          weights: WeightsPublisher, loader: Loader) -> None:
    """Steps on the loader's batches until the greedy policy reaches the target or the budget runs out."""
    progress = tracker.progress
    tracker.start_clock()  # the budget is training time
    with loader:
        for batch in loader:
            trainer.step(batch)
            tracker.stepped()
            if progress.learner_steps % config.publish_every == 0:
                weights.publish(trainer.online)
            if progress.learner_steps % config.eval_every == 0 and evaluate(config, client, trainer, tracker):
                break
            if tracker.out_of_time():
                break


def evaluate(config: HERLearnerConfig, client: ReplayClient, trainer: DQNTrainer, tracker: Tracker) -> bool:
    """Scores the greedy policy's success rate (a curve point); whether it reaches the target."""
    steps_so_far = env_steps(client.describe(config.buffer))
    score = evaluate_success(trainer.online, config.env_id, config.eval_episodes, config.seed, trainer.device)
    tracker.record(score, steps_so_far)
    return score >= config.target_success


@torch.no_grad()
def evaluate_success(network: torch.nn.Module, env_id: str, episodes: int, seed: int,
                     device: torch.device | str = "cpu") -> float:
    """The fraction of `episodes` goal-env episodes (episode i reset with seed + i) that the greedy policy of a
    goal-conditioned Q-network ends in success; the episodes run side by side, one batched forward per step."""
    from replayd.client.envs import make

    envs = [make(env_id) for _ in range(episodes)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    succeeded = np.zeros(episodes, bool)
    active = list(range(episodes))
    while active:
        inputs = np.stack([goal_input(obs[i]["observation"], obs[i]["desired_goal"]) for i in active])
        actions = network(torch.as_tensor(inputs, device=device)).argmax(1).tolist()
        still = []
        for i, action in zip(active, actions, strict=True):
            obs[i], _, terminated, truncated, info = envs[i].step(int(action))
            if terminated or truncated:
                succeeded[i] = info["is_success"]
            else:
                still.append(i)
        active = still
    return float(succeeded.mean())
