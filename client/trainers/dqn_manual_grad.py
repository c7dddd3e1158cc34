"""The (Double) DQN loss of client/trainers/dqn.py with its gradient derived by hand, eager or compiled ahead.

``q_loss_manual_grad`` returns what ``q_loss`` returns and writes the same gradient into the online
``QNetwork``'s ``.grad`` without recording an autograd graph.  At CartPole sizes a step is a few dozen
tiny ops, so on the CPU the graph is most of the cost of ``q_loss`` + ``backward``: the hand-derived
pass is faster there (bench/bench_trainers.py measures it; tests/test_trainers_dqn.py checks that the
numbers are the same).  ``q_loss_grads`` is that math as a pure function of tensors, which
``CompiledFunction`` (client/trainers/compiled.py) compiles ahead with inductor: faster again on the
CPU, at the price of a C++ compiler and seconds of compiling per batch shape and loss setting.

``ManualGradLoss`` and ``CompiledManualGradLoss`` are ``DQNTrainer``'s ``loss_strategy="manual"`` and
``loss_strategy="compiled"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replayd.client.trainers.compiled import CompiledFunction
from replayd.client.trainers.q_network import QNetwork, as_dtype, check_action, check_loss, flat_obs

__all__ = ["CompiledManualGradLoss", "ManualGradLoss", "q_loss_grads", "q_loss_grads_flat", "q_loss_manual_grad"]


class ManualGradLoss:
    """``loss_strategy="manual"``: ``q_loss_manual_grad``, eager.  Only for a ``QNetwork``."""

    name = "manual"

    def __init__(self, online: nn.Module) -> None:
        _require_qnetwork(self.name, online)

    def loss_and_grads(self, online: nn.Module, target: nn.Module, batch: Mapping[str, Tensor], double: bool,
                       loss_type: str, huber_delta: float) -> tuple[Tensor, Tensor, Tensor]:
        return q_loss_manual_grad(online, target, batch, double, loss_type, huber_delta)


class CompiledManualGradLoss:
    """``loss_strategy="compiled"``: ``q_loss_manual_grad`` through ``q_loss_grads`` compiled ahead by inductor,
    one graph per batch signature and loss setting.  Only for a ``QNetwork`` on the CPU, where it is
    measured; compiling needs a C++ compiler."""

    name = "compiled"

    def __init__(self, online: nn.Module, device: torch.device) -> None:
        _require_qnetwork(self.name, online)
        if device.type != "cpu":
            raise ValueError(f"loss_strategy='compiled' runs on the CPU only, got device {device}")
        self.compiled = CompiledFunction(q_loss_grads_flat)

    def loss_and_grads(self, online: nn.Module, target: nn.Module, batch: Mapping[str, Tensor], double: bool,
                       loss_type: str, huber_delta: float) -> tuple[Tensor, Tensor, Tensor]:
        return q_loss_manual_grad(online, target, batch, double, loss_type, huber_delta, self.compiled)


def _require_qnetwork(strategy: str, online: nn.Module) -> None:
    if not isinstance(online, QNetwork):
        raise ValueError(f"loss_strategy={strategy!r} needs a QNetwork, got {type(online).__name__}")


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
    and loss setting; ``CompiledManualGradLoss`` keeps one).
    """
    check_loss(loss_type, huber_delta)
    if not (isinstance(online, QNetwork) and isinstance(target, QNetwork)):
        raise TypeError(f"q_loss_manual_grad needs QNetworks, got {type(online).__name__} and {type(target).__name__}")
    obs = flat_obs(batch["obs"], online.weights_and_biases[0][0].dtype)  # (B, obs_dim)
    boot_obs = flat_obs(batch["bootstrap_obs"], obs.dtype)  # (B, obs_dim)
    action = batch["action"]
    check_action(action)
    action = (action if action.dtype == torch.int64 else action.long()).view(-1, 1)  # (B, 1)
    n_step_return = as_dtype(batch["n_step_return"], obs.dtype)  # (B,)
    discount = as_dtype(batch["bootstrap_discount"], obs.dtype)  # (B,)
    weight = as_dtype(batch.get("weight"), obs.dtype)  # (B,) or None
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


def _accumulate_grad(p: Tensor, grad: Tensor) -> None:
    """p.grad += grad, as autograd does: not for a parameter frozen with requires_grad=False."""
    if not p.requires_grad:
        return
    if p.grad is None:
        p.grad = grad
    else:
        p.grad.add_(grad)
