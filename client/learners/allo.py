"""The ALLO learner: learns the Laplacian representation of a gridworld's random walk from replayd.

Creates an episodic buffer the actors fill with random-walk episodes; each step trains `AlloTrainer` on
one geometric-pair batch and two independent uniform-state batches, each its own server sample stream
behind a prefetching Loader. Every `eval_every` steps it scores the encoder against the exact Laplacian
eigenvectors (per-dimension |cosine|, client/gridworld.py); it stops at the target average or the
budget and writes eigenvectors.png (true vs learned heatmaps), the curve and summary.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from replayd.client.actors.allo import BUFFER, LAYOUT
from replayd.client.gridworld import GridWorld, cosine_similarities
from replayd.client.learners.common import (
    CurvePlot,
    Progress,
    create_or_reuse,
    env_steps,
    finish_learner,
    save_figure,
    start_learner,
    wait_for_steps,
)
from replayd.client.loader import Loader
from replayd.client.trainers.allo import AlloTrainer
from replayd.wire.components import Geometric, ModeOptions, States

GRID_SCHEMA = {"obs": ("float32", (2,)), "action": ("int64", ()), "reward": ("float32", ())}


@dataclass
class AlloLearnerConfig:
    address: str
    run_dir: str = "runs/allo"
    buffer: str = BUFFER
    layout: str = LAYOUT
    device: str = "cpu"
    seconds: float = 180.0  # time budget
    target_cosine: float = 0.9  # stop once the average |cosine| with the true eigenvectors reaches this
    capacity_steps: int = 120_000  # 2 actors x 1000 episodes x 51 rows fit
    learning_starts: int = 5_000  # sampleable steps before the first update
    d: int = 10
    hidden: tuple[int, ...] = (128, 128, 128)
    batch_size: int = 512  # for each of pairs, u1, u2
    discount: float = 0.9  # geometric pair offsets
    lr: float = 2e-3
    lr_beta: float = 1e-2
    lr_barrier: float = 0.0
    barrier_init: float = 2.0
    eval_every: int = 500  # learner steps between scorings
    seed: int = 0


def learn_allo(config: AlloLearnerConfig, report: Callable[[Progress], None] = lambda progress: None,
               waiting: Callable[[], None] = lambda: None,
               finished: Callable[[dict], None] = lambda summary: None) -> dict:
    """`report` gets every curve point; `waiting` runs at every poll for data (see Tracker); `finished` gets the
    summary once the run folder is written (see finish_learner)."""
    tracker, client = start_learner(config, "avg_cosine", report, waiting)
    create_or_reuse(client, config.buffer, lambda: client.create_buffer(config.buffer, config.capacity_steps,
                                                                        GRID_SCHEMA),
                    "episodic", config.capacity_steps, GRID_SCHEMA)
    env = GridWorld(config.layout)
    _, true = env.laplacian_eigenvectors(config.d)
    states = torch.from_numpy(env.all_observations()).to(config.device)
    trainer = AlloTrainer(2, config.d, hidden=config.hidden, lr=config.lr, lr_beta=config.lr_beta,
                          lr_barrier=config.lr_barrier, barrier_init=config.barrier_init, device=config.device)
    wait_for_steps(client, config.buffer, config.learning_starts, tracker)
    tracker.start_clock()  # the budget is training time

    def stream(mode: ModeOptions) -> Loader:
        return Loader(client.sample_stream(config.buffer, config.batch_size, mode, wait=True,
                                           timeout=config.seconds + 60), device=config.device)

    loaders = [stream(Geometric(discount=config.discount)), stream(States()), stream(States())]
    progress = tracker.progress
    cosine, solved = np.zeros(config.d), False

    def score() -> None:
        nonlocal cosine, solved
        cosine = cosine_similarities(trainer.encode(states).cpu().numpy(), true)
        tracker.record(round(float(cosine.mean()), 4), env_steps(client.describe(config.buffer)))
        solved = cosine.mean() >= config.target_cosine

    try:
        for pairs, u1, u2 in zip(*loaders, strict=True):
            trainer.step(pairs, u1, u2)
            tracker.stepped()
            if progress.learner_steps % config.eval_every == 0:
                score()
            if solved or tracker.out_of_time():
                break
    finally:
        for loader in loaders:
            loader.close()
    if progress.learner_steps % config.eval_every:
        score()  # the final encoder
    learned = trainer.encode(states).cpu().numpy()
    plot = CurvePlot("avg_cosine", f"average |cosine| of {config.d} eigenvectors",
                     f"ALLO on {config.layout} via replayd", config.target_cosine, x="learner_steps",
                     xlabel="learner steps")
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    plot_eigenvectors(env, learned, true, cosine, Path(config.run_dir) / "eigenvectors.png")
    return finish_learner(config, client, tracker, plot, {
        "solved": bool(solved), "avg_cosine": float(cosine.mean()), "cosine": [round(float(c), 4) for c in cosine],
        "target_cosine": config.target_cosine}, finished)


def plot_eigenvectors(env: GridWorld, learned: np.ndarray, true: np.ndarray, cosine: np.ndarray,
                      path: Path) -> None:
    """Heatmaps over the grid: true eigenvectors (top row) and learned ones (bottom row, sign-aligned)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = true.shape[1]
    norms = np.maximum(np.linalg.norm(learned, axis=0), 1e-12)
    signs = np.where((learned * true).sum(axis=0) < 0, -1.0, 1.0)
    aligned = learned * signs / norms  # unit columns, like the true ones
    figure, axes = plt.subplots(2, d, figsize=(1.8 * d, 4), squeeze=False)
    for j in range(d):
        scale = max(np.abs(true[:, j]).max(), np.abs(aligned[:, j]).max())
        for row, (values, label) in enumerate(((true[:, j], f"true {j}"), (aligned[:, j], f"cos {cosine[j]:.2f}"))):
            axes[row, j].imshow(env.to_image(values), cmap="coolwarm", vmin=-scale, vmax=scale)
            axes[row, j].set_title(label, fontsize=8)
            axes[row, j].axis("off")
    figure.suptitle("Laplacian eigenvectors: true (top) vs learned (bottom)", fontsize=9)
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
