"""Prioritized replay on 1,000,000 stored steps: sample 256 + update 256 priorities, medians in µs.

    .venv/bin/python -m bench.bench_prioritized [--quick]      # JSON lines on stdout

Cases: the sum tree alone (descent, batch update) next to a plain-Python per-item sum tree, same run;
and the whole buffer path (PrioritizedSampler.draw with weights + update_priorities with staleness
checks) that a Sample / UpdatePriorities RPC runs under the buffer's lock.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np

from bench.baselines.python_sum_tree import PythonSumTree
from service.buffers.episodic import EpisodicBuffer, Spans
from service.samplers.prioritized import PrioritizedSampler
from service.samplers.sum_tree import SumTree, tree_size
from service.schema import Field

STEPS, BATCH = 1_000_000, 256


def record(case: str, metric: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0) -> dict:
    return {"bench": "prioritized", "case": case, "metric": metric, "value": value, "unit": unit,
            "baseline": baseline, "baseline_value": baseline_value,
            "speedup": baseline_value / value if baseline_value else 0.0}


def median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def run(quick: bool = False) -> list[dict]:
    repeats = 50 if quick else 500
    rng = np.random.default_rng(0)
    priorities = rng.random(STEPS)
    tree = SumTree(np.zeros(tree_size(STEPS)), np.zeros(tree_size(STEPS)))
    tree.clear()
    tree.update(np.arange(STEPS), priorities)
    reference = PythonSumTree(1 << (STEPS - 1).bit_length())
    for i, p in enumerate(priorities.tolist()):
        reference.update(i, p)
    leaves, values = rng.integers(0, STEPS, BATCH), rng.random(BATCH)

    ours_sample = median_us(lambda: tree.find_prefix(rng.random(BATCH) * tree.total), repeats)
    ours_update = median_us(lambda: tree.update(leaves, values), repeats)
    base_sample = median_us(lambda: reference.sample(BATCH), max(5, repeats // 10))
    pairs = list(zip(leaves.tolist(), values.tolist(), strict=True))
    base_update = median_us(lambda: [reference.update(i, v) for i, v in pairs], max(5, repeats // 10))
    ours_both = median_us(lambda: (tree.find_prefix(rng.random(BATCH) * tree.total), tree.update(leaves, values)),
                          repeats)
    records = [
        record("sum_tree_1M", "sample_256", ours_sample, "us", "python_sum_tree", base_sample),
        record("sum_tree_1M", "update_256", ours_update, "us", "python_sum_tree", base_update),
        record("sum_tree_1M", "sample_plus_update_256", ours_both, "us", "python_sum_tree", base_sample + base_update),
    ]

    fields = [Field("obs", "float32", (4,), observation=True), Field("reward", "float32")]
    buffer = EpisodicBuffer("bench_per", f"bench{os.getpid()}", fields, STEPS + 1000, sampler=PrioritizedSampler(0.6))
    try:
        lengths = np.full(STEPS // 1000, 999)
        columns = {"obs": np.zeros((STEPS, 4), np.float32), "reward": np.zeros(STEPS, np.float32)}
        buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(lengths.size), np.ones(lengths.size, bool)))
        sampler = buffer.sampler
        keys = sampler.draw(buffer, BATCH, rng, 0.4).positions
        new = rng.random(BATCH)

        def step() -> None:
            with buffer.lock:
                sampler.draw(buffer, BATCH, rng, 0.4)
                sampler.update_priorities(buffer, keys, new)

        records.append(record("buffer_1M", "draw_plus_update_priorities_256", median_us(step, repeats), "us",
                              "python_sum_tree", base_sample + base_update))
    finally:
        buffer.close()
    return records


if __name__ == "__main__":
    for line in run(quick="--quick" in sys.argv):
        print(json.dumps(line))
