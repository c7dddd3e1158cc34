"""The DQN learner: creates its buffer, trains from a prefetched sample stream, publishes weights,
evaluates the greedy policy, and writes a learning curve and a summary into a run folder.

`python -m client.learner --address HOST:PORT` (or `replayd learn --algo dqn ...`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from client.loader import Loader
from client.params import module_to_bytes
from client.replay_client import ReplayClient
from client.trainers.dqn import DQNTrainer

CARTPOLE_SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}


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


@dataclass
class Progress:
    """What the learner reports to whoever drives it (the demo's progress bar)."""

    learner_steps: int = 0
    env_steps: int = 0
    steps_per_second: float = 0.0
    eval_return: float | None = None
    curve: list[dict] = field(default_factory=list)


def evaluate(network: torch.nn.Module, env_id: str, episodes: int, seed: int) -> float:
    """Mean undiscounted return of the greedy policy over `episodes` episodes."""
    import gymnasium as gym

    env = gym.make(env_id)
    returns = []
    with torch.no_grad():
        for episode in range(episodes):
            obs, _ = env.reset(seed=seed + episode)
            done, total = False, 0.0
            while not done:
                action = int(network(torch.as_tensor(obs, dtype=torch.float32)[None]).argmax(1))
                obs, reward, terminated, truncated, _ = env.step(action)
                total += float(reward)
                done = terminated or truncated
            returns.append(total)
    return float(np.mean(returns))


def wait_for_steps(client: ReplayClient, buffer: str, steps: int, deadline: float) -> None:
    delay = 0.05
    while client.describe(buffer)["sampleable_steps"] < steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"buffer {buffer!r} did not reach {steps} sampleable steps before the deadline")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def learn_dqn(config: DQNLearnerConfig, report: Callable[[Progress], None] = lambda progress: None) -> dict:
    torch.manual_seed(config.seed)
    started = time.monotonic()
    deadline = started + config.seconds
    client = ReplayClient(config.address, timeout=30)
    client.wait_ready(timeout=60)
    client.create_buffer(config.buffer, config.capacity_steps, CARTPOLE_SCHEMA)
    trainer = DQNTrainer(4, 2, hidden=config.hidden, lr=config.lr, double=True,
                         target_update_every=config.target_update_every, max_grad_norm=10.0, device=config.device)
    version = 1
    client.publish_weights(config.weights, version, module_to_bytes(trainer.online))
    wait_for_steps(client, config.buffer, config.learning_starts, deadline)

    stream = client.sample_stream(config.buffer, config.batch_size, n_step=config.n_step, gamma=config.gamma,
                                  wait=True, timeout=config.seconds + 60)
    loader = Loader(stream, device=config.device, prefetch=4)
    progress = Progress()
    window_start, window_steps = time.monotonic(), 0
    solved = False
    try:
        for batch in loader:
            trainer.step(batch)
            progress.learner_steps += 1
            window_steps += 1
            if progress.learner_steps % config.publish_every == 0:
                version += 1
                client.publish_weights(config.weights, version, module_to_bytes(trainer.online))
            if progress.learner_steps % config.eval_every == 0:
                now = time.monotonic()
                progress.steps_per_second = window_steps / (now - window_start)
                progress.env_steps = int(client.describe(config.buffer)["counters"].get("inserted_rows", 0))
                progress.eval_return = evaluate(trainer.online, config.env_id, config.eval_episodes, config.seed)
                progress.curve.append({"seconds": round(time.monotonic() - started, 2),
                                       "env_steps": progress.env_steps, "learner_steps": progress.learner_steps,
                                       "eval_return": progress.eval_return})
                report(progress)
                window_start, window_steps = time.monotonic(), 0
                solved = progress.eval_return >= config.target_return
            if solved or time.monotonic() > deadline:
                break
    finally:
        loader.close()
    summary = {
        "solved": solved,
        "final_eval_return": progress.eval_return,
        "target_return": config.target_return,
        "seconds": round(time.monotonic() - started, 1),
        "learner_steps": progress.learner_steps,
        "env_steps": progress.env_steps,
        "weights_version": version,
        "buffer": client.describe(config.buffer),
        "config": asdict(config),
        "curve": progress.curve,
    }
    write_run(Path(config.run_dir), summary)
    client.close()
    return summary


def write_run(run_dir: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    curve = summary["curve"]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([p["env_steps"] for p in curve], [p["eval_return"] for p in curve], marker="o")
    axis.axhline(summary["target_return"], color="gray", linestyle="--", label="target")
    axis.set_xlabel("environment steps")
    axis.set_ylabel(f"greedy return (mean of {summary['config']['eval_episodes']} episodes)")
    axis.set_title(f"DQN on {summary['config']['env_id']} via replayd")
    axis.legend()
    figure.tight_layout()
    figure.savefig(run_dir / "learning_curve.png", dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="replayd learner")
    parser.add_argument("--algo", choices=["dqn"], default="dqn")
    parser.add_argument("--address", required=True)
    parser.add_argument("--run-dir", default="runs/dqn")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--eval-every", type=int, default=1_000, help="learner steps between evaluations")
    parser.add_argument("--learning-starts", type=int, default=1_000, help="sampleable steps before training")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    summary = learn_dqn(DQNLearnerConfig(args.address, run_dir=args.run_dir, device=args.device, seconds=args.seconds,
                                         eval_every=args.eval_every, learning_starts=args.learning_starts),
                        report=lambda p: print(json.dumps(p.curve[-1]), flush=True))
    print(json.dumps({k: summary[k] for k in ("solved", "final_eval_return", "seconds", "env_steps")}), flush=True)


if __name__ == "__main__":
    main()
