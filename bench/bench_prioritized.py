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

import numpy as np

from bench.baselines.python_sum_tree import PythonSumTree
from bench.timing import time_calls
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.server.samplers.sum_tree import SumTree, tree_size
from replayd.server.schema import Field

PYTHON_SUM_TREE = "per-item sum tree in plain Python (the usual PER reference)"
STEPS, BATCH = 1_000_000, 256


def record(case: str, metric: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0) -> dict:
    return {"bench": "prioritized", "case": case, "metric": metric, "value": value, "unit": unit,
            "baseline": baseline, "baseline_value": baseline_value,
            "speedup": baseline_value / value if baseline_value else 0.0}


def run(quick: bool = False) -> list[dict]:
    calls = 50 if quick else 500
    base_calls = max(5, calls // 10)
    rng = np.random.default_rng(0)
    priorities = rng.random(STEPS)
    tree = SumTree(np.zeros(tree_size(STEPS)), np.zeros(tree_size(STEPS)))
    tree.clear()
    tree.update(np.arange(STEPS), priorities)
    reference = PythonSumTree(1 << (STEPS - 1).bit_length())
    for i, p in enumerate(priorities.tolist()):
        reference.update(i, p)

    # Updates go to fresh random leaves each call (cold paths, as for keys sampled a while ago); the combined
    # case updates the leaves it just drew, as a learner does with the batch it trained on. Round-robin.
    def ours_update() -> None:
        tree.update(rng.integers(0, STEPS, BATCH), rng.random(BATCH))

    def ours_both() -> None:
        tree.update(tree.find_prefix(rng.random(BATCH) * tree.total), rng.random(BATCH))

    def base_update() -> None:
        for i, v in zip(rng.integers(0, STEPS, BATCH).tolist(), rng.random(BATCH).tolist(), strict=True):
            reference.update(i, v)

    def base_both() -> None:
        for i, v in zip(reference.sample(BATCH), rng.random(BATCH).tolist(), strict=True):
            reference.update(i, v)

    ours = time_calls({"sample": lambda: tree.find_prefix(rng.random(BATCH) * tree.total), "update": ours_update,
                       "both": ours_both}, calls)
    base = time_calls({"sample": lambda: reference.sample(BATCH), "update": base_update, "both": base_both},
                      base_calls, warmup=2, rounds=min(10, base_calls))
    records = [
        record("sum_tree_1M", "sample_256", ours["sample"][0], "us", PYTHON_SUM_TREE, base["sample"][0]),
        record("sum_tree_1M", "update_256", ours["update"][0], "us", PYTHON_SUM_TREE, base["update"][0]),
        record("sum_tree_1M (target < 200 us)", "sample_then_update_the_drawn_256", ours["both"][0], "us",
               PYTHON_SUM_TREE, base["both"][0]),
    ]

    fields = [Field("obs", "float32", (4,), observation=True), Field("reward", "float32")]
    buffer = EpisodicBuffer("bench_per", f"bench{os.getpid()}", fields, STEPS + 1000, sampler=PrioritizedSampler(0.6))
    try:
        lengths = np.full(STEPS // 1000, 999)
        columns = {"obs": np.zeros((STEPS, 4), np.float32), "reward": np.zeros(STEPS, np.float32)}
        buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(lengths.size), np.ones(lengths.size, bool)))
        sampler = buffer.sampler

        def step() -> None:
            with buffer.lock:
                keys = sampler.draw(buffer.ring, BATCH, rng, 0.4).positions
                sampler.update_priorities(buffer.ring, keys, rng.random(BATCH))

        step_us = time_calls({"step": step}, calls)["step"][0]
        records.append(record("buffer_1M", "draw_then_update_the_drawn_256", step_us, "us", PYTHON_SUM_TREE,
                              base["both"][0]))
    finally:
        buffer.close()
    return records


if __name__ == "__main__":
    for line in run(quick="--quick" in sys.argv):
        print(json.dumps(line))
