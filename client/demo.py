"""`make demo`: a replay server, two scripted CartPole actors and a sampling learner on one machine.

The actors step gymnasium's CartPole-v1 with a random policy and stream episodes through EpisodeWriter;
the learner pulls n-step transition batches from a sample stream. Everything runs as separate
processes talking gRPC on loopback, and the server unlinks its shared memory on exit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from client import EpisodeWriter, ReplayClient

SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--log-level", "WARNING"]
    return subprocess.Popen(command)


def scripted_actor(address: str, buffer: str, seed: int, deadline: float) -> None:
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    with ReplayClient(address) as client:
        writer = EpisodeWriter(client, buffer, batch_rows=2048)
        obs, _ = env.reset(seed=seed)
        while time.monotonic() < deadline:
            action = int(rng.integers(2))
            next_obs, reward, terminated, truncated, _ = env.step(action)
            writer.append(obs=obs, action=action, reward=reward)
            obs = next_obs
            if terminated or truncated:
                writer.end_episode(terminated=terminated, obs=obs)
                obs, _ = env.reset()
        writer.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the actors run")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--run-dir", default="runs/demo")
    args = parser.parse_args(argv)

    port = free_port()
    address = f"127.0.0.1:{port}"
    server = start_server(port)
    try:
        client = ReplayClient(address)
        client.wait_ready(timeout=30)
        client.create_buffer("cartpole", 100_000, SCHEMA)
        deadline = time.monotonic() + args.seconds
        actors = [mp.get_context("spawn").Process(target=scripted_actor, args=(address, "cartpole", i, deadline))
                  for i in range(args.actors)]
        for actor in actors:
            actor.start()
        batches = 0
        with tqdm(total=int(args.seconds), unit="s", desc="learner") as progress:
            stream = client.sample_stream("cartpole", 256, n_step=3, gamma=0.99, wait=True, timeout=args.seconds + 30)
            started = time.monotonic()
            for batch in stream:
                batches += 1
                if batches % 200 == 0:
                    info = client.describe("cartpole")
                    progress.n = min(int(time.monotonic() - started), int(args.seconds))
                    progress.set_postfix(stored=info["stored_steps"], episodes=info["episodes"],
                                         batches_per_s=f"{batches / (time.monotonic() - started):.0f}",
                                         mean_return=f"{batch['n_step_return'].mean():.2f}")
                if time.monotonic() > deadline:
                    stream.close()
                    break
        for actor in actors:
            actor.join()
        info = client.describe("cartpole")
        summary = {"stored_steps": info["stored_steps"], "episodes": info["episodes"],
                   "inserted_episodes": info["counters"].get("inserted_episodes", 0), "learner_batches": batches}
        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary))
        print(f"wrote {run_dir / 'summary.json'}")
        client.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
