"""DQN / Double DQN on replayd n-step batches (CleanRL style: the whole loss is ``q_loss``).

Batch fields used (dict of tensors, first axis B, already on the device):

* ``obs`` (B, *S), ``action`` (B,) int64
* ``n_step_return`` (B,) = sum_{k<n_eff} γ^k r_{t+k}
* ``bootstrap_discount`` (B,) = γ^n_eff, or 0 if the episode terminated within those steps
  (truncation keeps bootstrapping, so it keeps γ^n_eff)
* ``bootstrap_obs`` (B, *S) = s_{t+n_eff}
* optional ``weight`` (B,) importance weights of prioritized sampling

Target: ``y = n_step_return + bootstrap_discount * Q_target(bootstrap_obs, a*)`` with
``a* = argmax_a Q_target(bootstrap_obs, a)`` (DQN) or ``argmax_a Q_online(bootstrap_obs, a)`` (Double DQN).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DQNTrainer", "QNetwork", "q_loss", "q_loss_manual_grad", "update_target"]


class QNetwork(nn.Module):
    """MLP obs (B, obs_dim) -> Q (B, n_actions); default obs_dim -> 64 -> 64 -> n_actions.

    ``forward`` calls ``F.linear``/``relu`` directly on the layers' parameters: the same math as an
    ``nn.Sequential``, without the per-submodule ``__call__`` overhead that dominates at batch 32.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: Sequence[int] = (64, 64)) -> None:
        super().__init__()
        if obs_dim < 1 or n_actions < 1:
            raise ValueError(f"obs_dim and n_actions must be >= 1, got {obs_dim}, {n_actions}")
        dims = [obs_dim, *hidden, n_actions]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.obs_dim, self.n_actions = obs_dim, n_actions

    def forward(self, obs: Tensor) -> Tensor:
        x = obs if obs.dim() == 2 else obs.reshape(obs.shape[0], -1)
        if x.dtype != self.layers[0].weight.dtype:
            x = x.to(self.layers[0].weight.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = F.linear(x, layer.weight, layer.bias)
            if i < last:
                x = torch.relu(x)
        return x


def q_loss(
    online: nn.Module,
    target: nn.Module,
    batch: Mapping[str, Tensor],
    double: bool = False,
    loss_type: str = "mse",
    huber_delta: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """n-step (Double) DQN loss.  Returns (loss (), td_error (B,) detached, q_taken (B,) detached).

    td_error = Q(s, a) - y.  The loss is mean_i w_i * l(td_i) with l = td^2 ("mse") or the Huber
    function ("huber", delta ``huber_delta``); w_i = batch["weight"] when present, else 1.
    Gradient flows only through Q_online(s, a).
    """
    if loss_type not in ("mse", "huber"):
        raise ValueError(f"loss_type must be 'mse' or 'huber', got {loss_type!r}")
    obs, boot_obs = batch["obs"], batch["bootstrap_obs"]  # (B, *S) each
    action = batch["action"]  # (B,) int64
    B = obs.shape[0]

    if double:
        # One online forward over [s; s_boot]: the first half carries the gradient, the second
        # half is only used (detached) to pick the bootstrap action.
        q_both = online(torch.cat([obs, boot_obs]))  # (2B, A)
        q_online = q_both[:B]  # (B, A)
        boot_action = q_both[B:].detach().argmax(1, keepdim=True)  # (B, 1)
    else:
        q_online = online(obs)  # (B, A)
    q_taken = q_online.gather(1, action.long().unsqueeze(1)).squeeze(1)  # (B,)

    with torch.no_grad():
        q_boot = target(boot_obs)  # (B, A)
        if double:
            boot_value = q_boot.gather(1, boot_action).squeeze(1)  # (B,)
        else:
            boot_value = q_boot.max(1).values  # (B,)
        y = torch.addcmul(batch["n_step_return"], batch["bootstrap_discount"], boot_value)  # (B,) R + disc * V
        td = q_taken.detach() - y  # (B,) TD errors for priority updates (no autograd node)

    # Fused loss kernels (one autograd node) rather than sub/square/mean.
    weight = batch.get("weight")  # (B,) or None
    reduction = "mean" if weight is None else "none"
    if loss_type == "mse":
        per_sample = F.mse_loss(q_taken, y, reduction=reduction)  # () or (B,)
    else:
        per_sample = F.huber_loss(q_taken, y, reduction=reduction, delta=huber_delta)  # () or (B,)
    loss = per_sample if weight is None else (per_sample * weight).mean()
    return loss, td, q_taken.detach()


@torch.no_grad()
def q_loss_manual_grad(
    online: QNetwork,
    target: nn.Module,
    batch: Mapping[str, Tensor],
    double: bool = False,
    loss_type: str = "mse",
    huber_delta: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Same loss and outputs as ``q_loss``, with the gradient derived by hand (CPU fast path).

    Writes dLoss/dparam into ``online``'s ``.grad`` (accumulating like autograd) and returns the
    loss without a graph.  No autograd graph is recorded, which at CartPole sizes is where most of
    the time goes (bench/bench_trainers.py).  Only for ``QNetwork`` (Linear/ReLU stack).
    Backward, per layer l (y_l = x_l W_l^T + b_l, x_{l+1} = relu(y_l)):
    dW_l = g_l^T x_l, db_l = sum_i g_l, g_{l-1} = (g_l W_l) * [x_l > 0].
    """
    if loss_type not in ("mse", "huber"):
        raise ValueError(f"loss_type must be 'mse' or 'huber', got {loss_type!r}")
    if not isinstance(online, QNetwork):
        raise TypeError(f"q_loss_manual_grad needs a QNetwork, got {type(online).__name__}")
    obs, boot_obs = batch["obs"], batch["bootstrap_obs"]  # (B, *S) each
    action = batch["action"].long().unsqueeze(1)  # (B, 1)
    B = obs.shape[0]
    dtype = online.layers[0].weight.dtype

    # Forward, keeping each layer's input.  Double DQN: one pass over [s; s_boot].
    x = torch.cat([obs, boot_obs]) if double else obs
    x = x.reshape(x.shape[0], -1).to(dtype)  # (B or 2B, obs_dim)
    inputs = []
    last = len(online.layers) - 1
    for i, layer in enumerate(online.layers):
        inputs.append(x)
        x = torch.addmm(layer.bias, x, layer.weight.t())
        if i < last:
            x = x.relu_()
    q_online = x[:B]  # (B, A)
    q_taken = q_online.gather(1, action).squeeze(1)  # (B,)

    q_boot = target(boot_obs)  # (B, A)
    if double:
        boot_value = q_boot.gather(1, x[B:].argmax(1, keepdim=True)).squeeze(1)  # (B,)
    else:
        boot_value = q_boot.amax(1)  # (B,)
    y = torch.addcmul(batch["n_step_return"], batch["bootstrap_discount"], boot_value)  # (B,)
    td = q_taken - y  # (B,)

    # Loss and dLoss/dQ(s, a).
    if loss_type == "mse":
        per_sample, dloss = td.square(), 2.0 * td  # (B,) each
    else:
        per_sample = F.huber_loss(q_taken, y, reduction="none", delta=huber_delta)  # (B,)
        dloss = td.clamp(-huber_delta, huber_delta)  # (B,)
    weight = batch.get("weight")
    if weight is not None:
        per_sample, dloss = per_sample * weight, dloss * weight
    loss = per_sample.mean()
    grad_out = torch.zeros_like(q_online).scatter_(1, action, (dloss / B).unsqueeze(1))  # (B, A)

    # Backward through the first B rows only (the bootstrap half carries no gradient).
    for i in range(last, -1, -1):
        layer, x_in = online.layers[i], inputs[i][:B]
        for p, g in ((layer.weight, grad_out.t() @ x_in), (layer.bias, grad_out.sum(0))):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        if i > 0:
            grad_out = (grad_out @ layer.weight).mul_(x_in > 0)
    return loss, td, q_taken


@torch.no_grad()
def update_target(online: nn.Module, target: nn.Module, tau: float = 1.0) -> None:
    """target <- tau * online + (1 - tau) * target (tau = 1: hard copy).  Buffers are copied."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    online_params = list(online.parameters())
    target_params = list(target.parameters())
    if len(online_params) != len(target_params):
        raise ValueError("online and target networks have different parameter lists")
    if tau == 1.0:
        torch._foreach_copy_(target_params, online_params)
    else:
        torch._foreach_lerp_(target_params, online_params, tau)
    for tb, ob in zip(target.buffers(), online.buffers(), strict=True):
        tb.copy_(ob)


class DQNTrainer:
    """Online + target Q-networks and Adam.

    Target update: hard copy every ``target_update_every`` steps when ``tau == 1.0``, otherwise
    Polyak averaging with ``tau`` every ``target_update_every`` steps (use 1 for every step).
    """

    def __init__(
        self,
        obs_dim: int,
        n_actions: int,
        hidden: Sequence[int] = (64, 64),
        lr: float = 2.5e-4,
        double: bool = True,
        loss_type: str = "huber",
        huber_delta: float = 1.0,
        target_update_every: int = 500,
        tau: float = 1.0,
        max_grad_norm: float | None = None,
        device: torch.device | str = "cpu",
        network: nn.Module | None = None,
        manual_grad: bool | None = None,
    ) -> None:
        if target_update_every < 1:
            raise ValueError(f"target_update_every must be >= 1, got {target_update_every}")
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {tau}")
        self.device = torch.device(device)
        self.online = (network if network is not None else QNetwork(obs_dim, n_actions, hidden)).to(self.device)
        self.target = QNetwork(obs_dim, n_actions, hidden) if network is None else _clone_module(network)
        self.target.to(self.device)
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=lr)
        self.double, self.loss_type, self.huber_delta = double, loss_type, huber_delta
        self.target_update_every, self.tau, self.max_grad_norm = target_update_every, tau, max_grad_norm
        # Hand-derived backward for QNetwork: measured ~2x faster than autograd on CPU at CartPole
        # sizes (bench/bench_trainers.py), same numbers (tests/test_trainers_dqn.py).
        self.manual_grad = isinstance(self.online, QNetwork) if manual_grad is None else manual_grad
        self.steps = 0

    def step(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """One gradient step.  Returns device tensors (no host sync): loss, mean_q, td_error (B,).

        Call ``float(out["loss"])`` only when logging.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if self.manual_grad:
            loss, td, q_taken = q_loss_manual_grad(
                self.online, self.target, batch, self.double, self.loss_type, self.huber_delta
            )
        else:
            loss, td, q_taken = q_loss(self.online, self.target, batch, self.double, self.loss_type, self.huber_delta)
            loss.backward()
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.online.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.target_update_every == 0:
            update_target(self.online, self.target, self.tau)
        return {"loss": loss.detach(), "mean_q": q_taken.mean(), "td_error": td}

    @torch.no_grad()
    def act(self, obs: Tensor, epsilon: float = 0.0) -> Tensor:
        """Epsilon-greedy actions (B,) for obs (B, *S)."""
        q = self.online(obs.to(self.device))
        greedy = q.argmax(1)
        if epsilon <= 0.0:
            return greedy
        random = torch.randint(q.shape[1], greedy.shape, device=q.device)
        explore = torch.rand(greedy.shape, device=q.device) < epsilon
        return torch.where(explore, random, greedy)


def _clone_module(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)
