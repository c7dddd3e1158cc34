"""Run each trainer on CUDA with synthetic batches and report steps/s as JSON lines.

    .venv/bin/python -m bench.gpu_check [--steps 300]

Without CUDA it prints one JSON line saying so and exits 0.  Batches are created on the device
(as the loader would hand them over), and timing syncs only at the start and end of each run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from client.trainers.allo import AlloTrainer
from client.trainers.dqn import DQNTrainer
from client.trainers.ppo import PPOTrainer


def _time_steps(step: Callable[[], object], steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    return steps / (time.perf_counter() - t0)


def _dqn_batch(B: int, obs_dim: int, n_actions: int, dev: torch.device, weighted: bool) -> dict[str, torch.Tensor]:
    batch = {
        "obs": torch.randn(B, obs_dim, device=dev),
        "action": torch.randint(n_actions, (B,), device=dev),
        "n_step_return": torch.randn(B, device=dev),
        "bootstrap_discount": torch.full((B,), 0.99**3, device=dev),
        "bootstrap_obs": torch.randn(B, obs_dim, device=dev),
    }
    if weighted:
        batch["weight"] = torch.rand(B, device=dev)
    return batch


def run(steps: int = 300, warmup: int = 30) -> list[dict]:
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    records = []

    for B in (32, 256, 4096):
        for double in (False, True):
            tr = DQNTrainer(4, 2, double=double, device=dev)
            batch = _dqn_batch(B, 4, 2, dev, weighted=True)
            sps = _time_steps(lambda tr=tr, batch=batch: tr.step(batch), steps, warmup, dev)
            records.append({"trainer": "double_dqn" if double else "dqn", "batch": B, "steps_per_s": round(sps, 1)})

    for B in (256, 1024):
        for single in (True, False):
            tr = AlloTrainer(2, 10, device=dev, single_call=single)
            pairs = {"obs": torch.rand(B, 2, device=dev), "future_obs": torch.rand(B, 2, device=dev)}
            u1, u2 = torch.rand(B, 2, device=dev), torch.rand(B, 2, device=dev)
            sps = _time_steps(lambda tr=tr, p=pairs, a=u1, b=u2: tr.step(p, a, b), steps, warmup, dev)
            records.append({"trainer": "allo", "batch": B, "single_call": single, "steps_per_s": round(sps, 1)})

    for B in (256, 2048):
        tr = PPOTrainer(8, 4, device=dev)
        mb = {
            "obs": torch.randn(B, 8, device=dev),
            "action": torch.randint(4, (B,), device=dev),
            "log_prob": torch.full((B,), -1.386, device=dev),
            "value": torch.randn(B, device=dev),
            "advantage": torch.randn(B, device=dev),
            "return": torch.randn(B, device=dev),
        }
        sps = _time_steps(lambda tr=tr, mb=mb: tr.step(mb), steps, warmup, dev)
        records.append({"trainer": "ppo", "batch": B, "steps_per_s": round(sps, 1)})

    for r in records:
        r["device"] = name
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"cuda_available": False, "message": "CUDA not available; nothing to check"}))
        return 0
    for rec in run(args.steps):
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
