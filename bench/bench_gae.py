"""GAE speed and rollout-buffer memory, ours against esper-lite's GAE and ElegantRL's `ReplayBufferList`.

    .venv/bin/python -m bench.bench_gae [--quick]      # JSON lines on stdout

GAE cases time `compute_gae` with its preallocated workspace and outputs (how the buffer runs it)
next to esper-lite's torch versions (bench/baselines/esper_lite_gae.py), in the same process, medians.
Two candidates for the time axis are timed too, so the design choice stays checked: a plain loop of
numpy vector ops over time (a block of T steps) and a log-depth Hillis-Steele affine scan. The memory
case runs each store in its own process (RSS is per process): 8 actors x 128 steps x 64 envs, obs
float32[64], 100 rollouts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import torch

from bench.baselines.elegantrl_replay_buffer_list import ListRolloutStore
from bench.baselines.esper_lite_gae import compute_advantages_loop, compute_advantages_vectorized
from bench.subprocesses import peak_rss_bytes
from replayd.server.buffers.rollout import RolloutBuffer, RolloutConfig, RolloutField
from replayd.server.gae import GaeWorkspace, compute_gae

GAE_SHAPES = [(25, 4), (128, 1024), (2048, 64)]
GAMMA, LAMBDA = 0.99, 0.95
ACTORS, STEPS, ENVS_PER_ACTOR, OBS_DIM = 8, 128, 64, 64
MiB = 2**20
# Baselines, named for what they are (bench/baselines/).
ESPER_VECTORIZED = "esper-lite GAE: vectorized over envs"
ESPER_LOOP = "esper-lite GAE: per-env, per-step loop"
ELEGANTRL_LIST = "ElegantRL ReplayBufferList: list transpose + torch.cat"
OURS_BLOCKED = "ours: blocked scan (the default)"
OURS_FLOAT64 = "ours: float64 accumulation (the default)"


def record(case: str, metric: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0,
           speedup: float = 0.0) -> dict:
    return {"bench": "gae", "case": case, "metric": metric, "value": value, "unit": unit,
            "baseline": baseline, "baseline_value": baseline_value, "speedup": speedup}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def random_rollout(T: int, N: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "reward": rng.standard_normal((T, N)).astype(np.float32),
        "value": rng.standard_normal((T, N)).astype(np.float32),
        "terminated": rng.random((T, N)) < 0.01,
        "truncated": rng.random((T, N)) < 0.01,
        "final_value": rng.standard_normal((T, N)).astype(np.float32),
        "bootstrap": rng.standard_normal(N).astype(np.float32),
    }


def hillis_steele_gae(r: dict[str, np.ndarray], gamma: float, lam: float) -> np.ndarray:
    """Candidate: log2(T) passes of A_t += C_t·A_{t+s}, C_t *= C_{t+s} over the whole (T, N) array."""
    next_value = np.concatenate([r["value"][1:], r["bootstrap"][None]]).astype(np.float64)  # (T, N)
    next_value = np.where(r["truncated"], r["final_value"], next_value)
    A = r["reward"] + gamma * next_value * ~r["terminated"] - r["value"]  # δ, (T, N) float64
    C = gamma * lam * ~(r["terminated"] | r["truncated"])  # (T, N)
    shift = 1
    while shift < len(A):
        A[:-shift] += C[:-shift] * A[shift:]
        C[:-shift] *= C[shift:]
        shift *= 2
    return A


def max_relative_error(got: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(got - reference) / np.maximum(np.abs(reference), 1e-6)))


def bench_gae_shape(T: int, N: int, quick: bool) -> list[dict]:
    case = f"T={T},N={N}"
    repeats = 5 if quick else 30
    r = random_rollout(T, N)
    advantage, returns = np.empty((T, N), np.float32), np.empty((T, N), np.float32)

    def ours(workspace: GaeWorkspace) -> Callable[[], None]:
        return lambda: compute_gae(r["reward"], r["value"], r["terminated"], r["truncated"], r["final_value"],
                                   r["bootstrap"], GAMMA, LAMBDA, advantage, returns, workspace)

    ours_ms = median_ms(ours(GaeWorkspace(T, N)), repeats)
    reference = advantage.astype(np.float64)
    time_loop_ms = median_ms(ours(GaeWorkspace(T, N, block=T)), repeats)
    f32_ms = median_ms(ours(GaeWorkspace(T, N, dtype=np.float32)), repeats)
    f32_error = max_relative_error(advantage, reference)
    scan_ms = median_ms(lambda: hillis_steele_gae(r, GAMMA, LAMBDA), repeats)

    # esper-lite's layout: (num_envs, steps), one `dones` flag.
    values, rewards = torch.from_numpy(r["value"].T.copy()), torch.from_numpy(r["reward"].T.copy())
    dones = torch.from_numpy((r["terminated"] | r["truncated"]).T.astype(np.float32))
    esper_vec_ms = median_ms(lambda: compute_advantages_vectorized(values, rewards, dones, GAMMA, LAMBDA), repeats)
    out = [
        record(case, "gae_ms", ours_ms, "ms", ESPER_VECTORIZED, esper_vec_ms, esper_vec_ms / ours_ms),
        record(case, "gae_ms_time_loop_candidate", time_loop_ms, "ms", OURS_BLOCKED, ours_ms,
               ours_ms / time_loop_ms),
        record(case, "gae_ms_hillis_steele_candidate", scan_ms, "ms", OURS_BLOCKED, ours_ms,
               ours_ms / scan_ms),
        record(case, "gae_ms_float32_accumulation", f32_ms, "ms", OURS_FLOAT64, ours_ms,
               ours_ms / f32_ms),
        record(case, "gae_max_rel_error_float32_accumulation", f32_error, "ratio"),
    ]
    # The per-element torch loop takes seconds on the big shapes: one run there, skipped when quick.
    if not quick or T * N <= 1000:
        loop_ms = median_ms(lambda: compute_advantages_loop(values, rewards, dones, GAMMA, LAMBDA),
                            repeats if T * N <= 1000 else 1)
        out.append(record(case, "gae_ms", ours_ms, "ms", ESPER_LOOP, loop_ms, loop_ms / ours_ms))
    return out


def actor_parts(seed: int = 0) -> list[dict[str, np.ndarray]]:
    """One rollout's worth of actor parts, each (STEPS, ENVS_PER_ACTOR, ...)."""
    rng = np.random.default_rng(seed)
    shape = (STEPS, ENVS_PER_ACTOR)
    return [
        {
            "obs": rng.standard_normal((*shape, OBS_DIM)).astype(np.float32),
            "action": rng.integers(0, 6, shape),
            "log_prob": rng.standard_normal(shape).astype(np.float32),
            "reward": rng.standard_normal(shape).astype(np.float32),
            "value": rng.standard_normal(shape).astype(np.float32),
            "terminated": rng.random(shape) < 0.01,
            "truncated": rng.random(shape) < 0.01,
            "final_value": rng.standard_normal(shape).astype(np.float32),
            "bootstrap": rng.standard_normal(ENVS_PER_ACTOR).astype(np.float32),
        }
        for _ in range(ACTORS)
    ]


