"""DQN / Double DQN on replayd n-step batches (CleanRL style: the whole loss is ``q_loss``).

Batch fields used (dict of tensors, first axis B, already on the device):

* ``obs`` (B, *S), ``action`` (B,) int64 (any integer dtype; a float one is refused, not truncated)
* ``n_step_return`` (B,) = sum_{k<n_eff} γ^k r_{t+k}
* ``bootstrap_discount`` (B,) = γ^n_eff, or 0 if the episode terminated within those steps
  (truncation keeps bootstrapping, so it keeps γ^n_eff)
* ``bootstrap_obs`` (B, *S) = s_{t+n_eff}
* optional ``weight`` (B,) importance weights of prioritized sampling

Target: ``y = n_step_return + bootstrap_discount * Q_target(bootstrap_obs, a*)`` with
``a* = argmax_a Q_target(bootstrap_obs, a)`` (DQN) or ``argmax_a Q_online(bootstrap_obs, a)`` (Double DQN).

``DQNTrainer(loss_strategy=...)`` chooses how a step gets the gradient of this loss: ``q_loss`` and
``loss.backward()``, or the same numbers from client/trainers/dqn_manual_grad.py.  The network it
builds when given none is ``QNetwork`` (client/trainers/q_network.py).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replayd.client.trainers.dqn_manual_grad import CompiledManualGradLoss, ManualGradLoss
from replayd.client.trainers.q_network import (
    QNetwork,
    as_dtype,
    check_action,
    check_epsilon,
    check_loss,
    epsilon_greedy,
)
from replayd.client.trainers.settings import check_max_grad_norm, check_positive

__all__ = ["LOSS_STRATEGIES", "AutogradLoss", "DQNTrainer", "LossStrategy", "q_loss", "update_target"]

LOSS_STRATEGIES = ("auto", "autograd", "manual", "compiled")


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
    check_loss(loss_type, huber_delta)
    obs, boot_obs = batch["obs"], batch["bootstrap_obs"]  # (B, *S) each
    action = batch["action"]  # (B,) int64
    check_action(action)
    B = obs.shape[0]

    if double and isinstance(online, QNetwork):
        # One online forward over [s; s_boot]: the first half carries the gradient, the second
        # half is only used (detached) to pick the bootstrap action.  Only for a network whose rows
        # are independent: a BatchNorm layer would mix s_boot into Q(s, a).
        q_both = online(torch.cat([obs, boot_obs]))  # (2B, A)
        q_online = q_both[:B]  # (B, A)
        boot_action = q_both[B:].detach().argmax(1, keepdim=True)  # (B, 1)
    else:
        q_online = online(obs)  # (B, A)
        if double:
            with torch.no_grad():
                boot_action = online(boot_obs).argmax(1, keepdim=True)  # (B, 1)
    q_taken = q_online.gather(1, action.long().unsqueeze(1)).squeeze(1)  # (B,)
    dtype = q_taken.dtype  # the batch's float fields (float32 from the server) in the network's dtype
    n_step_return = as_dtype(batch["n_step_return"], dtype)  # (B,)
    discount = as_dtype(batch["bootstrap_discount"], dtype)  # (B,)
    weight = as_dtype(batch.get("weight"), dtype)  # (B,) or None

    with torch.no_grad():
        q_boot = target(boot_obs)  # (B, A)
        if double:
            boot_value = q_boot.gather(1, boot_action).squeeze(1)  # (B,)
        else:
            boot_value = q_boot.max(1).values  # (B,)
        y = torch.addcmul(n_step_return, discount, boot_value)  # (B,) R + disc * V
        td = q_taken.detach() - y  # (B,) TD errors for priority updates (no autograd node)

    # Fused loss kernels (one autograd node) rather than sub/square/mean.
    reduction = "mean" if weight is None else "none"
    if loss_type == "mse":
        per_sample = F.mse_loss(q_taken, y, reduction=reduction)  # () or (B,)
    else:
        per_sample = F.huber_loss(q_taken, y, reduction=reduction, delta=huber_delta)  # () or (B,)
    loss = per_sample if weight is None else (per_sample * weight).mean()  # ()
    return loss, td, q_taken.detach()


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

    ``loss_strategy``, how a step computes the loss and its gradient (the same numbers every way):

    * ``"autograd"``: ``q_loss`` and ``loss.backward()``; any network.
    * ``"manual"``: the gradient derived by hand (``q_loss_manual_grad``); a ``QNetwork`` only.
      Faster on CPU at CartPole sizes; bench/bench_trainers.py measures it.
    * ``"compiled"``: the ``"manual"`` math compiled ahead by inductor; a ``QNetwork`` on the CPU only,
      needs a C++ compiler and compiles for seconds per batch shape (``compile_for`` does it ahead).
    * ``"auto"``: ``"manual"`` for a ``QNetwork``, ``"autograd"`` for any other network.
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
        loss_strategy: str = "auto",
    ) -> None:
        if isinstance(target_update_every, bool) or not isinstance(target_update_every, numbers.Integral) or not (
                target_update_every >= 1):  # a float 2.5 would update every 5 steps, NaN never
            raise ValueError(f"target_update_every must be an integer >= 1, got {target_update_every!r}")
        check_positive("lr", lr)
        check_max_grad_norm(max_grad_norm)
        check_loss(loss_type, huber_delta)
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {tau}")
        if loss_strategy not in LOSS_STRATEGIES:
            raise ValueError(f"loss_strategy must be one of {', '.join(map(repr, LOSS_STRATEGIES))}, "
                             f"got {loss_strategy!r}")
        self.device = torch.device(device)
        self.online = (network if network is not None else QNetwork(obs_dim, n_actions, hidden)).to(self.device)
        self.target = QNetwork(obs_dim, n_actions, hidden) if network is None else _clone_module(network)
        self.target.to(self.device)
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=lr)
        self.double, self.loss_type, self.huber_delta = double, loss_type, huber_delta
        self.target_update_every, self.tau, self.max_grad_norm = target_update_every, tau, max_grad_norm
        self.loss_strategy = _make_loss_strategy(loss_strategy, self.online, self.device)
        self.steps = 0

    def step(self, batch: Mapping[str, Tensor], log: bool = False) -> dict[str, Tensor | float]:
        """One gradient step.  Returns loss, mean_q and td_error (B,) (detached, for priority updates).

        loss and mean_q stay device tensors (no host sync) unless ``log=True``, which turns them
        into Python floats (one sync); ask for it only on logging steps.
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss, td, q_taken = self.loss_strategy.loss_and_grads(self.online, self.target, batch, self.double,
                                                              self.loss_type, self.huber_delta)
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.online.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.target_update_every == 0:
            update_target(self.online, self.target, self.tau)
        out: dict[str, Tensor | float] = {"loss": loss, "mean_q": q_taken.mean(), "td_error": td}
        if log:
            out["loss"], out["mean_q"] = float(out["loss"]), float(out["mean_q"])
        return out

    def compile_for(self, batch: Mapping[str, Tensor]) -> None:
        """With ``loss_strategy="compiled"``: compiles the loss for ``batch``'s signature now (seconds), leaving
        the networks and their gradients as they were, so that training time does not include it."""
        if self.loss_strategy.name != "compiled":
            raise ValueError(f"compile_for needs DQNTrainer(loss_strategy='compiled'), "
                             f"got loss_strategy={self.loss_strategy.name!r}")
        params = list(self.online.parameters())
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.loss_strategy.loss_and_grads(self.online, self.target, batch, self.double, self.loss_type,
                                          self.huber_delta)
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad

    @torch.no_grad()
    def act(self, obs: Tensor, epsilon: float = 0.0) -> Tensor:
        """Epsilon-greedy actions (B,) for obs (B, *S); ``epsilon`` in [0, 1]."""
        check_epsilon(epsilon)
        return epsilon_greedy(self.online(obs.to(self.device)), epsilon)


