"""PPO (clipped surrogate) on replayd minibatches, CleanRL style: the whole loss is ``ppo_loss``.

Minibatch fields (dict of tensors, first axis B): ``obs`` (B, *S), ``action`` (B,) int64 for discrete
or (B, A) float32 for continuous, ``log_prob`` (B,) (behaviour policy), ``value`` (B,) (old value),
``advantage`` (B,), ``return`` (B,).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Normal

from replayd.client.trainers.settings import check_max_grad_norm, check_non_negative, check_positive

__all__ = ["ActorCritic", "PPOTrainer", "ppo_loss"]


def _mlp(in_dim: int, hidden: Sequence[int], out_dim: int, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    last = in_dim
    for h in hidden:
        lin = nn.Linear(last, h)
        nn.init.orthogonal_(lin.weight, 2**0.5)
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.Tanh()]
        last = h
    head = nn.Linear(last, out_dim)
    nn.init.orthogonal_(head.weight, out_gain)
    nn.init.zeros_(head.bias)
    layers.append(head)
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs (tanh, orthogonal init as in CleanRL).

    Discrete (``continuous=False``): Categorical over ``action_dim`` logits.
    Continuous: diagonal Normal with a state-independent learned log-std.
    """

    def __init__(
        self, obs_dim: int, action_dim: int, hidden: Sequence[int] = (64, 64), continuous: bool = False
    ) -> None:
        super().__init__()
        if obs_dim < 1 or action_dim < 1:
            raise ValueError(f"obs_dim and action_dim must be >= 1, got {obs_dim}, {action_dim}")
        self.continuous = continuous
        self.actor = _mlp(obs_dim, hidden, action_dim, 0.01)
        self.critic = _mlp(obs_dim, hidden, 1, 1.0)
        self.log_std = nn.Parameter(torch.zeros(action_dim)) if continuous else None

    def _flat(self, obs: Tensor) -> Tensor:
        """(B, *S) -> (B, obs_dim) in the parameters' dtype (uint8 or float32 observations, float64 models)."""
        return obs.reshape(obs.shape[0], -1).to(self.critic[0].weight.dtype)

    def distribution(self, obs: Tensor) -> Distribution:
        out = self.actor(self._flat(obs))  # (B, A)
        if self.log_std is None:
            return Categorical(logits=out)
        return Normal(out, self.log_std.exp().expand_as(out))

    def value(self, obs: Tensor) -> Tensor:
        return self.critic(self._flat(obs)).squeeze(-1)  # (B,)

    def forward(self, obs: Tensor) -> tuple[Distribution, Tensor]:
        return self.distribution(obs), self.value(obs)


def ppo_loss(
    model: ActorCritic,
    batch: Mapping[str, Tensor],
    clip_coef: float = 0.2,
    vf_coef: float = 0.5,
    ent_coef: float = 0.01,
    clip_vloss: bool = True,
    norm_adv: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO loss = pg_loss - ent_coef * entropy + vf_coef * v_loss.  Returns (loss, detached stats)."""
    dist, new_value = model(batch["obs"])  # dist over (B, ...), new_value (B,)
    action = batch["action"]
    # (B, A) continuous or (B,) discrete: a (B,) action for A = 1, or a (B, 1) discrete one (a schema's
    # shape (1,)), would broadcast log_prob to (B, B) without an error.
    action = action.reshape(dist.mean.shape if model.continuous else dist.batch_shape)
    new_log_prob = dist.log_prob(action)  # (B,) or (B, A)
    entropy = dist.entropy()  # (B,) or (B, A)
    if model.continuous:
        new_log_prob, entropy = new_log_prob.sum(-1), entropy.sum(-1)  # (B,)

    # The per-sample columns as (B,): a (B, 1) one (a schema's shape (1,)) would broadcast against the
    # (B,) new log-prob and value to (B, B) without an error; one not holding B values raises here.
    old_log_prob, adv, ret, old_value = (batch[name].reshape(new_value.shape)
                                         for name in ("log_prob", "advantage", "return", "value"))
    log_ratio = new_log_prob - old_log_prob  # (B,)
    ratio = log_ratio.exp()  # (B,)
    if norm_adv and adv.numel() > 1:
        # In float64 (as the server's normalization): float32's rounding of the mean of equal advantages
        # is as large as the 1e-8, and would turn them into ~0.8 instead of 0.
        adv64 = adv.double()
        adv = ((adv64 - adv64.mean()) / (adv64.std() + 1e-8)).to(adv.dtype)

    # Clipped surrogate (minimize the negative of the pessimistic objective).
    pg_loss = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()

    # Value loss, optionally clipped around the old value.
    if clip_vloss:
        v_clipped = old_value + torch.clamp(new_value - old_value, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((new_value - ret).square(), (v_clipped - ret).square()).mean()
    else:
        v_loss = 0.5 * (new_value - ret).square().mean()

    entropy_mean = entropy.mean()
    loss = pg_loss - ent_coef * entropy_mean + vf_coef * v_loss
    with torch.no_grad():
        stats = {
            "pg_loss": pg_loss.detach(),
            "v_loss": v_loss.detach(),
            "entropy": entropy_mean.detach(),
            "approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_coef).float().mean(),
        }
    return loss, stats


class PPOTrainer:
    """ActorCritic + Adam; ``step(minibatch)`` does one clipped-PPO gradient step."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden: Sequence[int] = (64, 64),
        continuous: bool = False,
        lr: float = 2.5e-4,
        clip_coef: float = 0.2,
        vf_coef: float = 0.5,
        ent_coef: float = 0.01,
        clip_vloss: bool = True,
        norm_adv: bool = True,
        max_grad_norm: float | None = 0.5,
        device: torch.device | str = "cpu",
    ) -> None:
        check_positive("lr", lr)
        check_positive("clip_coef", clip_coef)  # a negative one inverts the clip range
        check_non_negative("vf_coef", vf_coef)  # negative: the loss would push that term the wrong way
        check_non_negative("ent_coef", ent_coef)
        check_max_grad_norm(max_grad_norm)
        self.device = torch.device(device)
        self.model = ActorCritic(obs_dim, action_dim, hidden, continuous).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, eps=1e-5)
        self.clip_coef, self.vf_coef, self.ent_coef = clip_coef, vf_coef, ent_coef
        self.clip_vloss, self.norm_adv, self.max_grad_norm = clip_vloss, norm_adv, max_grad_norm

    def step(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """One update; returns detached device tensors (no host sync)."""
        loss, stats = ppo_loss(
            self.model, batch, self.clip_coef, self.vf_coef, self.ent_coef, self.clip_vloss, self.norm_adv
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return {"loss": loss.detach(), **stats}

    @torch.no_grad()
    def act(self, obs: Tensor) -> dict[str, Tensor]:
        """Sample actions; returns action, log_prob, value (what a rollout stores)."""
        dist, value = self.model(obs.to(self.device))
        action = dist.sample()
        log_prob = dist.log_prob(action)
        if self.model.continuous:
            log_prob = log_prob.sum(-1)
        return {"action": action, "log_prob": log_prob, "value": value}
