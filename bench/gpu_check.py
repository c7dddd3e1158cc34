"""The loader and each trainer on CUDA: steps/s and batches/s as JSON lines.

    .venv/bin/python -m bench.gpu_check [--steps 300] [--device cuda:0]

1. Trainers on synthetic batches created on the device (as the loader hands them over): DQN and Double
   DQN (batch 32 / 256 / 4096), ALLO with one encoder call and with four (256 / 1024 rows per part) beside
   the device's default, PPO (256 / 2048). Timing syncs only at the start and end of each run.
2. The loader against an in-process server on loopback: cartpole (batch 256) and atari (batch 32) sample
   streams landed on the device (pinned staging, non-blocking copies), batches/s and MB/s; and a DQN
   learner fed by the loader (stream -> Loader -> DQNTrainer.step), steps/s.

Without CUDA (and no `--device`) it prints one JSON line saying so and exits 0. `--device cpu` runs the
same checks on the CPU (the test suite does, with few steps, so the script cannot rot unseen).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from replayd.client.loader import Loader
from replayd.client.replay_client import ReplayClient
from replayd.client.trainers.allo import AlloTrainer, default_single_call
from replayd.client.trainers.dqn import DQNTrainer
from replayd.client.trainers.ppo import PPOTrainer
from replayd.server.server import ReplayServer
from replayd.wire.components import Transitions

N_ACTIONS = 2  # the DQN learner's CartPole-sized network
LOADER_PROFILES = {  # name: (schema, batch size, capacity)
    "cartpole": ({"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}, 256, 50_000),
    "atari": ({"obs": ("uint8", (84, 84, 4)), "action": ("int64", ()), "reward": ("float32", ())}, 32, 2_000),
}


def _sync(device: torch.device) -> None:
    """Waits for the work queued on an accelerator (CPU work is done when its call returns)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _steps_per_s(step: Callable[[], object], steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return steps / (time.perf_counter() - t0)


def _dqn_batch(B: int, obs_dim: int, n_actions: int, dev: torch.device) -> dict[str, torch.Tensor]:
    return {
        "obs": torch.randn(B, obs_dim, device=dev),
        "action": torch.randint(n_actions, (B,), device=dev),
        "n_step_return": torch.randn(B, device=dev),
        "bootstrap_discount": torch.full((B,), 0.99**3, device=dev),
        "bootstrap_obs": torch.randn(B, obs_dim, device=dev),
        "weight": torch.rand(B, device=dev),
    }


def trainer_records(dev: torch.device, steps: int, warmup: int) -> list[dict]:
    records = []
    for B in (32, 256, 4096):
        for double in (False, True):
            dqn = DQNTrainer(4, 2, double=double, device=dev)
            batch = _dqn_batch(B, 4, 2, dev)
            sps = _steps_per_s(lambda t=dqn, b=batch: t.step(b), steps, warmup, dev)
            records.append({"trainer": "double_dqn" if double else "dqn", "batch": B, "steps_per_s": round(sps, 1)})

    for B in (256, 1024):
        for single in (True, False):
            allo = AlloTrainer(2, 10, device=dev, single_call=single)
            pairs = {"obs": torch.rand(B, 2, device=dev), "future_obs": torch.rand(B, 2, device=dev)}
            u1, u2 = torch.rand(B, 2, device=dev), torch.rand(B, 2, device=dev)
            sps = _steps_per_s(lambda t=allo, p=pairs, a=u1, b=u2: t.step(p, a, b), steps, warmup, dev)
            records.append({"trainer": "allo", "batch": B, "single_call": single,
                            "default_for_device": single == default_single_call(dev), "steps_per_s": round(sps, 1)})

    for B in (256, 2048):
        ppo = PPOTrainer(8, 4, device=dev)
        minibatch = {
            "obs": torch.randn(B, 8, device=dev),
            "action": torch.randint(4, (B,), device=dev),
            "log_prob": torch.full((B,), -1.386, device=dev),
            "value": torch.randn(B, device=dev),
            "advantage": torch.randn(B, device=dev),
            "return": torch.randn(B, device=dev),
        }
        sps = _steps_per_s(lambda t=ppo, m=minibatch: t.step(m), steps, warmup, dev)
        records.append({"trainer": "ppo", "batch": B, "steps_per_s": round(sps, 1)})
    return records


def _fill(client: ReplayClient, name: str, schema: dict, capacity: int, rng: np.random.Generator) -> None:
    """Episodes of 100-200 steps of random content, about `capacity` steps in all."""
    episodes, terminated, steps = [], [], 0
    while steps < capacity - 400:
        length = int(rng.integers(100, 200))
        episode = {}
        for field, (dtype, shape) in schema.items():
            rows = length + 1 if field == "obs" else length
            if field == "action":
                values = rng.integers(0, N_ACTIONS, (rows, *shape))
            elif np.dtype(dtype).kind in "iu":
                values = rng.integers(0, 256, (rows, *shape))
            else:
                values = rng.standard_normal((rows, *shape))
            episode[field] = values.astype(dtype)
        episodes.append(episode)
        terminated.append(bool(rng.random() < 0.5))
        steps += length + 1
    client.insert_episodes(name, episodes, terminated)


def _timed_batches(loader: Iterator[dict[str, torch.Tensor]], batches: int, warmup: int, dev: torch.device
                   ) -> tuple[float, int, torch.device]:
    """(seconds for `batches` batches after `warmup`, bytes of the last batch, the device it landed on).
    The loader's prefetched batches (up to 4) are ready when the clock starts: about 1 % in 300."""
    for _ in range(warmup):
        batch = next(loader)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(batches):
        batch = next(loader)
    _sync(dev)
    elapsed = time.perf_counter() - t0
    landed = {t.device for t in batch.values()}
    if len(landed) != 1:
        raise RuntimeError(f"the loader landed one batch on several devices: {landed}")
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in batch.values()}  # an aliased field once
    return elapsed, sum(unique.values()), landed.pop()