class LossStrategy(Protocol):
    """How ``DQNTrainer.step`` computes the loss: ``loss_and_grads`` returns (loss () without a graph,
    td_error (B,), q_taken (B,)) as ``q_loss`` does and adds dLoss/dparam to ``online``'s ``.grad``."""

    name: str

    def loss_and_grads(self, online: nn.Module, target: nn.Module, batch: Mapping[str, Tensor], double: bool,
                       loss_type: str, huber_delta: float) -> tuple[Tensor, Tensor, Tensor]: ...


class AutogradLoss:
    """``loss_strategy="autograd"``: ``q_loss`` and ``loss.backward()``, for any network."""

    name = "autograd"

    def loss_and_grads(self, online: nn.Module, target: nn.Module, batch: Mapping[str, Tensor], double: bool,
                       loss_type: str, huber_delta: float) -> tuple[Tensor, Tensor, Tensor]:
        loss, td, q_taken = q_loss(online, target, batch, double, loss_type, huber_delta)  # (), (B,), (B,)
        loss.backward()
        return loss.detach(), td, q_taken


def _make_loss_strategy(name: str, online: nn.Module, device: torch.device) -> LossStrategy:
    if name == "auto":
        name = "manual" if isinstance(online, QNetwork) else "autograd"
    if name == "autograd":
        return AutogradLoss()
    return ManualGradLoss(online) if name == "manual" else CompiledManualGradLoss(online, device)


def _clone_module(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)
