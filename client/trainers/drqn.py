"""Recurrent Q-learning (DRQN with R2D2's stored state, burn-in and priorities) on replayd `Sequences`
batches (CleanRL style: the whole loss is ``r2d2_loss``).

Batch fields used (dict of tensors, first axes (B, T), T = burn_in + length, on the device):

* ``obs`` (B, T, *S): consecutive observations of one episode per sequence (zeros after its final one)
* ``action`` (B, T) integer; ``mask`` (B, T) bool: the row is a step of the episode (it has a successor)
* ``h`` (B, T, H): the recurrent state the actor held before it saw each row's observation (the field is
  ``state_field``); only ``h[:, 0]`` is read, as the sequence's initial state
* ``n_step_return`` (B, T) = sum_{k<n_eff} γ^k r_{t+k}; ``bootstrap_discount`` (B, T) = γ^n_eff, or 0 when the
  episode terminated within those steps; ``bootstrap_step`` (B, T) = t + n_eff, the row of the bootstrap
  observation in the sequence (>= T: beyond it)
* optional ``weight`` (B,): importance weights of prioritized sampling (one per sequence)

The first ``burn_in`` rows only warm up the recurrent state (no loss, no gradient); the other
``length`` rows are unrolled with gradient. Target of row t: ``y_t = n_step_return_t + bootstrap_discount_t *
Q_target(s_b, a*)`` at b = bootstrap_step_t, from the target network unrolled over the same sequence from the
same stored state, with ``a* = argmax_a Q_online(s_b, a)`` (Double DQN) or ``argmax_a Q_target(s_b, a)``. A row
is trained when it is a step (``mask``) whose target the batch holds: its bootstrap row lies within the
sequence, or the episode terminated first (discount 0, nothing to bootstrap).
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replayd.client.trainers.dqn import update_target
from replayd.client.trainers.q_network import check_action, check_epsilon, check_loss, epsilon_greedy
from replayd.client.trainers.settings import check_max_grad_norm, check_positive

__all__ = ["DRQNTrainer", "RecurrentQNetwork", "r2d2_loss"]


class RecurrentQNetwork(nn.Module):
    """obs (B, T, *S) and state (B, H) -> Q (B, T, n_actions) and the state after the last row: an MLP encoder
    (ReLU), a GRU of `hidden` units, a linear Q head."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64, encoder: Sequence[int] = (64,)) -> None:
        super().__init__()
        if obs_dim < 1 or n_actions < 1 or hidden < 1:
            raise ValueError(f"obs_dim, n_actions and hidden must be >= 1, got {obs_dim}, {n_actions}, {hidden}")
        dims = [obs_dim, *encoder]
        self.encoder = nn.Sequential(*itertools.chain.from_iterable(
            (nn.Linear(a, b), nn.ReLU()) for a, b in itertools.pairwise(dims)))
        self.gru = nn.GRU(dims[-1], hidden, batch_first=True)
        self.head = nn.Linear(hidden, n_actions)
        self.obs_dim, self.n_actions, self.hidden_size = obs_dim, n_actions, hidden

    def initial_state(self, batch_size: int) -> Tensor:
        """The state at an episode's start: zeros (batch_size, hidden), on the network's device."""
        return self.head.weight.new_zeros(batch_size, self.hidden_size)

    def forward(self, obs: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        x = obs.reshape(*obs.shape[:2], -1).to(self.head.weight.dtype)  # (B, T, obs_dim)
        x = self.encoder(x)  # (B, T, E)
        out, last = self.gru(x, state.unsqueeze(0).contiguous())  # (B, T, H), (1, B, H)
        return self.head(out), last.squeeze(0)  # (B, T, A), (B, H)


def r2d2_loss(
    online: RecurrentQNetwork,
    target: RecurrentQNetwork,
    batch: Mapping[str, Tensor],
    burn_in: int,
    double: bool = True,
    eta: float = 0.9,
    huber_delta: float = 1.0,
    state_field: str = "h",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """R2D2's loss on a batch of sequences. Returns (loss (), td_error (B, L) detached, 0 on rows not trained,
    priority (B,) = eta * max_t |td| + (1 - eta) * mean_t |td| over each sequence's trained rows, mean_q ()
    over the trained rows), L = T - burn_in. The loss is the Huber loss of td, weighted by the sequence's
    importance weight, averaged over the batch's trained rows; gradient flows only through Q_online of the
    trained rows (the burn-in and the stored state carry none)."""
    obs, action = batch["obs"], batch["action"]  # (B, T, *S), (B, T)
    check_action(action)
    T = obs.shape[1]
    L = T - burn_in
    state = batch[state_field][:, 0]  # (B, H) the actor's state before row 0

    online_state = state  # (B, H)
    if burn_in:
        with torch.no_grad():  # burn-in: warm the state up on rows that are not trained
            _, online_state = online(obs[:, :burn_in], state)  # (B, H)
    q = online(obs[:, burn_in:], online_state)[0]  # (B, L, A) with gradient
    q_taken = q.gather(2, action[:, burn_in:].long().unsqueeze(2)).squeeze(2)  # (B, L)

    dtype = q_taken.dtype
    n_step_return = batch["n_step_return"][:, burn_in:].to(dtype)  # (B, L)
    discount = batch["bootstrap_discount"][:, burn_in:].to(dtype)  # (B, L)
    boot_row = batch["bootstrap_step"][:, burn_in:].long() - burn_in  # (B, L) row in the unrolled part
    inside = boot_row < L  # (B, L) the bootstrap observation is in this sequence
    valid = batch["mask"][:, burn_in:] & (inside | (discount == 0))  # (B, L) rows with a target
    rows = boot_row.clamp(0, L - 1).unsqueeze(2).expand(-1, -1, q.shape[2])  # (B, L, A) gather index

    with torch.no_grad():
        q_target = target(obs, state)[0][:, burn_in:]  # (B, L, A) unrolled through the burn-in too
        q_target_boot = q_target.gather(1, rows)  # (B, L, A) Q_target(s_b, .)
        if double:
            boot_action = q.detach().gather(1, rows).argmax(2, keepdim=True)  # (B, L, 1) argmax Q_online(s_b, .)
            boot_value = q_target_boot.gather(2, boot_action).squeeze(2)  # (B, L)
        else:
            boot_value = q_target_boot.max(2).values  # (B, L)
        boot_value = torch.where(inside, boot_value, torch.zeros_like(boot_value))  # (B, L) 0 beyond the sequence
        y = n_step_return + discount * boot_value  # (B, L)
        td = torch.where(valid, q_taken.detach() - y, torch.zeros_like(y))  # (B, L)

    weight = batch.get("weight")  # (B,) or None
    per_row = F.huber_loss(q_taken, y, reduction="none", delta=huber_delta) * valid  # (B, L)
    if weight is not None:
        per_row = per_row * weight.to(dtype).unsqueeze(1)  # (B, L)
    trained = valid.sum(1)  # (B,) trained rows per sequence
    loss = per_row.sum() / trained.sum().clamp(min=1)  # ()

    abs_td = td.abs()  # (B, L)
    priority = eta * abs_td.max(1).values + (1 - eta) * abs_td.sum(1) / trained.clamp(min=1)  # (B,)
    mean_q = (q_taken.detach() * valid).sum() / trained.sum().clamp(min=1)  # ()
    return loss, td, priority, mean_q


class DRQNTrainer:
    """Online + target recurrent Q-networks and Adam, trained by ``r2d2_loss`` on sequences of
    ``burn_in + length`` rows; the target network is copied every ``target_update_every`` steps."""

    def __init__(
        self,
        obs_dim: int,
        n_actions: int,
        burn_in: int,
        hidden: int = 64,
        encoder: Sequence[int] = (64,),
        lr: float = 1e-3,
        double: bool = True,
        eta: float = 0.9,
        huber_delta: float = 1.0,
        target_update_every: int = 500,
        max_grad_norm: float | None = 10.0,
        state_field: str = "h",
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value, least in (("burn_in", burn_in, 0), ("target_update_every", target_update_every, 1)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta must be in [0, 1], got {eta!r}")
        check_positive("lr", lr)
        check_max_grad_norm(max_grad_norm)
        check_loss("huber", huber_delta)
        self.device = torch.device(device)
        self.online = RecurrentQNetwork(obs_dim, n_actions, hidden, encoder).to(self.device)
        self.target = RecurrentQNetwork(obs_dim, n_actions, hidden, encoder).to(self.device)
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=lr)
        self.burn_in, self.double, self.eta, self.huber_delta = burn_in, double, eta, huber_delta
        self.target_update_every, self.max_grad_norm, self.state_field = target_update_every, max_grad_norm, state_field
        self.steps = 0

    def check_batch(self, batch: Mapping[str, Tensor]) -> None:
        """Refuses a batch whose sequences leave no row to train after the burn-in, or whose stored state does
        not fit the network (a ValueError naming the field, expected and got)."""
        obs, state = batch["obs"], batch[self.state_field]
        if obs.dim() < 3 or obs.shape[1] <= self.burn_in:
            raise ValueError(f"batch['obs']: expected (B, T, *S) with T > burn_in = {self.burn_in}, "
                             f"got shape {tuple(obs.shape)}")
        expected = (obs.shape[0], obs.shape[1], self.online.hidden_size)
        if tuple(state.shape) != expected:
            raise ValueError(f"batch[{self.state_field!r}]: expected shape {expected} (the stored recurrent state), "
                             f"got {tuple(state.shape)}")

    def step(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """One gradient step. Returns loss, mean_q, td_error (B, L) and priority (B,) (detached: the sequences'
        new priorities for ``update_priorities``, keyed by ``batch["key"]``)."""
        self.check_batch(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss, td, priority, mean_q = r2d2_loss(self.online, self.target, batch, self.burn_in, self.double, self.eta,
                                               self.huber_delta, self.state_field)
        loss.backward()
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.online.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.target_update_every == 0:
            update_target(self.online, self.target)
        return {"loss": loss.detach(), "mean_q": mean_q, "td_error": td, "priority": priority}

    @torch.no_grad()
    def act(self, obs: Tensor, state: Tensor, epsilon: float = 0.0) -> tuple[Tensor, Tensor]:
        """Epsilon-greedy actions (B,) for one step's obs (B, *S) from the states (B, H) held before it; returns
        them with the states after it (what the next step acts from)."""
        check_epsilon(epsilon)
        q, next_state = self.online(obs.to(self.device).unsqueeze(1), state.to(self.device))  # (B, 1, A), (B, H)
        return epsilon_greedy(q[:, 0], epsilon), next_state
