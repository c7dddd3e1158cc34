"""ALLO: Augmented Lagrangian Laplacian Objective (Gomez, Bowling & Machado, ICLR 2024).

Learns phi: state -> R^d whose i-th output approximates the i-th smallest eigenvector of the graph
Laplacian of the sampling process.  Per step it consumes

* one geometric-pair batch ``{"obs": s (B, *S), "future_obs": s' (B, *S), "offset": (B,)}``,
* two independent uniform-state batches ``u1``, ``u2`` (each ``{"obs": (n, *S)}`` or a tensor).

Loss (everything in one function, ``allo_loss``)::

    graph   = sum_j mean_i (phi_j(s_i) - phi_j(s'_i))^2
    E_k     = tril(Phi_k^T sg(Phi_k) / n - I)             Phi_k = phi(u_k)  (n, d)
    dual    = sum(sg(beta) * (E1 + E2) / 2)
    barrier = sg(b) * sum(E1 * E2)
    total   = graph + dual + barrier

The duals ``beta`` (d, d lower-triangular) and barrier coefficient ``b`` are updated outside autodiff::

    beta <- clip(beta + lr_beta * tril((E1 + E2) / 2), -100, 100)
    b    <- clip(b + lr_b * mean(max(E1 * E2, 0)), 0, b_max)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from replayd.client.trainers.settings import check_non_negative, check_positive

__all__ = ["AlloEncoder", "AlloTrainer", "allo_loss", "default_single_call", "update_duals_and_barrier"]


class AlloEncoder(nn.Module):
    """MLP encoder phi: obs (B, obs_dim) -> (B, d)."""

    def __init__(self, obs_dim: int, d: int, hidden: Sequence[int] = (256, 256, 256)) -> None:
        super().__init__()
        if obs_dim < 1 or d < 1:
            raise ValueError(f"obs_dim and d must be >= 1, got {obs_dim}, {d}")
        layers: list[nn.Module] = []
        last = obs_dim
        for h in hidden:
            layers += [nn.Linear(last, h), nn.ReLU()]
            last = h
        layers.append(nn.Linear(last, d))
        self.net = nn.Sequential(*layers)
        self.obs_dim = obs_dim
        self.d = d

    def forward(self, obs: Tensor) -> Tensor:
        return self.net(obs.reshape(obs.shape[0], -1).float())


def default_single_call(device: torch.device | str) -> bool:
    """Whether one encoder call over ``cat([s, s', u1, u2])`` is the faster choice on ``device``.

    bench/bench_trainers.py measures both (loss forward+backward, encoder 2-256-256-256-10): on a CPU
    one call is no faster at 256 rows per part and slower at 1024, since the cat copy and the larger
    GEMMs cost more than the saved per-call overhead, so CPU defaults to separate calls.  On CUDA a
    step at these sizes is kernel-launch bound, so one call (a quarter of the launches) is the
    default there; bench/gpu_check.py reports both variants on a GPU.
    """
    return torch.device(device).type != "cpu"


def _states(x: Mapping[str, Tensor] | Tensor) -> Tensor:
    return x["obs"] if isinstance(x, Mapping) else x


def allo_loss(
    encoder: nn.Module,
    obs: Tensor,
    future_obs: Tensor,
    u1: Tensor,
    u2: Tensor,
    beta: Tensor,
    barrier: Tensor,
    single_call: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """ALLO loss.  Returns (total loss, aux tensors: graph, dual, barrier, E1, E2, phi_u1).

    obs, future_obs: (B, *S); u1, u2: (n, *S); beta: (d, d); barrier: () or (1,).
    """
    B, n = obs.shape[0], u1.shape[0]
    if future_obs.shape[0] != B or u2.shape[0] != n:
        raise ValueError(
            f"batch sizes must match pairwise: obs {B} vs future_obs {future_obs.shape[0]}, u1 {n} vs u2 {u2.shape[0]}"
        )
    if single_call:
        phi_all = encoder(torch.cat([obs, future_obs, u1, u2]))  # (2B + 2n, d)
        phi_s, phi_next, phi_u1, phi_u2 = phi_all.split([B, B, n, n])
    else:
        phi_s, phi_next = encoder(obs), encoder(future_obs)  # (B, d) each
        phi_u1, phi_u2 = encoder(u1), encoder(u2)  # (n, d) each
    d = phi_s.shape[1]

    # Graph-drawing term: sum over dimensions of the mean squared difference along pairs.
    graph = (phi_s - phi_next).pow(2).mean(0).sum()  # ()

    # Orthonormality errors with the stop-gradient on the right factor (this is what makes the
    # eigenvectors, in order, the unique stable equilibrium).
    eye = torch.eye(d, device=phi_u1.device, dtype=phi_u1.dtype)
    E1 = torch.tril(phi_u1.T @ phi_u1.detach() / n - eye)  # (d, d)
    E2 = torch.tril(phi_u2.T @ phi_u2.detach() / n - eye)  # (d, d)

    dual = (beta.detach() * (E1 + E2) / 2).sum()  # ()
    barrier_term = barrier.detach().reshape(()) * (E1 * E2).sum()  # ()
    total = graph + dual + barrier_term
    aux = {"graph": graph, "dual": dual, "barrier": barrier_term, "E1": E1, "E2": E2, "phi_u1": phi_u1}
    return total, aux


@torch.no_grad()
def update_duals_and_barrier(
    beta: Tensor,
    barrier: Tensor,
    E1: Tensor,
    E2: Tensor,
    lr_beta: float,
    lr_barrier: float,
    barrier_max: float,
    beta_clip: float = 100.0,
) -> tuple[Tensor, Tensor]:
    """One (projected) gradient-ascent step on duals and barrier; returns new tensors (no autodiff).

    beta <- clip(beta + lr_beta * tril((E1+E2)/2), -beta_clip, beta_clip)
    b    <- clip(b + lr_barrier * mean(max(E1*E2, 0)), 0, barrier_max)

    The barrier grows by the mean of the positive entries of E1*E2, as the authors' code does
    (``update_barrier_coefficients``: each entry clipped at 0, then the mean); negative entries do not
    cancel positive ones.
    """
    E1, E2 = E1.detach(), E2.detach()
    new_beta = torch.clamp(beta + lr_beta * torch.tril((E1 + E2) / 2), -beta_clip, beta_clip)
    new_barrier = torch.clamp(barrier + lr_barrier * torch.clamp(E1 * E2, min=0.0).mean(), 0.0, barrier_max)
    return new_beta, new_barrier


class AlloTrainer:
    """Encoder + Adam + duals/barrier.  ``step(pair_batch, u1, u2)`` does one ALLO update.

    Defaults follow the authors' configuration (tarod13/laplacian_dual_dynamics, ``al.yaml``): Adam
    lr 1e-3, dual lr 1e-4 with duals clipped to [-100, 100], barrier starting at 1.0.  One departure:
    the barrier stays fixed (``lr_barrier`` 0) unless asked.  Their growth rate (1.0) sends it to ~45
    within the first 2000 steps on four rooms, while the freshly initialized encoder violates the
    constraints, and learning then slows to a crawl.  The value matters too: with a fixed 2.0, one
    four-rooms seed kept a near-degenerate pair of dimensions swapped through 10000 steps, with 1.0 it
    sorted them out by step 5000 (bench/allo_paper_check.py; presumably less barrier noise in the
    gradients Adam normalizes by, against an eigenvalue gap of ~0.01).

    ``barrier_init`` must lie in [0, ``barrier_max``], the range every step clips the barrier to.
    """

    def __init__(
        self,
        obs_dim: int,
        d: int,
        hidden: Sequence[int] = (256, 256, 256),
        lr: float = 1e-3,
        lr_beta: float = 1e-4,
        lr_barrier: float = 0.0,
        barrier_init: float = 1.0,
        barrier_max: float = 1e4,
        single_call: bool | None = None,
        device: torch.device | str = "cpu",
        encoder: nn.Module | None = None,
    ) -> None:
        check_positive("lr", lr)
        check_non_negative("lr_beta", lr_beta)  # 0 keeps them fixed; negative would descend on the duals
        check_non_negative("lr_barrier", lr_barrier)
        # The barrier is clipped to [0, barrier_max] after every step: a barrier_init outside it would be
        # replaced at the first step, and a negative barrier_max would make the barrier negative.
        if not barrier_max >= 0:
            raise ValueError(f"barrier_max must be >= 0, got {barrier_max!r}")
        if not (math.isfinite(barrier_init) and 0 <= barrier_init <= barrier_max):
            raise ValueError(f"barrier_init must be in [0, barrier_max={barrier_max!r}], got {barrier_init!r}")
        self.device = torch.device(device)
        self.encoder = (encoder if encoder is not None else AlloEncoder(obs_dim, d, hidden)).to(self.device)
        self.optimizer = torch.optim.Adam(self.encoder.parameters(), lr=lr)
        self.d = d
        self.beta = torch.zeros(d, d, device=self.device)
        self.barrier = torch.tensor(float(barrier_init), device=self.device)
        self.lr_beta, self.lr_barrier, self.barrier_max = lr_beta, lr_barrier, barrier_max
        self.single_call = default_single_call(self.device) if single_call is None else single_call
        self.steps = 0

    def step(
        self,
        pair_batch: Mapping[str, Tensor],
        u1: Mapping[str, Tensor] | Tensor,
        u2: Mapping[str, Tensor] | Tensor,
    ) -> dict[str, Tensor]:
        """One update; returns detached scalar tensors (no host sync): loss, graph, dual, barrier, barrier_coef."""
        loss, aux = allo_loss(
            self.encoder,
            pair_batch["obs"],
            pair_batch["future_obs"],
            _states(u1),
            _states(u2),
            self.beta,
            self.barrier,
            single_call=self.single_call,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.beta, self.barrier = update_duals_and_barrier(
            self.beta, self.barrier, aux["E1"], aux["E2"], self.lr_beta, self.lr_barrier, self.barrier_max
        )
        self.steps += 1
        return {
            "loss": loss.detach(),
            "graph": aux["graph"].detach(),
            "dual": aux["dual"].detach(),
            "barrier": aux["barrier"].detach(),
            "barrier_coef": self.barrier.clone(),
        }

    @torch.no_grad()
    def encode(self, obs: Tensor) -> Tensor:
        """phi(obs) without grad, (N, d)."""
        return self.encoder(obs.to(self.device))
