"""Generalized Advantage Estimation over a (T steps, N envs) rollout, pure numpy.

    V_next(t) = final_value[t]   if truncated[t]          (the episode was cut, not ended: bootstrap)
              = value[t + 1]     if t < T - 1
              = bootstrap[env]   if t = T - 1              (V(s_T), the observation after the rollout)
    δ_t = r_t + γ · V_next(t) · (1 − terminated_t) − V_t
    A_t = δ_t + γλ · (1 − done_t) · A_{t+1},   done = terminated | truncated,   A_T = 0
    returns = A + V

Truncation is handled exactly (as Stable-Baselines3 and TorchRL do): a truncated step bootstraps
from the value of its final observation instead of being treated as a termination.

The backward recurrence A_t = δ_t + c_t · A_{t+1} is a scan of affine maps. A Python loop over T
time steps costs T × (a few numpy calls), which dominates for long rollouts with few envs, so time is
cut into K blocks of B steps and scanned in two levels:
  1. inside every block, all K blocks at once (B iterations over (K, N) slices): the block-local
     result L (the scan started from 0 at the block's end) and the product P of the coefficients from
     t to the block's end;
  2. across blocks (K iterations over (N,) rows): the carry A at the start of each block;
  3. one vectorized fix-up: A = L + P · carry(next block).
That is B + K ≈ 2·√T Python iterations instead of T. It never divides by products of coefficients
(no cumprod/cumsum trick), so zeros (episode ends) and long horizons stay exact.
Work is done in float64 (inputs are float32, so δ = r + γV' − V is then free of cancellation error)
in a preallocated workspace; only the float32 results are written to the caller's arrays.
"""

from __future__ import annotations

import math

import numpy as np


def block_size(num_steps: int) -> int:
    """Steps per block: ≈ √T balances the two Python loops (B + K iterations)."""
    return math.isqrt(max(num_steps, 1) - 1) + 1  # ⌈√T⌉


class GaeWorkspace:
    """Scratch for one (T, N) shape, allocated once and reused by every `compute_gae` call.

    `dtype` is the accumulation type: float64 by default; float32 exists so the benchmark can measure
    what float64 costs and what it buys.
    """

    def __init__(
        self, num_steps: int, num_envs: int, block: int | None = None, dtype: np.dtype | str = np.float64
    ) -> None:
        self.num_steps, self.num_envs = num_steps, num_envs
        self.block = block_size(num_steps) if block is None else min(max(1, block), num_steps)
        self.num_blocks = -(-num_steps // self.block)
        padded = self.num_blocks * self.block
        # Time is padded to K·B rows; the pad rows keep δ = 0 and c = 0, so they contribute A = 0.
        self.delta = np.zeros((padded, num_envs), dtype)  # (K·B, N): δ, then L, then A
        self.coef = np.zeros((padded, num_envs), dtype)  # (K·B, N): c = γλ(1 − done), then P
        self.carry = np.zeros((self.num_blocks, num_envs), dtype)  # (K, N): A at the next block's start
        self.row = np.empty(num_envs, dtype)  # (N,)
        self.slab = np.empty((self.num_blocks, num_envs), dtype)  # (K, N)


def compute_gae(
    reward: np.ndarray,
    value: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    final_value: np.ndarray,
    bootstrap_value: np.ndarray,
    gamma: float,
    gae_lambda: float,
    out_advantage: np.ndarray,
    out_return: np.ndarray,
    workspace: GaeWorkspace | None = None,
) -> None:
    """Writes advantages and returns (T, N) into `out_advantage` / `out_return`.

    reward, value, final_value: (T, N) float; terminated, truncated: (T, N) bool;
    bootstrap_value: (N,) V(s_T). Shapes are the caller's contract (the rollout buffer validates them).
    """
    T, N = reward.shape
    ws = workspace if workspace is not None else GaeWorkspace(T, N)
    if (ws.num_steps, ws.num_envs) != (T, N):
        raise ValueError(f"workspace is for (T, N) = {(ws.num_steps, ws.num_envs)}, got {(T, N)}")
    K, B = ws.num_blocks, ws.block

    # δ_t = r_t + γ · V_next(t) · (1 − terminated_t) − V_t, built in place in the (T, N) top of ws.delta.
    delta = ws.delta[:T]
    delta[:-1] = value[1:]
    delta[-1] = bootstrap_value
    np.copyto(delta, final_value, where=truncated)
    np.copyto(delta, 0.0, where=terminated)  # terminated wins when both flags are set
    delta *= gamma
    delta += reward
    delta -= value
    # c_t = γλ · (1 − done_t)
    coef = ws.coef[:T]
    coef.fill(gamma * gae_lambda)
    np.copyto(coef, 0.0, where=terminated)
    np.copyto(coef, 0.0, where=truncated)
    ws.coef[T:] = 0.0

    L = ws.delta.reshape(K, B, N)  # (K, B, N) block-local scan, in place over δ
    P = ws.coef.reshape(K, B, N)  # (K, B, N) coefficient products to the block's end, in place over c
    # 1. inside each block, all blocks at once: L_j = δ_j + c_j · L_{j+1}; P_j = c_j · P_{j+1}
    for j in range(B - 2, -1, -1):
        np.multiply(P[:, j], L[:, j + 1], out=ws.slab)
        L[:, j] += ws.slab
        P[:, j] *= P[:, j + 1]
    if K > 1:
        # 2. across blocks: carry[k] = A at the start of block k + 1 (A_T = 0 for the last block)
        carry = ws.carry
        carry[K - 1] = 0.0
        for k in range(K - 2, -1, -1):
            np.multiply(P[k + 1, 0], carry[k + 1], out=ws.row)
            np.add(L[k + 1, 0], ws.row, out=carry[k])
        # 3. A = L + P · carry
        P *= carry[:, None, :]
        L += P
    advantage = ws.delta[:T]  # (T, N) in the workspace dtype
    np.copyto(out_advantage, advantage, casting="same_kind")
    np.add(advantage, value, out=out_return, casting="same_kind")
