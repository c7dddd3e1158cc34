"""Sampling through ShardedReplayClient.

1. One shard: the sharded client's stream and unary sample against the plain ReplayClient's on the same server
   (cartpole transitions, batch 256), in alternating rounds (medians). Target: the sharded path costs at most
   10 % (speedup >= 0.9).
2. The client's own work per merged batch for K = 1..8 shards, without network (median µs).
3. K = 1, 2, 3 shards on this machine, K sampling processes (bench/shards_scaling.py): aggregate transitions/s
   and the cores each server and client process used. Where the machine has fewer cores than processes, they
   share the cores and the aggregate cannot grow with K; the cores per shard say what K shards need where
   cores are free.

    .venv/bin/python -m bench.bench_shards [--quick]      # JSON lines
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from bench.bench_replay import ServerProcess
from bench.shards_scaling import BATCH, PROFILE, fill, record, records
from bench.timing import time_calls
from replayd.client.replay_client import ReplayClient
from replayd.client.shard_sampling import Holder, ShardedBatchStream, Split
from replayd.client.shard_set import Shard
from replayd.client.sharded import ShardedReplayClient
from replayd.wire.components import Transitions


def rate(take: Callable[[], object], seconds: float) -> float:
    """Transitions/s of `take()` (one batch each) over `seconds`, after one untimed call."""
    take()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        take()
        count += 1
    return count * BATCH / (time.perf_counter() - started)


def streamed(client: ReplayClient | ShardedReplayClient, seconds: float) -> float:
    """Transitions/s of a stream opened for this round alone: a stream left open between rounds would have its
    window of batches filled while the other client's round runs."""
    stream = client.sample_stream(PROFILE.name, BATCH, Transitions())
    try:
        return rate(stream.__next__, seconds)
    finally:
        stream.close()


def alternating(rounds: int, rates: list[Callable[[], float]]) -> list[float]:
    """Each measurement's median over `rounds` rounds, the measurements in turn within each round."""
    measured: list[list[float]] = [[] for _ in rates]
    for _ in range(rounds):
        for k, measure in enumerate(rates):
            measured[k].append(measure())
    return [statistics.median(m) for m in measured]


def one_shard_overhead(quick: bool) -> list[dict]:
    rounds, seconds = (5, 0.5) if quick else (9, 1.5)
    server = ServerProcess()
    try:
        with ReplayClient(server.address, timeout=600) as plain, \
                ShardedReplayClient([server.address], timeout=600) as sharded:
            sharded.wait_ready(60)
            fill(sharded, PROFILE.quick_capacity // 4 if quick else PROFILE.quick_capacity)
            clients = (plain, sharded)
            stream_rates = alternating(rounds, [lambda c=c: streamed(c, seconds) for c in clients])
            unary_rates = alternating(rounds, [lambda c=c: rate(lambda: c.sample(PROFILE.name, BATCH, Transitions()),
                                                                seconds) for c in clients])
    finally:
        server.stop()
    return [record(f"one shard: ShardedReplayClient.{how} vs ReplayClient.{how}, cartpole transitions batch {BATCH} "
                   "(target: speedup >= 0.9)", "transitions_per_s", ours, "transitions/s",
                   f"ReplayClient.{how} on the same server", base, ours / base)
            for how, (base, ours) in (("sample_stream", stream_rates), ("sample", unary_rates))]


class _Repeating:
    """A shard's stream that hands out one prepared batch forever (no network): what the merge costs alone."""

    def __init__(self, batch: dict) -> None:
        self.batch = batch

    def __next__(self) -> dict:
        return self.batch

    def close(self) -> None:
        return None


def merge_cost(quick: bool) -> list[dict]:
    """The client's own work per merged batch (split, slices, keys, merge, order) over K = 1..8 shards of equal
    size, each handing out the same decoded cartpole batch of 256 transitions: what a sampling process spends
    beyond receiving and decoding its shards' batches, which grows with K."""
    server = ServerProcess()
    try:
        with ShardedReplayClient([server.address], timeout=600) as client:
            client.wait_ready(60)
            fill(client, PROFILE.quick_capacity // 8)
            batch = client.sample(PROFILE.name, BATCH, Transitions(), include_keys=True)
    finally:
        server.stop()
    out, calls = [], 300 if quick else 3000
    for k in (1, 2, 3, 4, 8):
        holders = [Holder(Shard(index, f"shard{index}:1", client=None), {"counters": {}, "sampleable_steps": 1000})
                   for index in range(k)]
        stream = ShardedBatchStream(lambda holders=holders: Split(holders), lambda shard: _Repeating(batch), None,
                                    BATCH, 0, np.random.default_rng(0), 0.0)
        median_us, _ = time_calls({"merge": stream.__next__}, calls)["merge"]
        out.append(record(f"client work per merged batch, K={k} shards, cartpole transitions batch {BATCH} (keys "
                          "included, no network)", "merge_us_per_batch", median_us, "us"))
    return out


def run(quick: bool = False) -> list[dict]:
    capacity = PROFILE.quick_capacity // 4 if quick else PROFILE.quick_capacity // 2
    return one_shard_overhead(quick) + merge_cost(quick) + records([1, 2, 3], 3.0 if quick else 6.0, capacity)


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(json.dumps(row), flush=True)
