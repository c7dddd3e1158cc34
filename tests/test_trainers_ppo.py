"""PPO loss vs a plain reference on fixed tensors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from replayd.client.trainers.ppo import ActorCritic, PPOTrainer, ppo_loss

B, OBS, A = 64, 5, 3


def _batch(model: ActorCritic, seed: int = 0, continuous: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(B, OBS, generator=g)
    if continuous:
        action = torch.randn(B, A, generator=g)
    else:
        action = torch.randint(A, (B,), generator=g)
    with torch.no_grad():
        dist, value = model(obs)
        lp = dist.log_prob(action)
        lp = lp.sum(-1) if continuous else lp
    # Perturb the behaviour log-probs / old values so that clipping is active on some rows.
    return {
        "obs": obs,
        "action": action,
        "log_prob": lp + 0.5 * torch.randn(B, generator=g),
        "value": value + 0.5 * torch.randn(B, generator=g),
        "advantage": torch.randn(B, generator=g),
        "return": torch.randn(B, generator=g),
    }


def reference_discrete(model, batch, clip=0.2, vf=0.5, ent=0.01, clip_vloss=True):
    logits = model.actor(batch["obs"])
    logp_all = torch.log_softmax(logits, dim=1)
    new_lp = logp_all[torch.arange(B), batch["action"]]
    entropy = -(logp_all.exp() * logp_all).sum(1).mean()
    v = model.critic(batch["obs"]).squeeze(1)
    adv = batch["advantage"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = torch.exp(new_lp - batch["log_prob"])
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    pg = -surr.mean()
    if clip_vloss:
        vc = batch["value"] + torch.clamp(v - batch["value"], -clip, clip)
        vl = 0.5 * torch.maximum((v - batch["return"]) ** 2, (vc - batch["return"]) ** 2).mean()
    else:
        vl = 0.5 * ((v - batch["return"]) ** 2).mean()
    return pg - ent * entropy + vf * vl, ratio


@pytest.mark.parametrize("clip_vloss", [True, False])
def test_discrete_loss_and_grads_match_reference(clip_vloss):
    torch.manual_seed(0)
    model = ActorCritic(OBS, A)
    batch = _batch(model)
    loss, stats = ppo_loss(model, batch, clip_vloss=clip_vloss)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref, ratio = reference_discrete(model, batch, clip_vloss=clip_vloss)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    # The fixture really exercises clipping.
    assert 0 < stats["clipfrac"].item() < 1
    torch.testing.assert_close(stats["clipfrac"], ((ratio - 1).abs() > 0.2).float().mean())


def test_hand_computed_surrogate():
    # One action, fixed logits: pg term by hand for a clipped and an unclipped row.
    model = ActorCritic(1, 2, hidden=())
    with torch.no_grad():
        model.actor[0].weight.zero_()
        model.actor[0].bias.copy_(torch.tensor([0.0, 0.0]))  # pi = (0.5, 0.5)
        model.critic[0].weight.zero_()
        model.critic[0].bias.zero_()
    batch = {
        "obs": torch.zeros(2, 1),
        "action": torch.tensor([0, 1]),
        "log_prob": torch.tensor([math.log(0.25), math.log(0.5)]),  # ratios 2.0 and 1.0
        "value": torch.zeros(2),
        "advantage": torch.tensor([1.0, -1.0]),
        "return": torch.tensor([1.0, 1.0]),
    }
    loss, stats = ppo_loss(model, batch, clip_coef=0.2, vf_coef=0.5, ent_coef=0.0, norm_adv=False)
    # row 0: min(2*1, 1.2*1) = 1.2; row 1: min(1*-1, 1*-1) = -1 -> pg = -(1.2 - 1)/2 = -0.1
    torch.testing.assert_close(stats["pg_loss"], torch.tensor(-0.1))
    # value 0 vs return 1 (clip doesn't change 0): 0.5 * 1 = 0.5
    torch.testing.assert_close(stats["v_loss"], torch.tensor(0.5))
    torch.testing.assert_close(loss, torch.tensor(-0.1 + 0.25))
    torch.testing.assert_close(stats["entropy"], torch.tensor(math.log(2.0)))
    # approx_kl = mean((ratio - 1) - log ratio), the low-variance KL(old || new) estimator.
    torch.testing.assert_close(stats["approx_kl"], torch.tensor(((2.0 - 1 - math.log(2.0)) + 0.0) / 2))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(0.5))  # |ratio - 1| > 0.2 on row 0


def test_continuous_loss_runs_and_matches_normal_formula():
    torch.manual_seed(0)
    model = ActorCritic(OBS, A, continuous=True)
    batch = _batch(model, continuous=True)
    loss, _ = ppo_loss(model, batch, ent_coef=0.0, vf_coef=0.0, norm_adv=False)
    mean = model.actor(batch["obs"])
    std = model.log_std.exp()
    lp = (-((batch["action"] - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).sum(1)
    ratio = torch.exp(lp - batch["log_prob"])
    adv = batch["advantage"]
    ref = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)


def test_one_dimensional_continuous_actions_may_come_flat():
    """Action (B,) for action_dim 1 (e.g. Pendulum): the same loss as (B, 1), not a (B, B) broadcast."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, 1, continuous=True)
    g = torch.Generator().manual_seed(1)
    batch = {"obs": torch.randn(B, OBS, generator=g), "action": torch.randn(B, 1, generator=g),
             "log_prob": torch.randn(B, generator=g), "value": torch.randn(B, generator=g),
             "advantage": torch.randn(B, generator=g), "return": torch.randn(B, generator=g)}
    column, _ = ppo_loss(model, batch)
    flat, _ = ppo_loss(model, {**batch, "action": batch["action"].reshape(B)})
    torch.testing.assert_close(flat, column)
    with pytest.raises(RuntimeError, match="shape"):
        ppo_loss(model, {**batch, "action": torch.randn(B, 2)})