def push_parts(buffer: RolloutBuffer, policy_version: int, parts: list[dict[str, np.ndarray]]) -> int:
    """Pushes actor i's part into env slots [i·n, (i+1)·n) for the whole rollout; returns pushes made.

    Each part holds the buffer's columns (steps, n, ...) plus `bootstrap` (n,) V(s_T).
    """
    env_start = 0
    for columns in parts:
        data = {name: array for name, array in columns.items() if name != "bootstrap"}
        buffer.push(policy_version, env_start, 0, data, columns["bootstrap"])
        env_start += columns["reward"].shape[1]
    return len(parts)


def memory_child(store: str, rollouts: int) -> dict:
    """Runs `rollouts` updates of one store in this process; RSS after rollout 1 and the last."""
    template = actor_parts()
    process = psutil.Process()
    rss, update_times, shm_bytes = [], [], 0
    buffer = None
    if store == "ours":
        config = RolloutConfig(
            fields=(RolloutField("obs", "float32", (OBS_DIM,)), RolloutField("action", "int64"),
                    RolloutField("log_prob", "float32")),
            num_steps=STEPS, num_envs=ACTORS * ENVS_PER_ACTOR, gamma=GAMMA, gae_lambda=LAMBDA,
        )
        buffer = RolloutBuffer.create("rollout", f"bench{uuid.uuid4().hex[:8]}", config)
        shm_bytes = buffer.info()["bytes"]
    else:
        list_store = ListRolloutStore()
    try:
        for version in range(rollouts):
            # Parts arrive as fresh memory every rollout (as decoded from the wire).
            parts = [{name: array.copy() for name, array in part.items()} for part in template]
            start = time.perf_counter()
            if buffer is not None:
                push_parts(buffer, version, parts)
                buffer.finish_rollout(version + 1)
            else:
                for part in parts:
                    list_store.add(tuple(torch.from_numpy(array) for array in part.values()))
                list_store.update()
            update_times.append(time.perf_counter() - start)
            del parts
            rss.append(process.memory_info().rss)
    finally:
        if buffer is not None:
            buffer.close()
            buffer.unlink()
    return {
        "rss_after_1": rss[0], "rss_after_last": rss[-1],
        "peak_rss": peak_rss_bytes(),
        "shm_bytes": shm_bytes, "update_ms": float(np.median(update_times)) * 1e3,
    }


