"""Trainer micro-benchmarks (CPU): Q-loss forward+backward, ours vs SLM Lab's `calc_q_loss` in two forms;
ALLO step with one encoder call vs separate calls.

    .venv/bin/python -m bench.bench_trainers [--quick] [--threads N]

Each record: bench, case, metric, value, unit, baseline, baseline_value, speedup (= baseline / ours,
for times).  Timing: warm-up, then the median over many repeats of a timed block of calls, the
variants timed round-robin so background load hits them alike.

Threads: ``--threads 1`` (default) because that is how the DQN learner runs torch (client/learner.py
sets 1 thread; the actors and the server use the other cores), and because at these sizes more threads
make every variant slower on a machine whose cores are busy (SLM Lab's and ours alike).

Q-loss cases: the same MLP 4-64-64-2, the same batch tensors reused by every variant, MSE, no
importance weights.  Ours ("manual grad") is ``q_loss_manual_grad``, the path ``DQNTrainer`` uses by
default (``loss_strategy="manual"``): target network + n-step targets (DQN) or online-argmax targets
(Double DQN), gradient written by hand.  What bounds it at batch 256 (timed op by op, 1 thread): the
four 256x64x64 GEMMs any form of this loss needs (online and target forward of the hidden layer, dW
and dX of its backward; Double DQN adds a fifth for the online pass over s_boot) run near the core's
fp32 peak, and the seven thin GEMMs (4-wide input, 2-wide output) cost a few microseconds each in MKL:
GEMMs are most of a DQN call.  SLM Lab's two-forward form runs the same four big GEMMs, so twice its
speed at batch 256 leaves ours little time for its ~25 other ops, each a few microseconds of
dispatch.  "compiled manual grad"
(``DQNTrainer(loss_strategy="compiled")``) runs the same math compiled ahead by inductor
(client/trainers/compiled.py): the GEMMs stay MKL calls, the other ops fuse into a few C++ loops, and
the graph is called from C++ with a dict lookup for a guard.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable

import torch

from bench.baselines.slm_lab_qloss import SlmLabMLP, single_forward_qloss, two_forward_qloss
from replayd.client.trainers.allo import AlloEncoder, allo_loss
from replayd.client.trainers.compiled import CompiledFunction
from replayd.client.trainers.dqn import q_loss
from replayd.client.trainers.dqn_manual_grad import q_loss_grads_flat, q_loss_manual_grad
from replayd.client.trainers.q_network import QNetwork

OBS_DIM, N_ACTIONS = 4, 2  # CartPole
# Baselines, named for what they are (bench/baselines/slm_lab_qloss.py).
SLM_TWO_FORWARD = "SLM Lab calc_q_loss: two forwards"
SLM_ONE_FORWARD = "SLM Lab calc_q_loss: one forward of cat(s, s') (grad on)"


def _interleaved_median_us(fns: dict[str, Callable[[], object]], rounds: int, inner: int, warmup: int) -> dict:
    """Median over ``rounds`` of a timed block of ``inner`` calls, in us per call, per variant.

    Variants are timed round-robin inside each round, so background load hits all of them alike.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - t0) / inner * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def _cartpole_batch(B: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(B, OBS_DIM, generator=g)
    next_obs = torch.randn(B, OBS_DIM, generator=g)
    term = torch.rand(B, generator=g) < 0.05
    return {
        "obs": obs,
        "action": torch.randint(N_ACTIONS, (B,), generator=g),
        "reward": torch.ones(B),
        "next_obs": next_obs,
        "terminated": term,
        "truncated": torch.zeros(B, dtype=torch.bool),
        "n_step_return": torch.rand(B, generator=g) * 3,
        "bootstrap_discount": torch.where(term, 0.0, 0.99**3),
        "bootstrap_obs": next_obs,
    }


def _autograd_step(net: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    params = list(net.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        loss_fn().backward()

    return step


def _manual_step(online: QNetwork, target: QNetwork, batch: dict, double: bool,
                 compiled: CompiledFunction | None = None) -> Callable[[], None]:
    params = list(online.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        q_loss_manual_grad(online, target, batch, double=double, compiled=compiled)

    return step


def _qloss_fns(B: int) -> dict[str, Callable[[], None]]:
    batch = _cartpole_batch(B)
    torch.manual_seed(0)
    slm_net = SlmLabMLP(OBS_DIM, N_ACTIONS)
    online = QNetwork(OBS_DIM, N_ACTIONS)
    target = copy.deepcopy(online).requires_grad_(False)
    return {
        SLM_TWO_FORWARD: _autograd_step(slm_net, lambda: two_forward_qloss(slm_net, batch)),
        # Under no_grad this form cannot train; timed here with grad enabled.
        SLM_ONE_FORWARD: _autograd_step(slm_net, lambda: single_forward_qloss(slm_net, batch)),
        "ours dqn, autograd (q_loss)": _autograd_step(online, lambda: q_loss(online, target, batch)[0]),
        "ours double dqn, autograd (q_loss)": _autograd_step(
            online, lambda: q_loss(online, target, batch, double=True)[0]
        ),
        "ours dqn, manual grad (DQNTrainer default)": _manual_step(online, target, batch, False),
        "ours double dqn, manual grad (DQNTrainer default)": _manual_step(online, target, batch, True),
        # The same math compiled ahead by inductor (compiled in the warm-up calls: seconds per variant).
        "ours dqn, compiled manual grad (DQNTrainer(loss_strategy='compiled'))": _manual_step(
            online, target, batch, False, CompiledFunction(q_loss_grads_flat)
        ),
        "ours double dqn, compiled manual grad (DQNTrainer(loss_strategy='compiled'))": _manual_step(
            online, target, batch, True, CompiledFunction(q_loss_grads_flat)
        ),
    }


def bench_qloss(quick: bool, threads: int) -> list[dict]:
    """MSE, no importance weights; ours use a target net and n-step fields, SLM Lab's forms don't."""
    rounds, inner, warmup = (15, 20, 50) if quick else (61, 30, 200)
    records = []
    for B in (32, 256):
        times = _interleaved_median_us(_qloss_fns(B), rounds, inner, warmup)
        case = f"cartpole mlp 4-64-64-2, batch {B}, loss fwd+bwd, threads {threads}"
        for name, value in times.items():
            if name in (SLM_TWO_FORWARD, SLM_ONE_FORWARD):
                continue
            for base_name in (SLM_TWO_FORWARD, SLM_ONE_FORWARD):
                records.append(
                    {
                        "bench": "qloss_fwd_bwd",
                        "case": f"{name}; {case}",
                        "metric": "time_per_call",
                        "value": round(value, 1),
                        "unit": "us",
                        "baseline": base_name,
                        "baseline_value": round(times[base_name], 1),
                        "speedup": round(times[base_name] / value, 3),
                    }
                )
    return records


def _allo_fns(B: int, d: int) -> dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(0)
    s, s2, u1, u2 = (torch.rand(B, 2, generator=g) for _ in range(4))
    torch.manual_seed(0)
    enc = AlloEncoder(2, d)
    beta, b = torch.zeros(d, d), torch.tensor(1.0)
    return {
        "single": _autograd_step(enc, lambda: allo_loss(enc, s, s2, u1, u2, beta, b, single_call=True)[0]),
        "separate": _autograd_step(enc, lambda: allo_loss(enc, s, s2, u1, u2, beta, b, single_call=False)[0]),
    }


def bench_allo(quick: bool, threads: int) -> list[dict]:
    rounds, inner, warmup = (5, 3, 3) if quick else (21, 5, 10)
    d, records = 10, []
    for B in (256, 1024):
        times = _interleaved_median_us(_allo_fns(B, d), rounds, inner, warmup)
        records.append(
            {
                "bench": "allo_loss_fwd_bwd",
                "case": f"single encoder call on cat([s,s',u1,u2]); encoder 2-256-256-256-{d}, "
                f"batch {B} per part ({4 * B} rows), threads {threads}",
                "metric": "time_per_call",
                "value": round(times["single"], 1),
                "unit": "us",
                "baseline": "separate encoder calls (4)",
                "baseline_value": round(times["separate"], 1),
                "speedup": round(times["separate"] / times["single"], 3),
            }
        )
    return records


def run(quick: bool = False, threads: int = 1) -> list[dict]:
    torch.set_num_threads(threads)
    return bench_qloss(quick, threads) + bench_allo(quick, threads)


def main() -> None:
    p = argparse.ArgumentParser(description="trainer micro-benchmarks")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    for rec in run(args.quick, args.threads):
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
