"""Shared memory as a feature: local-reader sampling beside gRPC, and sampling with K sample workers.

1. Per profile, a LocalReader in this process samples the server's ring directly (no network, no
   serialization) beside a gRPC sample stream from the same server, items/s, in alternating rounds (medians).
   Target: local at least 10x gRPC for cartpole batch 256.
2. Two sampling client processes stream cartpole batches for a few seconds against `replayd serve
   --sample-workers K`, K = 0, 1, 2: total transitions/s. Target on 2 cores: K = 2 at least 1.6x K = 0.

    .venv/bin/python -m bench.bench_shared_memory [--quick]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np
import psutil

from bench import subprocesses
from bench.bench_replay import PROFILES, Profile, ServerProcess, insert_batches
from replayd.client.local_reader import LocalReader
from replayd.client.replay_client import ReplayClient, spans_requests


def record(case: str, metric: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0,
           speedup: float = 0.0) -> dict:
    return {"bench": "shared_memory", "case": case, "metric": metric, "value": value, "unit": unit,
            "baseline": baseline, "baseline_value": baseline_value, "speedup": speedup}


def fill(client: ReplayClient, profile: Profile, capacity: int) -> None:
    client.create_buffer(profile.name, capacity, profile.schema)
    batches, _, _ = insert_batches(profile, 20_000 if profile.name == "cartpole" else 2_000, int(capacity * 1.2),
                                   np.random.default_rng(0))
    for spans in batches:
        client.insert(spans_requests(profile.name, spans, client.max_request_bytes), timeout=600)


def items_per_second(stream, batch_size: int, seconds: float) -> float:
    next(stream)  # the first batch pays for connection and schema setup (or waits out a pause between rounds)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        next(stream)
        count += 1
    return count * batch_size / (time.perf_counter() - started)


def local_versus_grpc(quick: bool) -> list[dict]:
    """Local reader and gRPC stream, alternating in rounds (median of each), so that background load
    hits both alike."""
    out = []
    rounds, seconds = (5, 0.5) if quick else (9, 1.5)
    server = ServerProcess()
    try:
        client = ReplayClient(server.address, timeout=600)
        client.wait_ready(timeout=60)
        for profile in PROFILES:
            capacity = profile.quick_capacity if quick else profile.capacity // 4
            fill(client, profile, capacity)
            with LocalReader(client, profile.name) as reader:
                local_stream = reader.sample_stream(profile.batch)
                remote_stream = client.sample_stream(profile.name, profile.batch)
                local, remote = [], []
                for _ in range(rounds):
                    local.append(items_per_second(local_stream, profile.batch, seconds))
                    remote.append(items_per_second(remote_stream, profile.batch, seconds))
                remote_stream.close()
            local_rate, remote_rate = statistics.median(local), statistics.median(remote)
            target = " (target >= 10x)" if profile.name == "cartpole" else ""
            out.append(record(f"{profile.name} transitions batch={profile.batch}{target}", "items_per_s", local_rate,
                              "items/s", "gRPC sample stream from the same server", remote_rate,
                              local_rate / remote_rate))
            client.delete_buffer(profile.name)
        client.close()
    finally:
        server.stop()
    return out


def _sampling_client(address: str, seconds: float, results: mp.Queue) -> None:
    client = ReplayClient(address, timeout=120)
    stream = client.sample_stream("cartpole", 256)
    cpu = time.process_time()  # this process's CPU, gRPC's threads included
    rate = items_per_second(stream, 256, seconds)
    results.put((rate, time.process_time() - cpu))
    stream.close()
    client.close()


def workers_scaling(quick: bool) -> list[dict]:
    """Two sampling client processes against K = 0, 1, 2 sample workers. Also the CPU each side spends per
    batch (K = 0): with both cores busy, K = 2 can reach at most 2 cores / (server + client CPU per batch),
    which bounds the K = 2 / K = 0 ratio whatever the workers do."""
    seconds = 3.0 if quick else 8.0
    profile = PROFILES[0]
    totals, cpu_per_batch = {}, {}
    for workers in (0, 1, 2):
        server = ServerProcess("--sample-workers", str(workers))
        try:
            client = ReplayClient(server.address, timeout=600)
            client.wait_ready(timeout=60)
            fill(client, profile, profile.quick_capacity)
            server_process = psutil.Process(server.process.pid)
            context = mp.get_context("spawn")
            results = context.Queue()
            clients = [context.Process(target=_sampling_client, args=(server.address, seconds, results))
                       for _ in range(2)]
            server_cpu = subprocesses.cpu_seconds(server_process)
            for process in clients:
                process.start()
            reports = [results.get(timeout=120) for _ in clients]
            server_cpu = subprocesses.cpu_seconds(server_process) - server_cpu
            for process in clients:
                process.join()
            totals[workers] = sum(rate for rate, _ in reports)
            batches = totals[workers] * seconds / 256  # the measured windows; setup batches are not counted
            cpu_per_batch[workers] = (server_cpu / batches, sum(cpu for _, cpu in reports) / batches)
            client.close()
        finally:
            server.stop()
    case = "cartpole batch 256, 2 sampling clients"
    server_us, client_us = (1e6 * seconds_per_batch for seconds_per_batch in cpu_per_batch[0])
    ceiling = 2 * 256 / ((server_us + client_us) * 1e-6)  # transitions/s with both cores busy
    return [
        *(record(f"{case}, {k} sample workers" + (" (target >= 1.6x)" if k == 2 else ""), "transitions_per_s",
                 totals[k], "transitions/s", "0 sample workers", totals[0], totals[k] / totals[0])
          for k in (0, 1, 2)),
        record(f"{case}, 0 sample workers: CPU per batch, server (clients: {client_us:.0f} us)",
               "server_cpu_us_per_batch", server_us, "us"),
        record(f"{case}: ceiling on 2 cores = 2 cores / ({server_us:.0f} + {client_us:.0f} us CPU per batch)",
               "transitions_per_s", ceiling, "transitions/s", "0 sample workers", totals[0], ceiling / totals[0]),
    ]


def run(quick: bool = False) -> list[dict]:
    return local_versus_grpc(quick) + workers_scaling(quick)


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(json.dumps(row), flush=True)
