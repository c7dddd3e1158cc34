"""The Q-network of client/trainers/dqn.py and the batch checks and casts its losses share.

``QNetwork`` is the MLP that ``DQNTrainer`` builds and the DQN actor acts with; it keeps cached
views of its weights for the graph-free passes of client/trainers/dqn_manual_grad.py.
``check_loss``, ``check_action``, ``as_dtype`` and ``flat_obs`` validate and cast a batch the same
way for ``q_loss`` (dqn.py) and ``q_loss_manual_grad`` (dqn_manual_grad.py), which both import
this module.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["QNetwork", "as_dtype", "check_action", "check_loss", "flat_obs"]


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
        x = flat_obs(obs, wb[0][0].dtype)  # (B, obs_dim)
        for w, b in wb[:-1]:
            x = torch.relu(F.linear(x, w, b))  # (B, hidden)
        return F.linear(x, *wb[-1])  # (B, n_actions)


def _refresh_after_load(network: QNetwork, incompatible_keys: object) -> None:
    network._refresh_cache()


def check_epsilon(epsilon: float) -> None:
    """ValueError unless `epsilon` is in [0, 1] (NaN or below 0 would act greedily, above 1 as 1)."""
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")


def epsilon_greedy(q: Tensor, epsilon: float) -> Tensor:
    """Actions (B,) from Q-values q (B, A): each a uniform random action with probability `epsilon`, else the
    greedy one."""
    greedy = q.argmax(1)  # (B,)
    if epsilon <= 0.0:
        return greedy
    random = torch.randint(q.shape[1], greedy.shape, device=q.device)  # (B,)
    explore = torch.rand(greedy.shape, device=q.device) < epsilon  # (B,)
    return torch.where(explore, random, greedy)


def check_loss(loss_type: str, huber_delta: float) -> None:
    """Refuses a ``loss_type`` other than "mse" or "huber" and a ``huber_delta`` that is not finite and > 0."""
    if loss_type not in ("mse", "huber"):
        raise ValueError(f"loss_type must be 'mse' or 'huber', got {loss_type!r}")
    if not (math.isfinite(huber_delta) and huber_delta > 0):
        raise ValueError(f"huber_delta must be finite and > 0, got {huber_delta!r}")


def check_action(action: Tensor) -> None:
    """Refuses float (or bool) actions: ``.long()`` would truncate 1.7 to action 1 without a word."""
    if action.dtype.is_floating_point or action.dtype.is_complex or action.dtype == torch.bool:
        raise ValueError(f"batch['action']: expected an integer dtype, got {str(action.dtype).removeprefix('torch.')}")


def as_dtype(x: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The batch's float fields in the network's dtype (the server sends float32; no copy when equal)."""
    return x if x is None or x.dtype == dtype else x.to(dtype)


def flat_obs(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, *S) -> (B, obs_dim) in the network's dtype (no copy when already so)."""
    if x.dim() != 2:
        x = x.reshape(x.shape[0], -1)
    return x if x.dtype == dtype else x.to(dtype)