def test_equal_advantages_normalize_to_zero():
    """17 advantages of 0.3: float32's rounding of their mean (~3e-8) must not become an advantage."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, A)
    batch = {name: value[:17] for name, value in _batch(model).items()}
    batch["advantage"] = torch.full((17,), 0.3)
    loss, _ = ppo_loss(model, batch, clip_coef=0.2, vf_coef=0.0, ent_coef=0.0, norm_adv=True)
    loss.backward()
    assert abs(float(loss.detach())) < 1e-7
    assert all(float(p.grad.abs().max()) < 1e-7 for p in model.actor.parameters())


def test_trainer_improves_objective():
    torch.manual_seed(0)
    tr = PPOTrainer(OBS, A, lr=3e-3)
    batch = _batch(tr.model)
    first = float(tr.step(batch)["loss"])
    for _ in range(30):
        out = tr.step(batch)
    assert float(out["loss"]) < first
    act = tr.act(batch["obs"])
    assert act["action"].shape == (B,) and act["log_prob"].shape == (B,) and act["value"].shape == (B,)


def test_discrete_actions_may_come_as_a_column():
    """Action (B, 1) (a rollout schema with action shape (1,)): the same loss as (B,)."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, A)
    batch = _batch(model)
    flat, _ = ppo_loss(model, batch)
    column, _ = ppo_loss(model, {**batch, "action": batch["action"].reshape(B, 1)})
    torch.testing.assert_close(column, flat)


