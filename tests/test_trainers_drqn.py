"""The recurrent Q-loss (R2D2 style) on sequence batches vs a reference that steps each sequence one row at a
time and computes its targets from the episodes' rewards; burn-in, masking and the trainer's shapes."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from replayd.client.trainers.drqn import DRQNTrainer, RecurrentQNetwork, r2d2_loss
from tests.spec_batches import Episode, sequences_batch

OBS_DIM, N_ACTIONS, HIDDEN = 3, 2, 8
BURN_IN, LENGTH, N_STEP, GAMMA = 3, 5, 3, 0.9


def make_episode(rng: np.random.Generator, length: int, terminated: bool) -> Episode:
    return Episode(
        observations={"obs": rng.normal(size=(length + 1, OBS_DIM)).astype(np.float32)},
        steps={"action": rng.integers(N_ACTIONS, size=length), "reward": rng.normal(size=length).astype(np.float32),
               "h": rng.normal(size=(length, HIDDEN)).astype(np.float32)},
        terminated=terminated)


def episodes_and_picks() -> tuple[list[Episode], list[tuple[int, int]]]:
    rng = np.random.default_rng(0)
    episodes = [make_episode(rng, 7, True), make_episode(rng, 9, False), make_episode(rng, 20, True)]
    # Padded past a termination (0, 0) and (0, 2), past a truncation (1, 4); inside an episode, the last rows
    # bootstrapping beyond the sequence (2, 5); ending in a termination beyond the sequence (2, 10).
    return episodes, [(0, 0), (0, 2), (1, 4), (2, 5), (2, 10)]


def tensor_batch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in batch.items()}


def make_batch(weighted: bool = False) -> tuple[dict[str, torch.Tensor], list[Episode], list[tuple[int, int]]]:
    episodes, picks = episodes_and_picks()
    batch = tensor_batch(sequences_batch(episodes, picks, LENGTH, BURN_IN, N_STEP, GAMMA))
    if weighted:
        batch["weight"] = torch.linspace(0.2, 1.0, len(picks))
    return batch, episodes, picks


def networks(seed: int = 0) -> tuple[RecurrentQNetwork, RecurrentQNetwork]:
    torch.manual_seed(seed)
    online = RecurrentQNetwork(OBS_DIM, N_ACTIONS, HIDDEN, (16,))
    target = RecurrentQNetwork(OBS_DIM, N_ACTIONS, HIDDEN, (16,))  # other weights: target != online
    return online, target


def reference_loss(online, target, episodes, picks, double, weight, eta=0.9):
    """Row by row: each sequence stepped from its stored state (burn-in without gradient), each trained row's
    n-step target summed from the episode's rewards. Returns (loss, td (B, L), priority (B,))."""
    T = BURN_IN + LENGTH
    td = torch.zeros(len(picks), LENGTH)
    trained = torch.zeros(len(picks), LENGTH, dtype=torch.bool)
    losses = []
    for b, (e, start) in enumerate(picks):
        episode = episodes[e]
        obs, L = episode.observations["obs"], episode.length
        h_online = h_target = torch.from_numpy(episode.steps["h"][start])[None]  # (1, H)
        q_online, q_target = [], []
        for i in range(T):
            row = obs[start + i] if start + i <= L else np.zeros(OBS_DIM, np.float32)
            x = torch.from_numpy(row)[None, None]  # (1, 1, S)
            with torch.no_grad() if i < BURN_IN else contextlib.nullcontext():
                q, h_online = online(x, h_online)
            with torch.no_grad():
                qt, h_target = target(x, h_target)
            q_online.append(q[0, 0])
            q_target.append(qt[0, 0])
        for i in range(BURN_IN, T):
            t = start + i
            if t >= L:
                continue  # padding, or the final observation's row: not a step
            n_eff = min(N_STEP, L - t)
            ret = sum(GAMMA**k * float(episode.steps["reward"][t + k]) for k in range(n_eff))
            j = i + n_eff
            if episode.terminated and t + n_eff == L:
                y = ret
            elif j >= T:
                continue  # the bootstrap observation lies beyond the sequence: no target
            else:
                a_star = (q_online[j] if double else q_target[j]).detach().argmax()
                y = ret + GAMMA**n_eff * float(q_target[j][a_star])
            q_taken = q_online[i][int(episode.steps["action"][t])]
            td[b, i - BURN_IN] = float(q_taken.detach()) - y
            trained[b, i - BURN_IN] = True
            losses.append(weight[b] * F.huber_loss(q_taken, torch.tensor(y)))
    loss = torch.stack(losses).sum() / trained.sum()
    priority = eta * td.abs().max(1).values + (1 - eta) * td.abs().sum(1) / trained.sum(1).clamp(min=1)
    return loss, td, priority


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_loss_matches_a_row_by_row_reference(double: bool, weighted: bool) -> None:
    online, target = networks()
    batch, episodes, picks = make_batch(weighted)
    loss, td, priority, _ = r2d2_loss(online, target, batch, BURN_IN, double=double)
    loss.backward()
    grads = [p.grad.clone() for p in online.parameters()]
    online.zero_grad()
    weight = batch.get("weight", torch.ones(len(picks)))
    ref_loss, ref_td, ref_priority = reference_loss(online, target, episodes, picks, double, weight)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(td, ref_td, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(priority, ref_priority, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, [p.grad for p in online.parameters()], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_batch_has_rows_of_every_kind_the_loss_tells_apart() -> None:
    """The fixture covers padding, bootstraps beyond the sequence and a termination beyond it."""
    batch, _, _ = make_batch()
    T = BURN_IN + LENGTH
    trained_part = slice(BURN_IN, T)
    mask = batch["mask"][:, trained_part]
    beyond = batch["bootstrap_step"][:, trained_part] >= T
    ends = batch["bootstrap_discount"][:, trained_part] == 0
    assert (~mask).any()
    assert (mask & beyond & ~ends).any()  # no target in the batch
    assert (mask & beyond & ends).any()  # a target without a bootstrap


def test_burn_in_rows_and_the_stored_state_carry_no_gradient() -> None:
    online, target = networks()
    batch, _, _ = make_batch()
    batch["obs"] = batch["obs"].clone().requires_grad_(True)
    batch["h"] = batch["h"].clone().requires_grad_(True)
    loss, *_ = r2d2_loss(online, target, batch, BURN_IN)
    loss.backward()
    assert batch["h"].grad is None or not batch["h"].grad.any()
    assert not batch["obs"].grad[:, :BURN_IN].any()
    assert batch["obs"].grad[:, BURN_IN:].abs().sum() > 0


def test_rows_without_a_target_change_nothing() -> None:
    """Padding rows and rows bootstrapping beyond the sequence (not ended there) are not trained: whatever
    their returns and the padded observations hold, loss and priorities stay."""
    online, target = networks()
    batch, _, _ = make_batch()
    loss, td, priority, _ = r2d2_loss(online, target, batch, BURN_IN)
    T = BURN_IN + LENGTH
    untrained = ~batch["mask"] | ((batch["bootstrap_step"] >= T) & (batch["bootstrap_discount"] != 0))
    changed = dict(batch)
    changed["n_step_return"] = torch.where(untrained, torch.full_like(batch["n_step_return"], 1e6),
                                           batch["n_step_return"])
    after_final = torch.zeros_like(batch["mask"])  # rows after the final observation's row
    for b in range(len(batch["mask"])):
        steps = int(batch["mask"][b].sum())
        starts_inside = bool(batch["mask"][b, 0])
        if starts_inside and steps + 1 < T:
            after_final[b, steps + 1:] = True
    changed["obs"] = torch.where(after_final.unsqueeze(2), torch.full_like(batch["obs"], 7.0), batch["obs"])
    loss2, td2, priority2, _ = r2d2_loss(online, target, changed, BURN_IN)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(td2, td)
    torch.testing.assert_close(priority2, priority)
    assert not td[untrained[:, BURN_IN:]].any()


def test_the_trainer_steps_and_acts_with_batch_shaped_outputs() -> None:
    batch, _, picks = make_batch(weighted=True)
    trainer = DRQNTrainer(OBS_DIM, N_ACTIONS, BURN_IN, hidden=HIDDEN, encoder=(16,), target_update_every=2)
    before = [p.clone() for p in trainer.online.parameters()]
    out = trainer.step(batch)
    assert out["td_error"].shape == (len(picks), LENGTH) and out["priority"].shape == (len(picks),)
    assert out["loss"].shape == () and torch.isfinite(out["loss"]) and (out["priority"] >= 0).all()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.online.parameters(), strict=True))
    trainer.step(batch)  # the second step copies the online network into the target
    assert all(torch.equal(a, b) for a, b in zip(trainer.online.parameters(), trainer.target.parameters(),
                                                 strict=True))
    state = trainer.online.initial_state(4)
    actions, next_state = trainer.act(torch.zeros(4, OBS_DIM), state)
    assert actions.shape == (4,) and next_state.shape == (4, HIDDEN) and not torch.equal(next_state, state)
    explored, _ = trainer.act(torch.zeros(1000, OBS_DIM), trainer.online.initial_state(1000), epsilon=1.0)
    assert set(explored.tolist()) == {0, 1}