def bench_memory(quick: bool) -> list[dict]:
    rollouts = 10 if quick else 100
    case = f"{ACTORS}x{STEPS}x{ENVS_PER_ACTOR} obs[{OBS_DIM}], {rollouts} rollouts"
    results = {}
    for store in ("elegantrl", "ours"):
        command = [sys.executable, "-m", "bench.bench_gae", "--memory-child", store, str(rollouts)]
        done = subprocess.run(command, capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent.parent)
        results[store] = json.loads(done.stdout)
    ours, lists = results["ours"], results["elegantrl"]
    return [
        record(case, "rss_after_rollout_1", ours["rss_after_1"] / MiB, "MiB", ELEGANTRL_LIST,
               lists["rss_after_1"] / MiB),
        record(case, f"rss_after_rollout_{rollouts}", ours["rss_after_last"] / MiB, "MiB", ELEGANTRL_LIST,
               lists["rss_after_last"] / MiB),
        record(case, "rss_growth_after_rollout_1", (ours["rss_after_last"] - ours["rss_after_1"]) / MiB, "MiB",
               ELEGANTRL_LIST, (lists["rss_after_last"] - lists["rss_after_1"]) / MiB),
        record(case, "peak_rss", ours["peak_rss"] / MiB, "MiB", ELEGANTRL_LIST, lists["peak_rss"] / MiB,
               lists["peak_rss"] / ours["peak_rss"]),
        record(case, "shared_memory", ours["shm_bytes"] / MiB, "MiB", ELEGANTRL_LIST, 0.0),
        record(case, "update_ms", ours["update_ms"], "ms", ELEGANTRL_LIST, lists["update_ms"],
               lists["update_ms"] / ours["update_ms"]),
    ]


def run(quick: bool = False) -> list[dict]:
    # One thread: numpy runs single-threaded too, and torch's pool makes the baselines' timings erratic.
    torch.set_num_threads(1)
    records = []
    for T, N in GAE_SHAPES:
        records += bench_gae_shape(T, N, quick)
    return records + bench_memory(quick)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory-child"]:
        print(json.dumps(memory_child(sys.argv[2], int(sys.argv[3]))))
    else:
        for row in run(quick="--quick" in sys.argv):
            print(json.dumps(row))
