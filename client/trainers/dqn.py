"""DQN / Double DQN on replayd n-step batches (CleanRL style: the whole loss is ``q_loss``).

``q_loss_manual_grad`` computes the same loss with a hand-written backward for ``QNetwork``; the
trainer uses it by default because it is faster on CPU (tests check it equals ``q_loss``).  With
``DQNTrainer(compile_loss=True)`` that math (``q_loss_grads``) runs compiled ahead by inductor
(client/trainers/compiled.py): faster again on CPU, at the price of a C++ compiler and seconds of
compiling per batch shape.

Batch fields used (dict of tensors, first axis B, already on the device):

* ``obs`` (B, *S), ``action`` (B,) int64 (any integer dtype; a float one is refused, not truncated)
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
import math
import numbers
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from client.trainers.compiled import CompiledFunction
from client.trainers.settings import check_max_grad_norm, check_positive

__all__ = ["DQNTrainer", "QNetwork", "q_loss", "q_loss_grads", "q_loss_grads_flat", "q_loss_manual_grad",
           "update_target"]


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
        parameter's storage changes (what a CompiledFunction's weight groups must be)."""
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


def _refresh_after_load(network: QNetwork, incompatible_keys: object) -> None:
    network._refresh_cache()


def _check_loss(loss_type: str, huber_delta: float) -> None:
    if loss_type not in ("mse", "huber"):
        raise ValueError(f"loss_type must be 'mse' or 'huber', got {loss_type!r}")
    if not (math.isfinite(huber_delta) and huber_delta > 0):  # a NaN delta would also miss every compiled graph
        raise ValueError(f"huber_delta must be finite and > 0, got {huber_delta!r}")


def _check_action(action: Tensor) -> None:
    """Refuses float (or bool) actions: ``.long()`` would truncate 1.7 to action 1 without a word."""
    if action.dtype.is_floating_point or action.dtype.is_complex or action.dtype == torch.bool:
        raise ValueError(f"batch['action']: expected an integer dtype, got {str(action.dtype).removeprefix('torch.')}")


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
    loss = per_sample if weight is None else (per_sample * weight).mean()
    return loss, td, q_taken.detach()


