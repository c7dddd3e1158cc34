"""`make demo`: the whole system on one machine: a replay server, 2 DQN actors and a learner on
CartPole-v1, until the greedy policy's mean return over 20 episodes reaches 475 or the budget runs out.

Every part is its own process talking gRPC on loopback, as it would across machines. The run folder
gets a learning curve (PNG) and a JSON summary; the server unlinks its shared memory on exit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from client.actor import DQNActorConfig, run_dqn_actor
from client.learner import DQNLearnerConfig, Progress, learn_dqn
from client.replay_client import ReplayClient


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, instance: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--instance", instance,
               "--http-port", "0", "--log-level", "WARNING"]
    return subprocess.Popen(command)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="time budget of the learner")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--run-dir", default="runs/demo")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eval-every", type=int, default=1_000, help="learner steps between evaluations")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    port = free_port()
    address = f"127.0.0.1:{port}"
    server = start_server(port, instance=f"demo{port}")
    context = mp.get_context("spawn")
    actors = [context.Process(target=run_dqn_actor, args=(DQNActorConfig(address, seed=i, seconds=args.seconds + 60),),
                              daemon=True) for i in range(args.actors)]
    try:
        for actor in actors:
            actor.start()
        monitor = ReplayClient(address)
        with tqdm(total=475, desc="greedy return", unit="") as bar:
            last_inserted, last_sampled, last_time = 0.0, 0.0, time.monotonic()

            def report(progress: Progress) -> None:
                nonlocal last_inserted, last_sampled, last_time
                counters = monitor.describe("cartpole")["counters"]
                now = time.monotonic()
                inserted, sampled = counters.get("inserted_rows", 0.0), counters.get("sampled_items", 0.0)
                bar.n = int(min(progress.eval_return or 0.0, 475))
                bar.set_postfix(env_steps=progress.env_steps, learner_steps_per_s=f"{progress.steps_per_second:.0f}",
                                insert_per_s=f"{(inserted - last_inserted) / (now - last_time):.0f}",
                                sample_per_s=f"{(sampled - last_sampled) / (now - last_time):.0f}",
                                eval_return=f"{progress.eval_return:.1f}")
                bar.refresh()
                last_inserted, last_sampled, last_time = inserted, sampled, now

            summary = learn_dqn(DQNLearnerConfig(address, run_dir=args.run_dir, device=args.device,
                                                 seconds=args.seconds, eval_every=args.eval_every), report)
        monitor.close()
    finally:
        for actor in actors:
            actor.terminate()
            actor.join(timeout=10)
        server.terminate()
        server.wait(timeout=30)
    brief = {k: summary[k] for k in ("solved", "final_eval_return", "seconds", "env_steps", "learner_steps")}
    print(json.dumps(brief))
    print(f"run folder: {args.run_dir} (learning_curve.png, summary.json)")
    return summary


if __name__ == "__main__":
    main()