def _trained(dqn: DQNTrainer, batches: Loader) -> Iterator[dict[str, torch.Tensor]]:
    """Each batch after one trainer step on it."""
    for batch in batches:
        dqn.step(batch)
        yield batch


def loader_records(dev: torch.device, batches: int, warmup: int, instance: str | None = None) -> list[dict]:
    records = []
    rng = np.random.default_rng(0)
    server = ReplayServer("127.0.0.1:0", instance=instance, max_message_bytes=64 * 2**20).start()
    try:
        with ReplayClient(server.address, timeout=120) as client:
            for name, (schema, batch_size, capacity) in LOADER_PROFILES.items():
                client.create_buffer(name, capacity, schema)
                _fill(client, name, schema, capacity, rng)
                loader = Loader(client.sample_stream(name, batch_size, Transitions(), num_batches=warmup + batches),
                                device=dev)
                try:
                    elapsed, nbytes, landed = _timed_batches(iter(loader), batches, warmup, dev)
                finally:
                    loader.close()
                records.append({"part": "loader", "profile": name, "batch": batch_size, "landed_on": str(landed),
                                "batches_per_s": round(batches / elapsed, 1),
                                "MB_per_s": round(batches * nbytes / elapsed / 1e6, 1)})

            # A DQN learner as the demo runs one: the stream, the loader, one trainer step per batch.
            schema, batch_size, _ = LOADER_PROFILES["cartpole"]
            dqn = DQNTrainer(4, N_ACTIONS, double=True, device=dev)
            loader = Loader(client.sample_stream("cartpole", batch_size, Transitions(n_step=3),
                                                 num_batches=warmup + batches), device=dev)
            try:
                elapsed, _, _ = _timed_batches(_trained(dqn, loader), batches, warmup, dev)
            finally:
                loader.close()
            records.append({"part": "dqn_learner", "profile": "cartpole", "batch": batch_size, "n_step": 3,
                            "steps_per_s": round(batches / elapsed, 1)})
    finally:
        server.stop(grace=0)
    return records


def run(steps: int = 300, warmup: int = 30, device: str = "cuda", instance: str | None = None) -> list[dict]:
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    records = trainer_records(dev, steps, warmup) + loader_records(dev, steps, warmup, instance)
    for record in records:
        record["device"] = name
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    args = parser.parse_args()
    if args.device is None:
        if not torch.cuda.is_available():
            print(json.dumps({"cuda_available": False, "message": "CUDA not available; nothing to check"}))
            return 0
        args.device = "cuda"
    for record in run(args.steps, device=args.device):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
