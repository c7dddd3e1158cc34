"""ALLO: single encoder call vs four-call reference; dual / barrier update formulas."""

from __future__ import annotations

import copy

import pytest
import torch

from replayd.client.trainers.allo import AlloEncoder, AlloTrainer, allo_loss, update_duals_and_barrier

D = 4


def reference_allo(encoder, s, s2, u1, u2, beta, b):
    """Four separate encoder calls and the paper's formulas written out."""
    p_s, p_s2, p1, p2 = encoder(s), encoder(s2), encoder(u1), encoder(u2)
    n = u1.shape[0]
    graph = sum(((p_s[:, j] - p_s2[:, j]) ** 2).mean() for j in range(D))
    eye = torch.eye(D)
    E1 = torch.tril(p1.T @ p1.detach() / n - eye)
    E2 = torch.tril(p2.T @ p2.detach() / n - eye)
    dual = (beta * (E1 + E2) / 2).sum()
    barrier = b * (E1 * E2).sum()
    return graph + dual + barrier, E1, E2


def _data(seed=0, B=32, n=48):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(B, 2, generator=g)
    return s, s + 0.05 * torch.randn(B, 2, generator=g), torch.rand(n, 2, generator=g), torch.rand(n, 2, generator=g)


@pytest.mark.parametrize("single_call", [True, False])
def test_loss_and_grads_match_four_call_reference(single_call):
    torch.manual_seed(0)
    enc = AlloEncoder(2, D, hidden=(32, 32))
    ref_enc = copy.deepcopy(enc)
    s, s2, u1, u2 = _data()
    beta = torch.tril(torch.randn(D, D))
    b = torch.tensor(2.5)

    loss, aux = allo_loss(enc, s, s2, u1, u2, beta, b, single_call=single_call)
    loss.backward()
    ref_loss, E1, E2 = reference_allo(ref_enc, s, s2, u1, u2, beta, b)
    ref_loss.backward()

    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(aux["E1"], E1, atol=1e-6, rtol=0)
    torch.testing.assert_close(aux["E2"], E2, atol=1e-6, rtol=0)
    for p, q in zip(enc.parameters(), ref_enc.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(aux["graph"] + aux["dual"] + aux["barrier"], loss)


def test_stop_gradient_matters():
    # Without the stop-gradient on the right factor, the gradient differs; make sure ours has it.
    torch.manual_seed(1)
    enc = AlloEncoder(2, D, hidden=(16,))
    _, _, u1, u2 = _data(1)
    beta = torch.tril(torch.randn(D, D))
    loss, _ = allo_loss(enc, u1[:8], u1[:8], u1, u2, beta, torch.tensor(0.0))
    (g_ours,) = torch.autograd.grad(loss, [enc.net[0].weight])
    p1, p2 = enc(u1), enc(u2)
    n = u1.shape[0]
    no_sg = (beta * (torch.tril(p1.T @ p1 / n) + torch.tril(p2.T @ p2 / n)) / 2).sum()
    (g_no_sg,) = torch.autograd.grad(no_sg, [enc.net[0].weight])
    assert not torch.allclose(g_ours, g_no_sg, atol=1e-5)


def test_beta_and_barrier_get_no_gradient():
    enc = AlloEncoder(2, D, hidden=(16,))
    s, s2, u1, u2 = _data()
    beta = torch.zeros(D, D, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=True)
    loss, _ = allo_loss(enc, s, s2, u1, u2, beta, b)
    loss.backward()
    assert beta.grad is None and b.grad is None


def test_dual_and_barrier_update_formulas():
    E1 = torch.tril(torch.tensor([[0.2, 0.0], [0.1, -0.3]]))
    E2 = torch.tril(torch.tensor([[0.4, 0.0], [-0.2, -0.1]]))
    beta = torch.tensor([[99.99, 0.0], [0.5, -1.0]])
    b = torch.tensor(1.0)
    new_beta, new_b = update_duals_and_barrier(beta, b, E1, E2, lr_beta=0.1, lr_barrier=2.0, barrier_max=10.0)
    expected_beta = torch.tensor([[100.0, 0.0], [0.5 + 0.1 * (-0.05), -1.0 + 0.1 * (-0.2)]])
    torch.testing.assert_close(new_beta, expected_beta)  # (0,0) clipped at 100
    # The mean of the entries clipped at 0 (the authors' update): 0.1 * -0.2 counts as 0, not against the rest.
    mean_positive_q = (0.2 * 0.4 + 0.0 + -0.3 * -0.1) / 4
    torch.testing.assert_close(new_b, torch.tensor(1.0 + 2.0 * mean_positive_q))
    # No positive entry of E1*E2 leaves b unchanged; b_max caps it.
    _, b_same = update_duals_and_barrier(beta, b, E1.abs(), -E2.abs(), 0.1, 2.0, 10.0)
    torch.testing.assert_close(b_same, b)
    _, b_cap = update_duals_and_barrier(beta, torch.tensor(9.99), E1, E2, 0.1, 100.0, 10.0)
    torch.testing.assert_close(b_cap, torch.tensor(10.0))
    # Lower bound on beta.
    nb, _ = update_duals_and_barrier(torch.full((2, 2), -100.0), b, -E1.abs(), -E2.abs(), 1.0, 0.0, 10.0)
    assert nb.min() >= -100.0


def test_trainer_step_updates_everything():
    torch.manual_seed(0)
    tr = AlloTrainer(2, D, hidden=(16, 16), lr=1e-3, lr_beta=0.1, barrier_init=0.5)
    s, s2, u1, u2 = _data()
    w0 = tr.encoder.net[0].weight.clone()
    out = tr.step({"obs": s, "future_obs": s2, "offset": torch.ones(32, dtype=torch.int64)}, {"obs": u1}, u2)
    assert set(out) >= {"loss", "graph", "dual", "barrier", "barrier_coef"}
    assert not torch.equal(w0, tr.encoder.net[0].weight)
    assert tr.beta.abs().sum() > 0 and torch.equal(tr.beta, torch.tril(tr.beta))
    assert tr.barrier.item() == 0.5  # lr_barrier 0 (the default): the barrier stays at barrier_init
    assert tr.single_call is False  # CPU default (see default_single_call)


def test_mismatched_batches_raise():
    enc = AlloEncoder(2, D, hidden=(8,))
    s, s2, u1, u2 = _data()
    with pytest.raises(ValueError, match="batch sizes"):
        allo_loss(enc, s, s2[:-1], u1, u2, torch.zeros(D, D), torch.tensor(1.0))


def test_trainer_defaults_follow_the_papers_configuration():
    # Adam lr 1e-3, dual lr 1e-4, barrier starting at 1.0 (kept fixed: lr_barrier 0, see AlloTrainer).
    tr = AlloTrainer(2, D, hidden=(8,))
    assert tr.optimizer.param_groups[0]["lr"] == 1e-3
    assert tr.lr_beta == 1e-4 and tr.lr_barrier == 0.0 and tr.barrier.item() == 1.0
    assert torch.equal(tr.beta, torch.zeros(D, D))


def _pair(s, s2):
    return {"obs": s, "future_obs": s2, "offset": torch.ones(s.shape[0], dtype=torch.int64)}


def test_trainer_steps_are_adam_on_the_loss_of_both_uniform_batches():
    """Two step()s equal the update written out: zero_grad, allo_loss(s, s', u1, u2) with the current
    duals and barrier, backward, Adam(lr), then update_duals_and_barrier."""
    torch.manual_seed(0)
    tr = AlloTrainer(2, D, hidden=(16, 16), lr=1e-2, lr_beta=0.1, lr_barrier=0.5, barrier_init=0.5)
    enc = copy.deepcopy(tr.encoder)
    optimizer = torch.optim.Adam(enc.parameters(), lr=1e-2)
    beta, barrier = torch.zeros(D, D), torch.tensor(0.5)
    for seed in range(2):
        s, s2, u1, u2 = _data(seed)
        tr.step(_pair(s, s2), {"obs": u1}, {"obs": u2})
        optimizer.zero_grad(set_to_none=True)
        loss, aux = allo_loss(enc, s, s2, u1, u2, beta, barrier, single_call=False)
        loss.backward()
        optimizer.step()
        beta, barrier = update_duals_and_barrier(beta, barrier, aux["E1"], aux["E2"], 0.1, 0.5, 1e4)
    for p, q in zip(tr.encoder.parameters(), enc.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(tr.beta, beta)
    torch.testing.assert_close(tr.barrier, barrier)


def test_the_second_uniform_batch_changes_the_steps():
    """E2 comes from u2: passing u1 again in its place gives other weights and duals (two steps: Adam's
    first step is close to lr * sign(gradient) and hides most differences in the gradient's size)."""
    s, s2, u1, u2 = _data()
    trainers = []
    for second in (u2, u1):
        torch.manual_seed(0)
        tr = AlloTrainer(2, D, hidden=(16, 16), lr=1e-2, lr_beta=0.1)
        for _ in range(2):
            tr.step(_pair(s, s2), u1, second)
        trainers.append(tr)
    with_u2, with_u1 = trainers
    assert not torch.allclose(with_u2.beta, with_u1.beta, atol=1e-6)
    assert any(not torch.allclose(p, q, atol=1e-5) for p, q in
               zip(with_u2.encoder.parameters(), with_u1.encoder.parameters(), strict=True))


def test_barrier_starts_at_barrier_init_grows_by_its_rule_and_stops_at_barrier_max():
    s, s2, u1, u2 = _data()
    torch.manual_seed(0)
    tr = AlloTrainer(2, D, hidden=(16, 16), lr_barrier=2.0, barrier_init=0.5, barrier_max=1e4)
    assert tr.barrier.item() == 0.5
    with torch.no_grad():
        _, aux = allo_loss(tr.encoder, s, s2, u1, u2, tr.beta, tr.barrier)
    violation = (aux["E1"] * aux["E2"]).mean().item()
    assert violation > 0  # a fresh encoder violates the constraints: the barrier grows
    out = tr.step(_pair(s, s2), u1, u2)
    assert tr.barrier.item() == pytest.approx(0.5 + 2.0 * violation, rel=1e-5)
    torch.testing.assert_close(out["barrier_coef"], tr.barrier)
    # barrier_max caps it (a large rate would take it past 1 in one step).
    torch.manual_seed(0)
    capped = AlloTrainer(2, D, hidden=(16, 16), lr_barrier=1e4, barrier_init=0.5, barrier_max=0.75)
    capped.step(_pair(s, s2), u1, u2)
    assert capped.barrier.item() == 0.75


@pytest.mark.parametrize(("settings", "message"), [
    ({"barrier_init": 50.0, "barrier_max": 10.0}, r"barrier_init must be in \[0, barrier_max=10.0\], got 50.0"),
    ({"barrier_init": -3.0}, r"barrier_init must be in \[0, barrier_max=10000.0\], got -3.0"),  # not clipped to 0
    ({"barrier_init": float("nan")}, r"barrier_init must be in \[0, barrier_max=10000.0\], got nan"),
    ({"barrier_init": 0.0, "barrier_max": -5.0}, r"barrier_max must be >= 0, got -5.0"),  # a barrier of -5
    ({"barrier_max": float("nan")}, r"barrier_max must be >= 0, got nan"),
    ({"lr": 0.0}, r"lr must be finite and > 0, got 0.0"),
    ({"lr_beta": -1e-4}, r"lr_beta must be finite and >= 0, got -0.0001"),
    ({"lr_barrier": float("nan")}, r"lr_barrier must be finite and >= 0, got nan"),
])
def test_bad_trainer_settings_raise(settings, message):
    """Settings the trainer cannot honour are refused: such a barrier_init would be replaced by the clip after
    the first step, and a negative barrier_max would become the barrier."""
    with pytest.raises(ValueError, match=message):
        AlloTrainer(2, D, hidden=(8,), **settings)
    tr = AlloTrainer(2, D, hidden=(8,), barrier_init=0.0, barrier_max=0.0)  # no barrier at all: allowed
    assert tr.barrier.item() == 0.0
