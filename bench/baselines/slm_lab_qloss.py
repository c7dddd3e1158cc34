"""SLM Lab's DQN `calc_q_loss` in two forms, kept only as benchmark baselines (do not use for training).

(a) ``two_forward_qloss``, as ``calc_q_loss`` computes it: ``q_preds = net(states);
    next_q_preds = net(next_states)``, gather the taken action, 1-step max target
    ``r + γ (1 - done) max_a next_q``.  Defect kept on purpose: the *online* net produces the targets
    (no target network).  The target is detached before the MSE, so backward runs through the
    ``q_preds`` branch only (but both forwards record autograd graphs).
(b) ``single_forward_qloss``: ``torch.cat([states, next_states])``, one forward, split, same math:
    the "vectorized" form of the same loss. Run under ``torch.no_grad()`` it could not train at all;
    for a fair forward+backward timing the benchmark runs it with grad enabled.

``SlmLabMLP`` is SLM Lab's network style: an ``nn.Sequential`` of Linear/ReLU modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SlmLabMLP(nn.Sequential):
    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64) -> None:
        super().__init__(
            nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_actions)
        )


def two_forward_qloss(net: nn.Module, batch: dict[str, Tensor], gamma: float = 0.99) -> Tensor:
    states, next_states = batch["obs"], batch["next_obs"]
    actions, rewards = batch["action"], batch["reward"]
    dones = batch["terminated"].float()
    q_preds = net(states)
    next_q_preds = net(next_states)  # kept defect: online net for targets, graph recorded
    q = q_preds.gather(1, actions.unsqueeze(1)).squeeze(1)
    max_next_q = next_q_preds.max(1)[0]
    target = rewards + gamma * (1 - dones) * max_next_q
    return F.mse_loss(q, target.detach())


def single_forward_qloss(net: nn.Module, batch: dict[str, Tensor], gamma: float = 0.99) -> Tensor:
    states, next_states = batch["obs"], batch["next_obs"]
    actions, rewards = batch["action"], batch["reward"]
    dones = batch["terminated"].float()
    batch_size = states.shape[0]
    all_q = net(torch.cat([states, next_states]))
    q_preds, next_q_preds = all_q[:batch_size], all_q[batch_size:]
    q = q_preds.gather(1, actions.unsqueeze(1)).squeeze(1)
    max_next_q = next_q_preds.max(1)[0]
    target = rewards + gamma * (1 - dones) * max_next_q
    return F.mse_loss(q, target.detach())