def test_acting_row_by_row_carries_the_state_the_loss_unrolls() -> None:
    """act's states, fed back, give the Q-values of one unroll over the same rows: what an actor stores is
    what the learner starts its sequences from."""
    trainer = DRQNTrainer(OBS_DIM, N_ACTIONS, 0, hidden=HIDDEN, encoder=(16,))
    obs = torch.randn(2, 6, OBS_DIM)
    state = trainer.online.initial_state(2)
    q_unrolled, _ = trainer.online(obs, state)
    for t in range(6):
        actions, state_after = trainer.act(obs[:, t], state)
        assert torch.equal(actions, q_unrolled[:, t].argmax(1))
        state = state_after


@pytest.mark.parametrize(("change", "message"), [
    (lambda b: {**b, "obs": b["obs"][:, :BURN_IN]}, r"batch\['obs'\]: expected \(B, T, \*S\) with T > burn_in = 3"),
    (lambda b: {**b, "h": b["h"][..., :4]}, r"batch\['h'\]: expected shape \(5, 8, 8\) .*got \(5, 8, 4\)"),
    (lambda b: {**b, "action": b["action"].float()}, r"batch\['action'\]: expected an integer dtype, got float32"),
])
def test_the_trainer_refuses_batches_it_cannot_train_on(change, message) -> None:
    batch, _, _ = make_batch()
    trainer = DRQNTrainer(OBS_DIM, N_ACTIONS, BURN_IN, hidden=HIDDEN)
    with pytest.raises(ValueError, match=message):
        trainer.step(change(batch))


@pytest.mark.parametrize(("options", "message"), [
    ({"burn_in": -1}, "burn_in must be an integer >= 0, got -1"),
    ({"burn_in": 2.5}, "burn_in must be an integer >= 0, got 2.5"),
    ({"target_update_every": 0}, "target_update_every must be an integer >= 1, got 0"),
    ({"eta": 1.5}, r"eta must be in \[0, 1\], got 1.5"),
    ({"lr": float("nan")}, "lr must be finite and > 0, got nan"),
])
def test_the_trainer_refuses_bad_settings(options, message) -> None:
    settings = {"burn_in": BURN_IN, **options}
    with pytest.raises(ValueError, match=message):
        DRQNTrainer(OBS_DIM, N_ACTIONS, **settings)
