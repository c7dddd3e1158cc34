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
``loss.backward()``, or the same numbers from client/trainers/dqn_manual_grad.py.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from client.trainers.settings import check_max_grad_norm, check_positive

__all__ = ["LOSS_STRATEGIES", "AutogradLoss", "DQNTrainer", "LossStrategy", "QNetwork", "q_loss", "update_target"]

LOSS_STRATEGIES = ("auto", "autograd", "manual", "compiled")


class QNetwork(nn.Module):
    """MLP obs (B, obs_dim) -> Q (B, n_actions); default obs_dim -> 64 -> 64 -> n_actions.

    ``forward`` runs ``F.linear``/``relu`` directly on a cached tuple of the layers' (weight, bias):
    the same math as an ``nn.Sequential``, without the per-submodule ``__call__`` and attribute
    lookups that dominate at batch 32.  The cache holds the Parameter objects themselves and is
    refreshed after ``.to()``/``.cuda()``/``.double()`` (``_apply``) and ``load_state_dict``.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: Sequence[int] = (64, 64)) -> None:
        super().__init__()
        if obs_dim < 1 or n_actions < 1:
            raise ValueError(f"obs_dim and n_actions must be >= 1, got {obs_dim}, {n_actions}")
        dims = [obs_dim, *hidden, n_actions]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.obs_dim, self.n_actions = obs_dim, n_actions
        self._refresh_cache()
        # load_state_dict(..., assign=True) puts new Parameter objects in the layers.
        self.register_load_state_dict_post_hook(_refresh_after_load)

    def _refresh_cache(self) -> None:
        self.weights_and_biases = tuple((layer.weight, layer.bias) for layer in self.layers)
        self._transposed: tuple[tuple[Tensor, Tensor], ...] = ()
        self._weight_views: tuple[Tensor, ...] = ()
        self._transposed_storage: tuple[int, ...] = ()

    def transposed_layers(self) -> tuple[tuple[Tensor, Tensor], ...]:
        """Per layer (W^T (in, out), b (out,)): detached views of the parameters, for graph-free passes.

        ``torch.addmm(b, x, W^T)`` is ``F.linear(x, W, b)`` without its per-call transpose and
        dispatch (~2 us per layer at CartPole sizes).  The views follow in-place updates (the
        optimizer, ``load_state_dict``) and are rebuilt when a parameter's storage changes
        (``p.data = ...``, ``.to()``).
        """
        storage = tuple(p.data_ptr() for layer in self.weights_and_biases for p in layer)
        if storage != self._transposed_storage:
            self._transposed = tuple((w.detach().t(), b.detach()) for w, b in self.weights_and_biases)
            self._weight_views = tuple(itertools.chain.from_iterable(self._transposed))
            self._transposed_storage = storage
        return self._transposed

    def weight_views(self) -> tuple[Tensor, ...]:
        """``transposed_layers()`` flat: (W_1^T, b_1, ..., W_L^T, b_L), the same tuple object until a
        parameter's storage changes, so that a caller tells a new layout by the tuple's identity."""
        self.transposed_layers()
        return self._weight_views

    def _apply(self, fn, recurse=True):  # nn.Module's signature
        out = super()._apply(fn, recurse)
        self._refresh_cache()
        return out

    def forward(self, obs: Tensor) -> Tensor:
        wb = self.weights_and_biases
        x = _flat(obs, wb[0][0].dtype)  # (B, obs_dim)
        for w, b in wb[:-1]:
            x = torch.relu(F.linear(x, w, b))  # (B, hidden)
        return F.linear(x, *wb[-1])  # (B, n_actions)


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
    _check_loss(loss_type, huber_delta)
    obs, boot_obs = batch["obs"], batch["bootstrap_obs"]  # (B, *S) each
    action = batch["action"]  # (B,) int64
    _check_action(action)
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
    n_step_return = _as(batch["n_step_return"], dtype)  # (B,)
    discount = _as(batch["bootstrap_discount"], dtype)  # (B,)
    weight = _as(batch.get("weight"), dtype)  # (B,) or None

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
        _check_loss(loss_type, huber_delta)
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
        if not 0.0 <= epsilon <= 1.0:  # NaN or below 0 acted greedily, above 1 as 1
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")
        q = self.online(obs.to(self.device))
        greedy = q.argmax(1)
        if epsilon <= 0.0:
            return greedy
        random = torch.randint(q.shape[1], greedy.shape, device=q.device)
        explore = torch.rand(greedy.shape, device=q.device) < epsilon
        return torch.where(explore, random, greedy)


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
    # The hand-derived gradients build on this module's QNetwork, so their module imports this one.
    from client.trainers.dqn_manual_grad import CompiledManualGradLoss, ManualGradLoss

    return ManualGradLoss(online) if name == "manual" else CompiledManualGradLoss(online, device)


def _refresh_after_load(network: QNetwork, incompatible_keys: object) -> None:
    network._refresh_cache()


def _check_loss(loss_type: str, huber_delta: float) -> None:
    if loss_type not in ("mse", "huber"):
        raise ValueError(f"loss_type must be 'mse' or 'huber', got {loss_type!r}")
    if not (math.isfinite(huber_delta) and huber_delta > 0):
        raise ValueError(f"huber_delta must be finite and > 0, got {huber_delta!r}")


def _check_action(action: Tensor) -> None:
    """Refuses float (or bool) actions: ``.long()`` would truncate 1.7 to action 1 without a word."""
    if action.dtype.is_floating_point or action.dtype.is_complex or action.dtype == torch.bool:
        raise ValueError(f"batch['action']: expected an integer dtype, got {str(action.dtype).removeprefix('torch.')}")


def _as(x: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The batch's float fields in the network's dtype (the server sends float32; no copy when equal)."""
    return x if x is None or x.dtype == dtype else x.to(dtype)


def _flat(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, *S) -> (B, obs_dim) in the network's dtype (no copy when already so)."""
    if x.dim() != 2:
        x = x.reshape(x.shape[0], -1)
    return x if x.dtype == dtype else x.to(dtype)


def _clone_module(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)