def q_loss_manual_grad(
    online: QNetwork,
    target: QNetwork,
    batch: Mapping[str, Tensor],
    double: bool = False,
    loss_type: str = "mse",
    huber_delta: float = 1.0,
    compiled: CompiledFunction | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Same loss and outputs as ``q_loss``, with the gradient derived by hand (``q_loss_grads``).

    Writes dLoss/dparam into ``online``'s ``.grad`` (accumulating like autograd) and returns the
    loss without a graph.  At CartPole sizes a step is a few dozen tiny ops, so recording and
    replaying an autograd graph is most of the cost (bench/bench_trainers.py); here every op is one
    the math needs.  Only for ``QNetwork`` (Linear/ReLU stack).  ``compiled``: a
    ``CompiledFunction(q_loss_grads_flat)`` to run the math through (one graph per batch signature
    and loss setting; ``DQNTrainer(compile_loss=True)`` keeps one).
    """
    _check_loss(loss_type, huber_delta)
    if not (isinstance(online, QNetwork) and isinstance(target, QNetwork)):
        raise TypeError(f"q_loss_manual_grad needs QNetworks, got {type(online).__name__} and {type(target).__name__}")
    obs = _flat(batch["obs"], online.weights_and_biases[0][0].dtype)  # (B, obs_dim)
    boot_obs = _flat(batch["bootstrap_obs"], obs.dtype)  # (B, obs_dim)
    action = batch["action"]
    _check_action(action)
    action = (action if action.dtype == torch.int64 else action.long()).view(-1, 1)  # (B, 1)
    n_step_return = _as(batch["n_step_return"], obs.dtype)  # (B,)
    discount = _as(batch["bootstrap_discount"], obs.dtype)  # (B,)
    weight = _as(batch.get("weight"), obs.dtype)  # (B,) or None
    if compiled is None:
        with torch.no_grad():  # the weights enter as detached views; a batch tensor might not
            loss, td, q_taken, *grads = q_loss_grads(online.transposed_layers(), target.transposed_layers(), obs,
                                                     boot_obs, action, n_step_return, discount, weight, double,
                                                     loss_type, huber_delta)
    else:
        if compiled.fn is not q_loss_grads_flat:
            raise TypeError("compiled must be a CompiledFunction(q_loss_grads_flat)")
        inputs = (obs, boot_obs, action, n_step_return, discount) if weight is None else (
            obs, boot_obs, action, n_step_return, discount, weight)
        loss, td, q_taken, *grads = compiled((online.weight_views(), target.weight_views()), inputs,
                                             layers=len(online.weights_and_biases), double=double,
                                             loss_type=loss_type, huber_delta=float(huber_delta),
                                             weighted=weight is not None)
    for (w, b), dw, db in zip(online.weights_and_biases, grads[0::2], grads[1::2], strict=True):
        _accumulate_grad(w, dw)
        _accumulate_grad(b, db)
    return loss, td, q_taken


def q_loss_grads(
    online_t: Sequence[tuple[Tensor, Tensor]],
    target_t: Sequence[tuple[Tensor, Tensor]],
    obs: Tensor,
    boot_obs: Tensor,
    action: Tensor,
    n_step_return: Tensor,
    discount: Tensor,
    weight: Tensor | None,
    double: bool,
    loss_type: str,
    huber_delta: float,
) -> tuple[Tensor, ...]:
    """(loss, td, q_taken, dW_1, db_1, ..., dW_L, db_L) of the (Double) DQN loss, as a pure function.

    ``online_t``/``target_t``: per layer (W^T (in, out), b (out,)) of a Linear/ReLU stack; obs and
    boot_obs (B, obs_dim), action (B, 1) int64, n_step_return, discount and weight (B,).  Backward,
    per layer l (y_l = x_l W_l^T + b_l, x_{l+1} = relu(y_l), g_l = dLoss/dy_l):
    dW_l = g_l^T x_l, db_l = sum_i g_l, g_{l-1} = (g_l W_l) * [x_l > 0].
    """
    B = obs.shape[0]

    # Online forward, keeping each layer's input (s rows) for the backward.  Double DQN: one pass
    # over [s; s_boot] (the s_boot half only picks the bootstrap action).
    layer_inputs, q = _relu_mlp(torch.cat([obs, boot_obs]) if double else obs, online_t)  # q (B or 2B, A)
    if double:
        layer_inputs = [x[:B] for x in layer_inputs]  # (B, in) per layer: the s rows
    q_taken = q.gather(1, action).view(B)  # (B,) Q(s, a); the (B, 1) index reads the s rows only

    # n-step target from the target network (no gradient by construction).
    _, q_next = _relu_mlp(boot_obs, target_t)  # (B, A)
    if double:
        boot_value = q_next.gather(1, q[B:].argmax(1, keepdim=True)).view(B)  # (B,) Q_target(s', argmax Q_online)
    else:
        boot_value = q_next.amax(1)  # (B,)
    y = torch.addcmul(n_step_return, discount, boot_value)  # (B,) R + disc * V
    td = q_taken - y  # (B,)

    # Loss = mean_i w_i l(td_i) and dloss = dLoss/dQ(s_i, a_i) = w_i l'(td_i) / B.
    if loss_type == "mse":  # l = td^2, l' = 2 td
        dloss = td * (2.0 / B) if weight is None else td * weight * (2.0 / B)  # (B,)
        loss = torch.dot(dloss, td) * 0.5  # () = mean_i w_i td_i^2
    else:  # Huber: l' = clamp(td, -delta, delta)
        if weight is None:
            loss = F.huber_loss(q_taken, y, delta=huber_delta)  # ()
            dloss = td.clamp(-huber_delta, huber_delta).mul_(1.0 / B)  # (B,)
        else:
            loss = torch.dot(F.huber_loss(q_taken, y, reduction="none", delta=huber_delta), weight) / B  # ()
            dloss = td.clamp(-huber_delta, huber_delta).mul_(weight).mul_(1.0 / B)  # (B,)
    g = torch.zeros_like(q_next).scatter_(1, action, dloss.view(B, 1))  # (B, A) dLoss/dq, taken action only

    # Backward through the s rows only (the s_boot half carries no gradient).
    grads: list[Tensor] = []
    for i in range(len(online_t) - 1, -1, -1):
        (w_t, _), x_in = online_t[i], layer_inputs[i]  # w_t (in, out), x_in (B, in)
        # dW = g^T x (out, in).  MKL is ~4x slower at b256 for g^T x when x has few columns
        # (obs_dim 4), so narrow inputs take the transpose of x^T g (same numbers).
        dw = torch.mm(x_in.t(), g).t() if w_t.shape[0] < w_t.shape[1] else torch.mm(g.t(), x_in)
        grads[:0] = [dw, g.sum(0)]  # (out, in), (out,)
        if i > 0:
            # ReLU backward: zero where the layer input (a ReLU output) is 0 (autograd's own op).
            g = torch.ops.aten.threshold_backward(torch.mm(g, w_t.t()), x_in, 0.0)  # (B, in)
    return (loss, td, q_taken, *grads)


def q_loss_grads_flat(*tensors: Tensor, layers: int, double: bool, loss_type: str, huber_delta: float,
                      weighted: bool) -> tuple[Tensor, ...]:
    """``q_loss_grads`` on a flat tensor list (what a compiled graph takes): online (W^T, b) per layer,
    target (W^T, b) per layer, obs, boot_obs, action, n_step_return, discount[, weight]."""
    online_t = tuple(zip(tensors[0:2 * layers:2], tensors[1:2 * layers:2], strict=True))
    target_t = tuple(zip(tensors[2 * layers:4 * layers:2], tensors[2 * layers + 1:4 * layers:2], strict=True))
    obs, boot_obs, action, n_step_return, discount = tensors[4 * layers:4 * layers + 5]
    weight = tensors[4 * layers + 5] if weighted else None
    return q_loss_grads(online_t, target_t, obs, boot_obs, action, n_step_return, discount, weight, double,
                        loss_type, huber_delta)


def _relu_mlp(x: Tensor, layers_t: Sequence[tuple[Tensor, Tensor]]) -> tuple[list[Tensor], Tensor]:
    """A Linear/ReLU stack on (W^T, b) views, graph-free: (each layer's input, the output)."""
    inputs = []
    for w_t, b in layers_t[:-1]:
        inputs.append(x)
        x = torch.addmm(b, x, w_t).relu_()  # (N, hidden)
    inputs.append(x)
    return inputs, torch.addmm(layers_t[-1][1], x, layers_t[-1][0])


def _as(x: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The batch's float fields in the network's dtype (the server sends float32; no copy when equal)."""
    return x if x is None or x.dtype == dtype else x.to(dtype)


def _flat(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, *S) -> (B, obs_dim) in the network's dtype (no copy when already so)."""
    if x.dim() != 2:
        x = x.reshape(x.shape[0], -1)
    return x if x.dtype == dtype else x.to(dtype)


def _accumulate_grad(p: Tensor, grad: Tensor) -> None:
    """p.grad += grad, as autograd does: not for a parameter frozen with requires_grad=False."""
    if not p.requires_grad:
        return
    if p.grad is None:
        p.grad = grad
    else:
        p.grad.add_(grad)


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
        compile_loss: bool = False,
    ) -> None:
        if isinstance(target_update_every, bool) or not isinstance(target_update_every, numbers.Integral) or not (
                target_update_every >= 1):  # a float 2.5 would update every 5 steps, NaN never
            raise ValueError(f"target_update_every must be an integer >= 1, got {target_update_every!r}")
        check_positive("lr", lr)
        check_max_grad_norm(max_grad_norm)
        _check_loss(loss_type, huber_delta)
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
        # Hand-derived backward for QNetwork (the default): at CartPole sizes on CPU, 1 thread, it
        # measured 1.6-2.0x faster than this module's own autograd ``q_loss`` and 1.5-2.4x faster
        # than the seed's loss forms (bench/bench_trainers.py), same numbers (tests/test_trainers_dqn.py).
        self.manual_grad = isinstance(self.online, QNetwork) if manual_grad is None else manual_grad
        # compile_loss: the manual-gradient math compiled ahead by inductor (client/trainers/compiled.py),
        # 1.4-1.9x faster again on this CPU (2.7x / 2.4x the seed's forms at batch 256, DQN / Double
        # DQN). Opt-in: it needs a C++ compiler and seconds of compiling per batch shape and loss setting.
        if compile_loss and not (self.manual_grad and self.device.type == "cpu"):
            raise ValueError("compile_loss=True needs the manual-gradient path (a QNetwork) on the CPU, where it "
                             f"was measured; got manual_grad={self.manual_grad}, device={self.device}")
        self.compiled_loss = CompiledFunction(q_loss_grads_flat) if compile_loss else None
        self.steps = 0

    def step(self, batch: Mapping[str, Tensor], log: bool = False) -> dict[str, Tensor | float]:
        """One gradient step.  Returns loss, mean_q and td_error (B,) (detached, for priority updates).

        loss and mean_q stay device tensors (no host sync) unless ``log=True``, which turns them
        into Python floats (one sync); ask for it only on logging steps.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if self.manual_grad:
            loss, td, q_taken = q_loss_manual_grad(
                self.online, self.target, batch, self.double, self.loss_type, self.huber_delta, self.compiled_loss
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
        out: dict[str, Tensor | float] = {"loss": loss.detach(), "mean_q": q_taken.mean(), "td_error": td}
        if log:
            out["loss"], out["mean_q"] = float(out["loss"]), float(out["mean_q"])
        return out

    def compile_for(self, batch: Mapping[str, Tensor]) -> None:
        """With ``compile_loss``: compiles the loss for ``batch``'s signature now (seconds), leaving the
        networks and their gradients as they were, so that training time does not include it."""
        if self.compiled_loss is None:
            raise ValueError("compile_for needs DQNTrainer(compile_loss=True)")
        params = list(self.online.parameters())
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        q_loss_manual_grad(self.online, self.target, batch, self.double, self.loss_type, self.huber_delta,
                           self.compiled_loss)
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


def _clone_module(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)
