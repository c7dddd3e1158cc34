"""esper-lite's GAE, re-implemented as written for timing (torch, (num_envs, steps) layout).

Known defects kept on purpose so the timings compare like with like: truncation is treated as
termination (one `dones` flag), and `next_values` repeats V(s_{T-1}) at the last step instead of
using a bootstrap value.
"""

from __future__ import annotations

import torch


def compute_advantages_vectorized(
    values: torch.Tensor, rewards: torch.Tensor, dones: torch.Tensor, gamma: float, gae_lambda: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorized over envs, Python loop over time. values/rewards/dones: (num_envs, steps)."""
    num_envs = rewards.shape[0]
    next_values = torch.cat([values[:, 1:], values[:, -1:]], dim=1)
    delta = rewards + gamma * next_values * (1 - dones) - values
    advantages = torch.zeros_like(rewards)
    gae = torch.zeros(num_envs)
    for t in reversed(range(rewards.shape[1])):
        gae = delta[:, t] + gamma * gae_lambda * (1 - dones[:, t]) * gae
        advantages[:, t] = gae
    returns = advantages + values
    return advantages, returns


def compute_advantages_loop(
    values: torch.Tensor, rewards: torch.Tensor, dones: torch.Tensor, gamma: float, gae_lambda: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The original per-env, per-step loop (same recurrence, element by element)."""
    num_envs, steps = rewards.shape
    advantages = torch.zeros_like(rewards)
    for env_idx in range(num_envs):
        gae = 0.0
        for t in reversed(range(steps)):
            next_value = values[env_idx, t + 1] if t + 1 < steps else values[env_idx, t]
            delta = rewards[env_idx, t] + gamma * next_value * (1 - dones[env_idx, t]) - values[env_idx, t]
            gae = delta + gamma * gae_lambda * (1 - dones[env_idx, t]) * gae
            advantages[env_idx, t] = gae
    returns = advantages + values
    return advantages, returns
