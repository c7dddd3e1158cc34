"""PPO rollout pushes over gRPC: 8 actors x 128 steps x 64 envs, obs float32[64], into one rollout buffer.

Each rollout: 8 actor threads (one client each) push their (128, 64) slot range concurrently, the
learner then streams one epoch of minibatches and calls finish_rollout. Reported: push MB/s (bytes of
the pushed columns) and rollouts/s, beside ElegantRL's `ReplayBufferList` update (list transpose and
concatenate, in-process) of the same parts (MB/s), and the server's RSS after the first and the last
rollout.

    .venv/bin/python -m bench.bench_rollout_grpc [--quick]
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import numpy as np
import psutil
import torch

from bench.baselines.elegantrl_replay_buffer_list import ListRolloutStore
from bench.bench_gae import ACTORS, ENVS_PER_ACTOR, OBS_DIM, STEPS, actor_parts
from bench.bench_replay import ServerProcess
from replayd.client.replay_client import ReplayClient

SCHEMA = {"obs": ("float32", (OBS_DIM,)), "action": ("int64", ()), "log_prob": ("float32", ())}


def record(case: str, metric: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0,
           speedup: float = 0.0) -> dict:
    return {"bench": "rollout_grpc", "case": case, "metric": metric, "value": value, "unit": unit,
            "baseline": baseline, "baseline_value": baseline_value, "speedup": speedup}


def part_bytes(parts: list[dict[str, np.ndarray]]) -> int:
    return sum(a.nbytes for part in parts for name, a in part.items() if name != "bootstrap")


def list_update_mbps(parts: list[dict[str, np.ndarray]], repeats: int) -> float:
    names = [n for n in parts[0] if n != "bootstrap"]
    trajectories = [tuple(torch.from_numpy(p[n]) for n in names) for p in parts]
    store, times = ListRolloutStore(), []
    for _ in range(repeats):
        started = time.perf_counter()
        for trajectory in trajectories:
            store.add(trajectory)
        store.update()
        times.append(time.perf_counter() - started)
    return part_bytes(parts) / statistics.median(times) / 1e6


def run(quick: bool = False) -> list[dict]:
    torch.set_num_threads(1)
    rollouts = 10 if quick else 100
    parts = actor_parts()
    server = ServerProcess()
    try:
        learner = ReplayClient(server.address, timeout=60)
        learner.wait_ready(timeout=60)
        learner.create_rollout_buffer("ppo", STEPS, ACTORS * ENVS_PER_ACTOR, SCHEMA)
        actors = [ReplayClient(server.address, timeout=60) for _ in range(ACTORS)]
        server_process = psutil.Process(server.process.pid)
        push_seconds, rss = [], []
        for version in range(rollouts):
            def push(index: int, version: int = version) -> None:
                columns = {n: a for n, a in parts[index].items() if n != "bootstrap"}
                actors[index].push_rollout("ppo", version, index * ENVS_PER_ACTOR, 0,
                                           bootstrap_value=parts[index]["bootstrap"], **columns)

            threads = [threading.Thread(target=push, args=(i,)) for i in range(ACTORS)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            push_seconds.append(time.perf_counter() - started)
            for _ in learner.rollout_minibatches("ppo", 4096, epochs=1):
                pass
            learner.finish_rollout("ppo", version + 1)
            rss.append(server_process.memory_info().rss / 2**20)
        for client in [learner, *actors]:
            client.close()
    finally:
        server.stop()
    case = f"{ACTORS} actors x {STEPS} steps x {ENVS_PER_ACTOR} envs, obs float32[{OBS_DIM}], {rollouts} rollouts"
    ours = part_bytes(parts) / statistics.median(push_seconds) / 1e6
    lists = list_update_mbps(parts, repeats=5 if quick else 20)
    # RSS includes the touched shared-memory pages and the allocator's retained arenas: it must level off.
    checkpoints = sorted({1, 10, rollouts // 2, rollouts})
    return [
        record(case, "push_MB_per_s", ours, "MB/s", "ElegantRL ReplayBufferList update (in-process)", lists,
               ours / lists),
        *[record(case, f"server_rss_after_rollout_{n}", rss[n - 1], "MiB", "server RSS after rollout 1", rss[0])
          for n in checkpoints],
    ]


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(json.dumps(row))
