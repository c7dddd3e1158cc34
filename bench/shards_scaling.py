"""Aggregate sampling over K shards: K server processes and K sampling client processes, each client a
ShardedReplayClient over all K shards streaming cartpole transitions (batch 256). Reported per K: the aggregate
transitions/s beside K times one shard's (K = 1, same run), and the cores each server and client process kept
busy over the measured window, so that the cores one shard needs can be read off.

    .venv/bin/python -m bench.shards_scaling [--shards 1,2,4,8] [--seconds 8] [--quick]    # JSON lines

Meant for a machine with >= 16 cores (K = 8 takes 16 processes), where the target is an aggregate of at least
0.8 K times one shard's. bench/bench_shards.py (in `make bench`) runs K = 1, 2, 3 of it on any machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import numpy as np
import psutil

from bench import subprocesses
from bench.bench_replay import PROFILES, ServerProcess, insert_batches
from replayd.client.replay_client import spans_requests
from replayd.client.sharded import ShardedReplayClient
from replayd.wire.components import Transitions

PROFILE = PROFILES[0]  # cartpole
BATCH = PROFILE.batch
TARGET = 0.8


def record(case: str, metric: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0,
           speedup: float = 0.0, **extra: object) -> dict:
    return {"bench": "shards", "case": case, "metric": metric, "value": float(value), "unit": unit,
            "baseline": baseline, "baseline_value": float(baseline_value), "speedup": float(speedup), **extra}


def fill(client: ShardedReplayClient, capacity_per_shard: int) -> None:
    """The buffer on every shard, each shard's ring filled past its capacity (equal sizes)."""
    shards = client.shards.members()
    client.create_buffer(PROFILE.name, capacity_per_shard * len(shards), PROFILE.schema)
    for k, shard in enumerate(shards):
        batches, _, _ = insert_batches(PROFILE, 20_000, int(capacity_per_shard * 1.2), np.random.default_rng(k),
                                       first_id=k * 2**40)
        for spans in batches:
            shard.client.insert(spans_requests(PROFILE.name, spans, shard.client.max_request_bytes), timeout=600)


def _sampler(addresses: list[str], seconds: float, start: mp.Barrier, results: mp.Queue) -> None:
    """One learner process: a sharded stream, warmed up, then counted over `seconds` from the common start."""
    with ShardedReplayClient(addresses, timeout=600) as client:
        stream = client.sample_stream(PROFILE.name, BATCH, Transitions())
        for _ in range(20):
            next(stream)
        start.wait(timeout=300)
        cpu, started, batches = time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - started < seconds:
            next(stream)
            batches += 1
        elapsed = time.perf_counter() - started
        results.put((batches * BATCH / elapsed, (time.process_time() - cpu) / elapsed))
        stream.close()


def measure(k: int, seconds: float, capacity_per_shard: int) -> dict:
    """K shards and K sampling processes: aggregate transitions/s and each process's cores over the window."""
    servers = [ServerProcess() for _ in range(k)]
    try:
        addresses = [server.address for server in servers]
        with ShardedReplayClient(addresses, timeout=600) as client:
            client.wait_ready(60)
            fill(client, capacity_per_shard)
        context = mp.get_context("spawn")
        start, results = context.Barrier(k + 1), context.Queue()
        samplers = [context.Process(target=_sampler, args=(addresses, seconds, start, results)) for _ in range(k)]
        for process in samplers:
            process.start()
        meters = [psutil.Process(server.process.pid) for server in servers]
        start.wait(timeout=300)
        server_cpu, started = [subprocesses.cpu_seconds(m) for m in meters], time.perf_counter()
        reports = [results.get(timeout=seconds + 300) for _ in samplers]
        elapsed = time.perf_counter() - started
        server_cores = [(subprocesses.cpu_seconds(m) - c) / elapsed for m, c in zip(meters, server_cpu, strict=True)]
        for process in samplers:
            process.join(timeout=60)
        return {"shards": k, "transitions_per_s": sum(rate for rate, _ in reports),
                "server_cpu_cores": [round(c, 3) for c in server_cores],
                "client_cpu_cores": [round(cores, 3) for _, cores in reports]}
    finally:
        for server in servers:
            server.stop()


def records(shard_counts: list[int], seconds: float, capacity_per_shard: int) -> list[dict]:
    """One record per K (K = 1 first: the baseline each K is scored against, K times it)."""
    out, one = [], None
    for k in shard_counts:
        result = measure(k, seconds, capacity_per_shard)
        one = result["transitions_per_s"] if one is None else one
        cores = sum(result["server_cpu_cores"]) + sum(result["client_cpu_cores"])
        case = (f"K={k} shards, {k} sampling processes (each a ShardedReplayClient over all K), cartpole batch "
                f"{BATCH}, {os.cpu_count()} cores")
        case += f" (target on >= 16 cores: speedup >= {TARGET})" if k > 1 else ""
        out.append(record(case, "transitions_per_s", result["transitions_per_s"], "transitions/s",
                          f"{k} times one shard's rate" if k > 1 else "", k * one if k > 1 else 0.0,
                          result["transitions_per_s"] / (k * one) if k > 1 else 0.0,
                          server_cpu_cores=result["server_cpu_cores"], client_cpu_cores=result["client_cpu_cores"],
                          cores_per_shard=round(cores / k, 3)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2,3,4,5,6,7,8", help="the K to run, comma-separated (1 first)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window per K")
    parser.add_argument("--quick", action="store_true", help="smaller rings")
    args = parser.parse_args(argv)
    counts = [int(k) for k in args.shards.split(",")]
    if counts[0] != 1 or any(k < 1 for k in counts):
        parser.error(f"--shards: expected K >= 1 starting with 1 (the baseline), got {args.shards}")
    capacity = PROFILE.quick_capacity // 4 if args.quick else PROFILE.quick_capacity
    for row in records(counts, args.seconds, capacity):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