def test_float64_models_take_float32_and_uint8_observations():
    """The server sends float32 (or uint8 image) observations whatever the model's dtype."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, A).double()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in _batch(model.float()).items()}
    model.double()
    loss64, _ = ppo_loss(model, batch)
    loss, _ = ppo_loss(model, {**batch, "obs": batch["obs"].float()})  # float32 obs, as served
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, loss64, atol=1e-6, rtol=1e-6)
    pixels = torch.randint(0, 255, (B, OBS), dtype=torch.uint8)
    assert model.value(pixels).dtype == torch.float64 and model.value(pixels).shape == (B,)


def test_trainer_steps_are_adam_on_the_loss_with_its_coefficients_and_clipped_gradients():
    """Two step()s equal the update written out: zero_grad, ppo_loss with the trainer's coefficients,
    backward, clip_grad_norm_(max_grad_norm), Adam(lr, eps=1e-5)."""
    torch.manual_seed(0)
    settings = {"clip_coef": 0.2, "vf_coef": 0.7, "ent_coef": 0.05, "clip_vloss": True, "norm_adv": True}
    tr = PPOTrainer(OBS, A, hidden=(16, 16), lr=1e-2, max_grad_norm=0.1, **settings)
    start = copy.deepcopy(tr.model)
    batches = [_batch(start, seed=seed) for seed in range(2)]
    for batch in batches:
        tr.step(batch)

    def hand_run(max_grad_norm, vf_coef=0.7, ent_coef=0.05):
        model = copy.deepcopy(start)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-5)
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            loss, _ = ppo_loss(model, batch, **{**settings, "vf_coef": vf_coef, "ent_coef": ent_coef})
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
        return model

    expected = hand_run(0.1)
    for p, r in zip(tr.model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)
    # Each ingredient shows in these two steps: the clipping and the coefficients.
    for other in (hand_run(None), hand_run(0.1, vf_coef=0.05, ent_coef=0.7)):
        assert any(not torch.allclose(p, r, atol=1e-4) for p, r in
                   zip(other.parameters(), expected.parameters(), strict=True))


def test_continuous_entropy_sums_over_action_dimensions():
    """A diagonal Normal's entropy is the sum of its per-dimension entropies (then the batch mean)."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, A, continuous=True)
    with torch.no_grad():
        model.log_std.copy_(torch.tensor([-0.5, 0.0, 0.3]))
    batch = _batch(model, continuous=True)
    loss, stats = ppo_loss(model, batch, ent_coef=0.1)
    per_dim = 0.5 + 0.5 * math.log(2 * math.pi) + model.log_std.detach()  # (A,) Normal entropy
    torch.testing.assert_close(stats["entropy"], per_dim.sum())
    no_entropy, _ = ppo_loss(model, batch, ent_coef=0.0)
    torch.testing.assert_close(loss - no_entropy, -0.1 * per_dim.sum())


def test_continuous_act_returns_the_joint_log_prob_of_each_action():
    torch.manual_seed(0)
    tr = PPOTrainer(OBS, A, continuous=True)
    with torch.no_grad():
        tr.model.log_std.copy_(torch.tensor([-0.5, 0.0, 0.3]))
    obs = torch.randn(B, OBS)
    out = tr.act(obs)
    assert out["action"].shape == (B, A) and out["log_prob"].shape == (B,) and out["value"].shape == (B,)
    with torch.no_grad():
        mean, std = tr.model.actor(obs), tr.model.log_std.exp()
    lp = (-((out["action"] - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).sum(1)
    torch.testing.assert_close(out["log_prob"], lp)


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_grad_norm": -1.0}, r"max_grad_norm must be None or finite and > 0, got -1.0"),  # climbed the loss
    ({"max_grad_norm": float("nan")}, r"max_grad_norm must be None or finite and > 0, got nan"),
    ({"clip_coef": -0.2}, r"clip_coef must be finite and > 0, got -0.2"),  # an inverted clip range
    ({"clip_coef": 0.0}, r"clip_coef must be finite and > 0, got 0.0"),
    ({"vf_coef": -0.5}, r"vf_coef must be finite and >= 0, got -0.5"),  # maximized the value error
    ({"ent_coef": float("nan")}, r"ent_coef must be finite and >= 0, got nan"),
    ({"lr": 0.0}, r"lr must be finite and > 0, got 0.0"),  # never trained
])
def test_bad_trainer_settings_raise(settings, message):
    with pytest.raises(ValueError, match=message):
        PPOTrainer(OBS, A, **settings)
    PPOTrainer(OBS, A, max_grad_norm=None, vf_coef=0.0, ent_coef=0.0)  # no clipping, terms off: allowed


@pytest.mark.parametrize("name", ["log_prob", "value", "advantage", "return"])
def test_per_sample_columns_may_come_as_a_column_but_never_broadcast(name):
    """A (B, 1) log_prob (a rollout schema with log_prob shape (1,)), value, advantage or return: the same
    loss as (B,), not a silent (B, B) broadcast; one that does not hold B values is refused."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, A)
    batch = _batch(model)
    flat, _ = ppo_loss(model, batch)
    column, _ = ppo_loss(model, {**batch, name: batch[name].reshape(B, 1)})
    torch.testing.assert_close(column, flat)
    with pytest.raises(RuntimeError, match="shape"):
        ppo_loss(model, {**batch, name: torch.randn(B, 2)})
