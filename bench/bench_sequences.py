"""Sequence batches (R2D2-style: B = 32 sequences of burn_in 40 + length 80 cartpole rows) on rings of 1M and
10M steps, and hindsight batches beside plain transition batches of the same size.

Sequences, per batch, in one process (the sampler, not the network):
- ours: EpisodicBuffer.sample with the sequences mode (each start's episode bound precomputed at insert);
- "np.searchsorted over episode starts": the way most libraries find a start's episode, over a flat storage
  of the same episodes (bench/baselines/searchsorted_sequences.py);
- TorchRL's SliceSampler on a LazyTensorStorage of the same episodes, in both its forms: cache_values=False
  (its default: trajectory boundaries derived at every call, as a buffer being written to needs) and
  cache_values=True (an index valid only while nothing is inserted).
Targets: the 10M figure within 1.2x of the 1M one; at 10M at least 100x the default TorchRL form and 10x the
cached one. Hindsight (future strategy) batches at most 1.5x the time of transition batches of their size.
"""

from __future__ import annotations

import os
import time

import numpy as np

from bench.baselines.searchsorted_sequences import SearchsortedSequences
from bench.timing import time_calls
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.modes.hindsight import HindsightMode
from replayd.server.modes.sequences import SequencesMode
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.schema import Field

BATCH, BURN_IN, LENGTH = 32, 40, 80
STEPS = BURN_IN + LENGTH
FIELDS = [Field("obs", "float32", (4,), observation=True), Field("action", "int64"), Field("reward", "float32")]


def record(case: str, metric: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0,
           speedup: float = 0.0) -> dict:
    return {"bench": "sequences", "case": case, "metric": metric, "value": float(value), "unit": unit,
            "baseline": baseline, "baseline_value": float(baseline_value), "speedup": float(speedup)}


def episodes(rows: int, rng: np.random.Generator) -> np.ndarray:
    """CartPole-like episode lengths (steps) whose rows (steps + 1 each) fill `rows`."""
    lengths = rng.integers(10, 500, rows // 250 + 10)
    lengths = lengths[:int(np.searchsorted(np.cumsum(lengths + 1), rows))]
    lengths[-1] += rows - int((lengths + 1).sum())  # the last one takes up the rest
    return lengths


def filled_ring(name: str, rows: int, lengths: np.ndarray, columns: dict[str, np.ndarray]) -> EpisodicBuffer:
    buffer = EpisodicBuffer(name, f"bench{os.getpid()}", FIELDS, rows + 1)
    spans = Spans.whole_episodes(lengths, np.arange(lengths.size), np.ones(lengths.size, bool))
    buffer.insert(columns, spans)
    return buffer


def torchrl_buffers(columns: dict[str, np.ndarray], lengths: np.ndarray) -> dict:
    """TorchRL replay buffers over the same episodes (steps only: TorchRL keeps no final observation row)."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import SliceSampler

    steps = np.ones(columns["obs"].shape[0], bool)
    steps[np.cumsum(lengths + 1) - 1] = False  # drop each episode's final-observation row
    episode = np.repeat(np.arange(lengths.size), lengths)
    data = TensorDict({"obs": torch.from_numpy(columns["obs"][steps]),
                       "action": torch.from_numpy(columns["action"][steps]),
                       "reward": torch.from_numpy(columns["reward"][steps]),
                       "episode": torch.from_numpy(episode)}, batch_size=[int(steps.sum())])
    buffers = {}
    for cached in (False, True):
        sampler = SliceSampler(slice_len=STEPS, traj_key="episode", cache_values=cached, strict_length=False)
        buffer = ReplayBuffer(storage=LazyTensorStorage(data.shape[0]), sampler=sampler, batch_size=BATCH * STEPS)
        buffer.extend(data)
        buffers[cached] = buffer
    return buffers


def sequence_records(size: int, calls: int, rng: np.random.Generator) -> tuple[list[dict], float]:
    lengths = episodes(size, rng)
    columns = {"obs": rng.normal(size=(size, 4)).astype(np.float32), "action": rng.integers(0, 2, size),
               "reward": np.ones(size, np.float32)}
    buffer = filled_ring(f"seq{size}", size, lengths, columns)
    try:
        flat = SearchsortedSequences(columns, lengths)
        torchrl = torchrl_buffers(columns, lengths)
        del columns
        mode, sample_rng = SequencesMode(LENGTH, burn_in=BURN_IN), np.random.default_rng(1)
        timed = time_calls({"ours": lambda: buffer.sample(BATCH, mode, sample_rng),
                            "searchsorted": lambda: flat.sample(BATCH, STEPS, sample_rng),
                            "torchrl": lambda: torchrl[False].sample(),
                            "torchrl_cached": lambda: torchrl[True].sample()},
                           calls=calls, warmup=3, rounds=5)
    finally:
        buffer.close()
    ours = timed["ours"][0]
    case = f"B={BATCH} sequences of {BURN_IN}+{LENGTH} cartpole rows, {size:,}-step ring"
    records = [record(case, "time per batch", ours, "us", baseline, timed[key][0], timed[key][0] / ours)
               for key, baseline in (("searchsorted", "np.searchsorted over episode starts"),
                                     ("torchrl", "TorchRL SliceSampler (cache_values=False)"),
                                     ("torchrl_cached", "TorchRL SliceSampler (cache_values=True)"))]
    return records, ours


def hindsight_records(calls: int, rng: np.random.Generator) -> list[dict]:
    """Bit-flipping-sized goal-conditioned rows (15 bits per observation, achieved and desired goal)."""
    fields = [Field(name, "float32", (15,), observation=True) for name in ("obs", "achieved", "goal")]
    fields += [Field("action", "int64"), Field("reward", "float32")]
    buffer = EpisodicBuffer("her", f"bench{os.getpid()}", fields, 1_000_001, goal_fields=("achieved", "goal"))
    try:
        lengths = np.full(1_000_000 // 16, 15)
        rows = int((lengths + 1).sum())
        columns = {f.name: rng.random((rows, *f.shape)).astype(f.dtype) for f in fields}
        buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(lengths.size), np.ones(lengths.size, bool)))
        sample_rng = np.random.default_rng(2)
        timed = time_calls({"hindsight": lambda: buffer.sample(256, HindsightMode("future"), sample_rng),
                            "transitions": lambda: buffer.sample(256, TransitionsMode(), sample_rng)},
                           calls=calls)
    finally:
        buffer.close()
    ours, plain = timed["hindsight"][0], timed["transitions"][0]
    return [record("B=256 hindsight (future, 0.8) transitions, 15-bit goals, 1M steps (target <= 1.5x)",
                   "time per batch", ours, "us", "plain transitions of the same size", plain, plain / ours)]


def run(quick: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    sizes = (100_000, 1_000_000) if quick else (1_000_000, 10_000_000)
    records, per_size = [], []
    for size in sizes:
        start = time.perf_counter()
        found, ours = sequence_records(size, 10 if quick else 60, rng)
        records += found
        per_size.append(ours)
        print(f"  sequences on {size} steps: {time.perf_counter() - start:.0f} s", flush=True)
    records.append(record(f"B={BATCH} sequences: time on the {sizes[1]:,}-step ring over the {sizes[0]:,}-step "
                          "one (target <= 1.2)", "ratio", per_size[1] / per_size[0], "x"))
    records += hindsight_records(200 if quick else 2000, rng)
    return records
