"""DQN / Double DQN loss: batched implementation vs a naive two-forward reference."""

from __future__ import annotations

import copy

import pytest
import torch

from replayd.client.trainers.compiled import CompiledFunction
from replayd.client.trainers.dqn import DQNTrainer, q_loss, update_target
from replayd.client.trainers.dqn_manual_grad import q_loss_grads_flat, q_loss_manual_grad
from replayd.client.trainers.q_network import QNetwork

OBS_DIM, N_ACTIONS, GAMMA = 4, 3, 0.9


def nstep_fields(rewards: list[float], terminated: list[bool], truncated: list[bool], t: int, n: int):
    """Reference n-step fields from 1-step flags (what the server computes), for start index t."""
    ret, k = 0.0, 0
    ended_by_termination = False
    while k < n and t + k < len(rewards):
        ret += GAMMA**k * rewards[t + k]
        k += 1
        if terminated[t + k - 1]:
            ended_by_termination = True
            break
        if truncated[t + k - 1]:
            break
    discount = 0.0 if ended_by_termination else GAMMA**k
    return ret, discount, t + k  # bootstrap index = t + n_eff


def make_batch(B: int = 16, weighted: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # A toy trajectory of B+3 steps with one termination and one truncation inside it.
    T = B + 3
    states = torch.randn(T + 1, OBS_DIM, generator=g)
    rewards = torch.randn(T, generator=g).tolist()
    terminated = [False] * T
    truncated = [False] * T
    terminated[5] = True
    truncated[11] = True
    n = 3
    R, disc, boot = [], [], []
    for t in range(B):
        r, dsc, b = nstep_fields(rewards, terminated, truncated, t, n)
        R.append(r)
        disc.append(dsc)
        boot.append(b)
    batch = {
        "obs": states[:B].clone(),
        "action": torch.randint(N_ACTIONS, (B,), generator=g),
        "reward": torch.tensor(rewards[:B]),
        "next_obs": states[1 : B + 1].clone(),
        "terminated": torch.tensor(terminated[:B]),
        "truncated": torch.tensor(truncated[:B]),
        "n_step_return": torch.tensor(R, dtype=torch.float32),
        "bootstrap_discount": torch.tensor(disc, dtype=torch.float32),
        "bootstrap_obs": states[torch.tensor(boot)].clone(),
    }
    if weighted:
        batch["weight"] = torch.rand(B, generator=g) + 0.1
    return batch


def test_nstep_fixture_has_termination_and_truncation():
    b = make_batch()
    disc = b["bootstrap_discount"]
    # Starts 3..5 see the termination at t=5 within 3 steps -> discount 0.
    assert torch.all(disc[3:6] == 0)
    # Starts 9..11 hit the truncation at t=11: bootstrapping continues with gamma^n_eff < gamma^3.
    assert disc[9].item() == pytest.approx(GAMMA**3)
    assert disc[10].item() == pytest.approx(GAMMA**2)
    assert disc[11].item() == pytest.approx(GAMMA**1)
    assert disc[0].item() == pytest.approx(GAMMA**3)


def reference_loss(online, target, batch, double, loss_type, delta=1.0):
    """Naive: separate forwards, explicit formulas."""
    q = online(batch["obs"])
    q_sa = q[torch.arange(q.shape[0]), batch["action"]]
    with torch.no_grad():
        q_next_target = target(batch["bootstrap_obs"])
        if double:
            a_star = online(batch["bootstrap_obs"]).argmax(1)
        else:
            a_star = q_next_target.argmax(1)
        v = q_next_target[torch.arange(q.shape[0]), a_star]
        y = batch["n_step_return"] + batch["bootstrap_discount"] * v
    td = q_sa - y
    if loss_type == "mse":
        per = td**2
    else:
        a = td.abs()
        per = torch.where(a <= delta, 0.5 * td**2, delta * (a - 0.5 * delta))
    w = batch.get("weight", torch.ones_like(td))
    return (w * per).mean(), td.detach()


def _nets(seed: int = 0, hidden=(64, 64)):
    torch.manual_seed(seed)
    online = QNetwork(OBS_DIM, N_ACTIONS, hidden)
    target = QNetwork(OBS_DIM, N_ACTIONS, hidden)  # different init: target != online
    return online, target


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("loss_type", ["mse", "huber"])
@pytest.mark.parametrize("weighted", [False, True])
def test_batched_loss_and_grads_match_reference(double, loss_type, weighted):
    online, target = _nets()
    batch = make_batch(weighted=weighted)
    # Scale returns so Huber exercises both branches.
    batch["n_step_return"] = batch["n_step_return"] * 3
    loss, td, q_taken = q_loss(online, target, batch, double=double, loss_type=loss_type, huber_delta=1.0)
    loss.backward()
    grads = [p.grad.clone() for p in online.parameters()]

    ref_online = copy.deepcopy(online)
    ref_online.zero_grad(set_to_none=True)
    ref_loss, ref_td = reference_loss(ref_online, target, batch, double, loss_type)
    ref_loss.backward()

    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(td, ref_td, atol=1e-6, rtol=0)
    for g, p in zip(grads, ref_online.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=0)
    assert not td.requires_grad and not q_taken.requires_grad
    assert all(p.grad is None for p in target.parameters())
    if loss_type == "huber":
        assert (ref_td.abs() > 1).any() and (ref_td.abs() < 1).any()


def test_double_differs_from_dqn_on_this_batch():
    # Guards the tests above: the online and target argmax disagree somewhere, so a Double DQN that
    # used the target argmax (or a DQN that used the online one) would fail the reference check.
    online, target = _nets()
    batch = make_batch()
    with torch.no_grad():
        assert (online(batch["bootstrap_obs"]).argmax(1) != target(batch["bootstrap_obs"]).argmax(1)).any()
    l_dqn, _, _ = q_loss(online, target, batch, double=False)
    l_ddqn, _, _ = q_loss(online, target, batch, double=True)
    assert not torch.allclose(l_dqn, l_ddqn)


def test_terminated_targets_ignore_bootstrap_and_truncated_keep_it():
    online, target = _nets()
    batch = make_batch()
    _, td, q_taken = q_loss(online, target, batch)
    with torch.no_grad():
        v = target(batch["bootstrap_obs"]).max(1).values
    # Terminated within n: y = n-step return exactly.
    torch.testing.assert_close(td[3:6], q_taken[3:6] - batch["n_step_return"][3:6])
    # Truncated at t=11: bootstrap with gamma^1 from s_12.
    y11 = batch["n_step_return"][11] + GAMMA * v[11]
    torch.testing.assert_close(td[11], q_taken[11] - y11)


def test_weights_change_loss_not_td():
    online, target = _nets()
    b0 = make_batch()
    b1 = dict(b0, weight=torch.linspace(0.1, 2.0, b0["obs"].shape[0]))
    l0, td0, _ = q_loss(online, target, b0)
    l1, td1, _ = q_loss(online, target, b1)
    torch.testing.assert_close(td0, td1)
    torch.testing.assert_close(l1, (b1["weight"] * td0**2).mean())
    assert not torch.allclose(l0, l1)


@pytest.mark.parametrize(("settings", "message"), [
    ({"loss_type": "l1"}, "loss_type must be"),
    ({"loss_type": "huber", "huber_delta": float("nan")}, "huber_delta must be finite and > 0, got nan"),
    ({"loss_type": "huber", "huber_delta": 0.0}, "huber_delta must be finite and > 0, got 0.0"),
])
def test_bad_loss_settings_raise(settings, message):
    online, target = _nets()
    for loss in (q_loss, q_loss_manual_grad):
        with pytest.raises(ValueError, match=message):
            loss(online, target, make_batch(), **settings)
    with pytest.raises(ValueError, match=message):
        DQNTrainer(OBS_DIM, N_ACTIONS, **settings)


def test_update_target_hard_and_polyak():
    online, target = _nets()
    old = [p.clone() for p in target.parameters()]
    update_target(online, target, tau=0.25)
    for t, o, p in zip(target.parameters(), old, online.parameters(), strict=True):
        torch.testing.assert_close(t, 0.25 * p + 0.75 * o)
    update_target(online, target, tau=1.0)
    for t, p in zip(target.parameters(), online.parameters(), strict=True):
        assert torch.equal(t, p)
    with pytest.raises(ValueError):
        update_target(online, target, tau=0.0)


def test_trainer_hard_update_every_k_steps():
    torch.manual_seed(0)
    tr = DQNTrainer(OBS_DIM, N_ACTIONS, lr=1e-2, target_update_every=3, double=True)
    batch = make_batch()
    for i in range(1, 7):
        out = tr.step(batch)
        same = all(torch.equal(t, o) for t, o in zip(tr.target.parameters(), tr.online.parameters(), strict=True))
        assert same == (i % 3 == 0), i
        assert set(out) == {"loss", "mean_q", "td_error"}
        assert out["td_error"].shape == (batch["obs"].shape[0],)
        assert isinstance(out["loss"], torch.Tensor)
    assert all(not p.requires_grad for p in tr.target.parameters())
    logged = tr.step(batch, log=True)
    assert isinstance(logged["loss"], float) and isinstance(logged["mean_q"], float)


def test_trainer_polyak_every_step_and_learning():
    torch.manual_seed(0)
    tr = DQNTrainer(OBS_DIM, N_ACTIONS, lr=1e-2, target_update_every=1, tau=0.5, loss_type="mse")
    batch = make_batch()
    tr.step(batch)
    before = [p.clone() for p in tr.target.parameters()]
    tr.step(batch)
    for t, b, o in zip(tr.target.parameters(), before, tr.online.parameters(), strict=True):
        torch.testing.assert_close(t, 0.5 * o + 0.5 * b)
    # Learning check on a pure-regression batch (no bootstrapping, so no target chasing).
    batch["bootstrap_discount"] = torch.zeros_like(batch["bootstrap_discount"])
    first = float(tr.step(batch)["loss"])
    for _ in range(200):
        last = float(tr.step(batch)["loss"])
    assert last < 0.5 * first


def _assert_matches_reference(online, target, batch, double, loss_type, loss, td, q_taken, delta=1.0):
    """Asserts a hand-written pass's loss, TD errors, Q(s, a) and the gradients it left in ``online``
    equal the naive reference's; returns (the reference's network, with its gradients; its TD errors)."""
    ref_online = copy.deepcopy(online)
    for p in ref_online.parameters():
        p.grad = None
    ref_loss, ref_td = reference_loss(ref_online, target, batch, double, loss_type, delta)
    ref_loss.backward()
    # The loss is a sum in another order than the reference's mean (a few ulp of a value ~20).
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(td, ref_td, atol=1e-6, rtol=0)
    with torch.no_grad():
        expected_q = online(batch["obs"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(q_taken, expected_q, atol=1e-6, rtol=0)
    for p, r in zip(online.parameters(), ref_online.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=0)
    return ref_online, ref_td


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("loss_type", ["mse", "huber"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("hidden", [(64, 64), (3, 5), (8,)])
def test_manual_grad_matches_reference(double, loss_type, weighted, hidden):
    # hidden (3, 5): layers 4->3 and 5->3 take dW = g^T x, 3->5 (fewer inputs than outputs) (x^T g)^T.
    online, target = _nets(hidden=hidden)
    batch = make_batch(weighted=weighted)
    batch["n_step_return"] = batch["n_step_return"] * 3
    loss, td, q_taken = q_loss_manual_grad(online, target, batch, double=double, loss_type=loss_type)
    ref_online, ref_td = _assert_matches_reference(online, target, batch, double, loss_type, loss, td, q_taken)
    assert all(p.grad.shape == p.shape for p in online.parameters())
    assert not loss.requires_grad and not td.requires_grad and not q_taken.requires_grad
    assert all(p.grad is None for p in target.parameters())
    if loss_type == "huber":
        assert (ref_td.abs() > 1).any() and (ref_td.abs() < 1).any()
    # Accumulates like autograd.
    q_loss_manual_grad(online, target, batch, double=double, loss_type=loss_type)
    for p, r in zip(online.parameters(), ref_online.parameters(), strict=True):
        torch.testing.assert_close(p.grad, 2 * r.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("double", [False, True])
def test_manual_grad_flattens_observations_like_forward(double):
    # Observations of shape (B, 2, 2) are flattened to obs_dim 4, as QNetwork.forward does.
    online, target = _nets()
    batch = make_batch(weighted=True)
    shaped = dict(batch, obs=batch["obs"].view(-1, 2, 2), bootstrap_obs=batch["bootstrap_obs"].view(-1, 2, 2))
    loss, td, _ = q_loss_manual_grad(online, target, shaped, double=double, loss_type="huber")
    grads = [p.grad.clone() for p in online.parameters()]
    online.zero_grad(set_to_none=True)
    ref_loss, ref_td, _ = q_loss(online, target, batch, double=double, loss_type="huber")
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(td, ref_td, atol=1e-6, rtol=0)
    for g, p in zip(grads, online.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=0)


def test_manual_grad_rejects_other_networks():
    net = torch.nn.Sequential(torch.nn.Linear(OBS_DIM, N_ACTIONS))
    with pytest.raises(TypeError, match="QNetworks"):
        q_loss_manual_grad(net, net, make_batch())


@pytest.mark.parametrize("double", [False, True])
def test_trainer_manual_and_autograd_paths_agree(double):
    batch = make_batch(weighted=True)
    trainers = []
    for strategy in ("manual", "autograd"):
        torch.manual_seed(0)
        trainers.append(
            DQNTrainer(OBS_DIM, N_ACTIONS, lr=1e-3, double=double, target_update_every=2, loss_strategy=strategy)
        )
    assert trainers[0].loss_strategy.name == "manual" and trainers[1].loss_strategy.name == "autograd"
    assert DQNTrainer(OBS_DIM, N_ACTIONS).loss_strategy.name == "manual"  # the default for QNetwork is the fast path
    for _ in range(5):
        outs = [tr.step(batch) for tr in trainers]
        torch.testing.assert_close(outs[0]["loss"], outs[1]["loss"], atol=1e-6, rtol=1e-6)
    for p, q in zip(trainers[0].online.parameters(), trainers[1].online.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_a_frozen_layer_stays_frozen_on_both_paths():
    """requires_grad=False: autograd gives the layer no gradient, so Adam leaves it and the clipping norm
    leaves it out; the manual path writes no gradient for it either."""
    batch = make_batch(weighted=True)
    trainers = []
    for strategy in ("manual", "autograd"):
        torch.manual_seed(0)
        network = QNetwork(OBS_DIM, N_ACTIONS, (8, 8))
        network.layers[0].requires_grad_(False)
        trainers.append(DQNTrainer(OBS_DIM, N_ACTIONS, hidden=(8, 8), lr=1e-2, max_grad_norm=0.05,
                                   network=network, loss_strategy=strategy))
    frozen = copy.deepcopy(trainers[0].online.layers[0])
    for _ in range(3):
        for trainer in trainers:
            trainer.step(batch)
    for trainer in trainers:
        assert trainer.online.layers[0].weight.grad is None
        torch.testing.assert_close(trainer.online.layers[0].weight, frozen.weight, atol=0, rtol=0)
        torch.testing.assert_close(trainer.online.layers[0].bias, frozen.bias, atol=0, rtol=0)
    for p, q in zip(trainers[0].online.parameters(), trainers[1].online.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_qnetwork_param_cache_follows_conversions_and_copies():
    net = QNetwork(OBS_DIM, N_ACTIONS)
    ref = torch.nn.Sequential(net.layers[0], torch.nn.ReLU(), net.layers[1], torch.nn.ReLU(), net.layers[2])
    x = torch.randn(5, OBS_DIM)
    torch.testing.assert_close(net(x), ref(x))
    net.double()
    assert net.weights_and_biases[0][0] is net.layers[0].weight
    assert net(x).dtype == torch.float64
    clone = copy.deepcopy(net)
    assert clone.weights_and_biases[0][0] is clone.layers[0].weight
    with torch.no_grad():
        clone.layers[0].weight.add_(1.0)
    assert not torch.allclose(clone(x), net(x))
    net.load_state_dict(clone.state_dict())
    torch.testing.assert_close(clone(x), net(x))
    other = QNetwork(OBS_DIM, N_ACTIONS).double()
    net.load_state_dict(other.state_dict(), assign=True)  # new Parameter objects in the layers
    assert net.weights_and_biases[0][0] is net.layers[0].weight
    torch.testing.assert_close(net(x), other(x))
    wrapper = torch.nn.ModuleDict({"q": net})  # the hook runs when a parent module loads too
    wrapper.load_state_dict({f"q.{k}": v for k, v in clone.state_dict().items()}, assign=True)
    torch.testing.assert_close(net(x), clone(x))


def test_transposed_layers_follow_updates_and_storage_swaps():
    """The hand-written pass reads W^T views; they must never go stale (a stale view = wrong loss)."""
    net = QNetwork(OBS_DIM, N_ACTIONS)
    x = torch.randn(5, OBS_DIM)

    def forward_from_views() -> torch.Tensor:
        h = x.to(net.layers[0].weight.dtype)
        *hidden, (w_t, b) = net.transposed_layers()
        for hw_t, hb in hidden:
            h = torch.addmm(hb, h, hw_t).relu_()
        return torch.addmm(b, h, w_t)

    with torch.no_grad():
        torch.testing.assert_close(forward_from_views(), net(x))
        net.layers[1].weight.mul_(-2.0)  # in place, as the optimizer does
        torch.testing.assert_close(forward_from_views(), net(x))
        net.layers[1].weight.data = torch.randn_like(net.layers[1].weight)  # new storage
        torch.testing.assert_close(forward_from_views(), net(x))
        net.layers[2].bias.data = torch.full_like(net.layers[2].bias, 100.0)  # a bias alone
        torch.testing.assert_close(forward_from_views(), net(x))
        net.double()
        assert forward_from_views().dtype == torch.float64
        torch.testing.assert_close(forward_from_views(), net(x))


@pytest.mark.parametrize("manual", [False, True])
@pytest.mark.parametrize("loss_type", ["mse", "huber"])
def test_float64_networks_take_the_servers_float32_fields(manual, loss_type):
    """Weights, returns and discounts arrive as float32 whatever the network's dtype."""
    online, target = (net.double() for net in _nets())
    batch = make_batch(weighted=True)
    batch64 = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    ref_online = copy.deepcopy(online)
    ref_loss, ref_td = reference_loss(ref_online, target, batch64, True, loss_type)
    ref_loss.backward()
    if manual:
        loss, td, _ = q_loss_manual_grad(online, target, batch, double=True, loss_type=loss_type)
    else:
        loss, td, _ = q_loss(online, target, batch, double=True, loss_type=loss_type)
        loss.backward()
    assert loss.dtype == td.dtype == torch.float64
    # float32 fields in a float64 loss: equal to the float64 reference to float32 precision
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(td, ref_td, atol=1e-5, rtol=1e-5)
    for p, r in zip(online.parameters(), ref_online.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-5, rtol=1e-5)


def test_double_dqn_keeps_bootstrap_rows_out_of_a_batch_dependent_network():
    """BatchNorm mixes rows: one forward over [s; s_boot] would make Q(s, a) depend on s_boot."""
    torch.manual_seed(0)
    online = torch.nn.Sequential(torch.nn.Linear(OBS_DIM, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                 torch.nn.Linear(16, N_ACTIONS))
    target = copy.deepcopy(online)
    batch = make_batch()
    batch["bootstrap_obs"] = batch["bootstrap_obs"] * 100  # far from s: any mixing would show
    _, _, q_taken = q_loss(online, target, batch, double=True)
    with torch.no_grad():
        alone = copy.deepcopy(online)(batch["obs"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(q_taken, alone)


@pytest.mark.parametrize("delta", [0.5, 2.0])
@pytest.mark.parametrize("manual", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_huber_delta_sets_where_the_loss_and_its_gradient_turn_linear(delta, manual, weighted):
    """A delta other than 1 (the tests above use 1) reaches both the loss and its clipped gradient."""
    online, target = _nets()
    batch = make_batch(weighted=weighted)
    batch["n_step_return"] = batch["n_step_return"] * 3
    if manual:
        loss, td, q_taken = q_loss_manual_grad(online, target, batch, True, "huber", huber_delta=delta)
    else:
        loss, td, q_taken = q_loss(online, target, batch, True, "huber", huber_delta=delta)
        loss.backward()
    _, ref_td = _assert_matches_reference(online, target, batch, True, "huber", loss, td, q_taken, delta)
    # Rows on both sides of delta, and between delta and 1 (where delta 1 would give other numbers).
    assert (ref_td.abs() > delta).any() and (ref_td.abs() < delta).any()
    assert ((ref_td.abs() - delta) * (ref_td.abs() - 1) < 0).any()


def test_trainer_defaults_are_double_dqn_with_a_huber_loss():
    torch.manual_seed(0)
    tr = DQNTrainer(OBS_DIM, N_ACTIONS)
    assert (tr.double, tr.loss_type, tr.huber_delta) == (True, "huber", 1.0)
    assert tr.optimizer.param_groups[0]["lr"] == 2.5e-4
    assert (tr.target_update_every, tr.tau, tr.max_grad_norm) == (500, 1.0, None)
    # A step's loss is the Huber one (rows with |td| > 1 tell it from the squared error).
    online, target = copy.deepcopy(tr.online), copy.deepcopy(tr.target)
    batch = make_batch()
    batch["n_step_return"] = batch["n_step_return"] * 3
    out = tr.step(batch)
    ref_loss, ref_td = reference_loss(online, target, batch, True, "huber")
    assert (ref_td.abs() > 1).any()
    torch.testing.assert_close(out["loss"], ref_loss.detach(), atol=1e-6, rtol=1e-6)


def test_trainer_target_starts_as_a_copy_of_the_online_network():
    torch.manual_seed(0)
    tr = DQNTrainer(OBS_DIM, N_ACTIONS, hidden=(8, 8))
    for t, o in zip(tr.target.parameters(), tr.online.parameters(), strict=True):
        assert torch.equal(t, o) and t.data_ptr() != o.data_ptr()  # equal values, its own storage
    x = torch.randn(5, OBS_DIM)
    with torch.no_grad():
        torch.testing.assert_close(tr.target(x), tr.online(x), atol=0, rtol=0)


def _hand_run_steps(online, target, batches, lr, max_grad_norm):
    """What DQNTrainer.step does (Double DQN, Huber; target left fixed), written out on a copy of
    ``online``: zero_grad, q_loss, backward, clip_grad_norm_ (unless None), Adam(lr)."""
    online = copy.deepcopy(online)
    optimizer = torch.optim.Adam(online.parameters(), lr=lr)
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss, _, _ = q_loss(online, target, batch, double=True, loss_type="huber")
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(online.parameters(), max_grad_norm)
        optimizer.step()
    return online


@pytest.mark.parametrize("strategy", ["autograd", "manual"])
def test_trainer_steps_are_adam_at_lr_on_gradients_clipped_to_max_grad_norm(strategy):
    torch.manual_seed(0)
    tr = DQNTrainer(OBS_DIM, N_ACTIONS, hidden=(8, 8), lr=1e-2, max_grad_norm=0.05, target_update_every=100,
                    loss_strategy=strategy)
    start, target = copy.deepcopy(tr.online), copy.deepcopy(tr.target)
    batches = [make_batch(seed=seed) for seed in range(3)]
    for batch in batches:
        tr.step(batch)
    expected = _hand_run_steps(start, target, batches, lr=1e-2, max_grad_norm=0.05)
    for p, r in zip(tr.online.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)
    # The clipping is active here: without it the same steps end elsewhere.
    unclipped = _hand_run_steps(start, target, batches, lr=1e-2, max_grad_norm=None)
    assert any(not torch.allclose(p, r, atol=1e-4) for p, r in
               zip(unclipped.parameters(), expected.parameters(), strict=True))


@pytest.mark.parametrize("tau", [1.0, 0.25])
def test_update_target_copies_batchnorm_running_statistics(tau):
    """Buffers (BatchNorm's running mean/var and batch count) are copied, hard or Polyak."""
    torch.manual_seed(0)
    online = torch.nn.Sequential(torch.nn.Linear(OBS_DIM, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                 torch.nn.Linear(16, N_ACTIONS))
    target = copy.deepcopy(online)
    with torch.no_grad():
        online(3 * torch.randn(32, OBS_DIM) + 1)  # training mode: moves the running statistics
        for p in online.parameters():
            p.add_(0.1)
    old = [p.clone() for p in target.parameters()]
    assert not torch.equal(online[1].running_mean, target[1].running_mean)
    update_target(online, target, tau)
    target_buffers = dict(target.named_buffers())
    assert set(target_buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for name, buffer in online.named_buffers():
        assert torch.equal(target_buffers[name], buffer), name
    for t, o, p in zip(target.parameters(), old, online.parameters(), strict=True):
        torch.testing.assert_close(t, tau * p + (1 - tau) * o)


def test_act_is_greedy_at_epsilon_zero_and_random_at_rate_epsilon():
    torch.manual_seed(0)
    tr = DQNTrainer(OBS_DIM, N_ACTIONS, hidden=(8, 8))
    obs = torch.randn(3000, OBS_DIM)
    with torch.no_grad():
        greedy = tr.online(obs).argmax(1)
    assert torch.equal(tr.act(obs, 0.0), greedy)
    # epsilon 1: a uniform random action in every row, whatever the greedy one.
    actions = tr.act(obs, 1.0)
    assert (torch.bincount(actions, minlength=N_ACTIONS) > 800).all()  # ~1000 each
    assert 0.6 < (actions != greedy).float().mean().item() < 0.73  # 2/3
    # epsilon 0.1: a random action in ~10% of rows, so ~0.1 * 2/3 of them differ from the greedy one.
    assert 0.04 < (tr.act(obs, 0.1) != greedy).float().mean().item() < 0.1


# ---------------------------------------------------------------- the loss compiled ahead (inductor)
# Each new batch signature or loss setting compiles a graph (a few seconds, C++): the cases below
# cover every pair of (double, loss_type, weighted) values in four graphs.
@pytest.fixture(scope="module")
def compiled_loss() -> CompiledFunction:
    return CompiledFunction(q_loss_grads_flat)


@pytest.mark.parametrize(("double", "loss_type", "weighted"),
                         [(False, "mse", False), (False, "huber", True), (True, "mse", True), (True, "huber", False)])
def test_compiled_manual_grad_matches_reference(compiled_loss, double, loss_type, weighted):
    online, target = _nets(hidden=(8, 8))
    batch = make_batch(weighted=weighted)
    batch["n_step_return"] = batch["n_step_return"] * 3  # both Huber branches
    graphs = compiled_loss.compiled_graphs
    loss, td, q_taken = q_loss_manual_grad(online, target, batch, double, loss_type, compiled=compiled_loss)
    assert compiled_loss.compiled_graphs == graphs + 1
    ref_online, _ = _assert_matches_reference(online, target, batch, double, loss_type, loss, td, q_taken)
    assert all(p.grad is None for p in target.parameters())
    # The same signature runs the same graph (new tensors, other values) and accumulates like autograd.
    q_loss_manual_grad(online, target, {k: v.clone() for k, v in batch.items()}, double, loss_type,
                       compiled=compiled_loss)
    assert compiled_loss.compiled_graphs == graphs + 1
    for p, r in zip(online.parameters(), ref_online.parameters(), strict=True):
        torch.testing.assert_close(p.grad, 2 * r.grad, atol=1e-6, rtol=0)


def test_compiled_loss_compiles_per_signature_and_follows_weight_updates(compiled_loss):
    """A graph runs only on the shapes, strides and dtypes it was compiled for; anything else compiles
    another graph, and in-place weight updates (the optimizer) are seen without recompiling."""
    online, target = _nets(hidden=(8, 8))

    def check(batch: dict, expected_graphs: int) -> None:
        for net in (online, target):
            for p in net.parameters():
                p.grad = None
        loss, td, _ = q_loss_manual_grad(online, target, batch, double=True, compiled=compiled_loss)
        eager = copy.deepcopy(online)
        eager_loss, eager_td, _ = q_loss_manual_grad(eager, target, batch, double=True)
        assert compiled_loss.compiled_graphs == expected_graphs
        torch.testing.assert_close(loss, eager_loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(td, eager_td, atol=1e-6, rtol=0)
        for p, r in zip(online.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=0)

    graphs = compiled_loss.compiled_graphs
    check(make_batch(B=16), graphs + 1)
    with torch.no_grad():
        for p in online.parameters():
            p.mul_(-1.5)  # in place: the same views, the same graph
    check(make_batch(B=16, seed=1), graphs + 1)
    check(make_batch(B=12), graphs + 2)  # another batch size
    # Inputs at an odd offset into a larger tensor (misaligned for vector loads) give the same numbers.
    batch = make_batch(B=16, seed=2)
    for name in ("n_step_return", "bootstrap_discount"):
        batch[name] = torch.cat([torch.zeros(1), batch[name]])[1:]
    check(batch, graphs + 2)
    # Another batch stride (a column slice) and another weight dtype each compile a graph.
    batch = make_batch(B=16, seed=3)
    batch["obs"] = torch.cat([batch["obs"], batch["obs"]], dim=1)[:, :OBS_DIM]
    check(batch, graphs + 3)
    online.double()
    target.double()
    check(make_batch(B=16, seed=4), graphs + 4)
    online, target = _nets(hidden=(6, 6))  # other networks, the same batch signature: their own graph
    check(make_batch(B=16, seed=5), graphs + 5)


def test_compiled_loss_first_called_with_one_tensor_in_two_slots_stays_right_for_distinct_ones():
    """A graph first compiled with the online network as its own target (or obs as bootstrap obs) must
    not assume those slots alias: later calls pass distinct tensors with the same signature."""
    compiled = CompiledFunction(q_loss_grads_flat)
    online, target = _nets(hidden=(8, 8))
    aliased = make_batch(seed=1)
    aliased["bootstrap_obs"] = aliased["obs"]
    q_loss_manual_grad(online, online, aliased, double=True, compiled=compiled)
    for p in online.parameters():
        p.grad = None
    batch = make_batch(seed=2)
    loss, td, _ = q_loss_manual_grad(online, target, batch, double=True, compiled=compiled)
    assert compiled.compiled_graphs == 1
    eager = copy.deepcopy(online)
    for p in eager.parameters():
        p.grad = None
    eager_loss, eager_td, _ = q_loss_manual_grad(eager, target, batch, double=True)
    torch.testing.assert_close(loss, eager_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(td, eager_td, atol=1e-6, rtol=0)
    for p, r in zip(online.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=0)


def test_trainer_compiled_loss_strategy_steps_like_the_eager_trainer():
    torch.manual_seed(0)
    eager = DQNTrainer(OBS_DIM, N_ACTIONS, hidden=(8, 8), lr=1e-2, target_update_every=2)
    torch.manual_seed(0)
    compiled = DQNTrainer(OBS_DIM, N_ACTIONS, hidden=(8, 8), lr=1e-2, target_update_every=2,
                          loss_strategy="compiled")
    for step in range(4):  # double DQN, Huber (the defaults), through a target update
        batch = make_batch(seed=step)
        out, ref = compiled.step(batch), eager.step(batch)
        torch.testing.assert_close(out["loss"], ref["loss"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["td_error"], ref["td_error"], atol=1e-5, rtol=1e-5)
    for p, r in zip(compiled.online.parameters(), eager.online.parameters(), strict=True):
        torch.testing.assert_close(p, r, atol=1e-5, rtol=1e-5)
    assert compiled.loss_strategy.compiled.compiled_graphs == 1
    # compile_for compiles a new signature without touching the networks or their gradients.
    before = [(p.detach().clone(), p.grad.clone()) for p in compiled.online.parameters()]
    compiled.compile_for(make_batch(B=12))
    assert compiled.loss_strategy.compiled.compiled_graphs == 2
    for p, (value, grad) in zip(compiled.online.parameters(), before, strict=True):
        torch.testing.assert_close(p, value, atol=0, rtol=0)
        torch.testing.assert_close(p.grad, grad, atol=0, rtol=0)
    with pytest.raises(ValueError, match="compile_for needs DQNTrainer"):
        eager.compile_for(make_batch())


@pytest.mark.parametrize(("settings", "message"), [
    ({"loss_strategy": "fast"},
     r"loss_strategy must be one of 'auto', 'autograd', 'manual', 'compiled', got 'fast'"),
    ({"loss_strategy": "manual", "network": torch.nn.Sequential(torch.nn.Linear(OBS_DIM, N_ACTIONS))},
     r"loss_strategy='manual' needs a QNetwork, got Sequential"),
    ({"loss_strategy": "compiled", "network": torch.nn.Sequential(torch.nn.Linear(OBS_DIM, N_ACTIONS))},
     r"loss_strategy='compiled' needs a QNetwork, got Sequential"),
    ({"loss_strategy": "compiled", "device": "meta"},
     r"loss_strategy='compiled' runs on the CPU only, got device meta"),
])
def test_bad_loss_strategies_raise(settings, message):
    with pytest.raises(ValueError, match=message):
        DQNTrainer(OBS_DIM, N_ACTIONS, **settings)


def test_auto_loss_strategy_takes_autograd_for_other_networks():
    network = torch.nn.Sequential(torch.nn.Linear(OBS_DIM, N_ACTIONS))
    assert DQNTrainer(OBS_DIM, N_ACTIONS, network=network).loss_strategy.name == "autograd"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_non_integer_actions_are_refused_not_truncated(dtype):
    """``.long()`` turned actions [1.7, 0.2, ...] into [1, 0, ...] and trained on those."""
    online, target = _nets()
    batch = make_batch()
    batch["action"] = (batch["action"] + 0.7).to(dtype)
    message = rf"batch\['action'\]: expected an integer dtype, got {str(dtype).removeprefix('torch.')}"
    for loss in (q_loss, q_loss_manual_grad):
        with pytest.raises(ValueError, match=message):
            loss(online, target, batch)
    for strategy in ("autograd", "manual"):
        tr = DQNTrainer(OBS_DIM, N_ACTIONS, hidden=(8, 8), loss_strategy=strategy)
        before = [p.detach().clone() for p in tr.online.parameters()]
        with pytest.raises(ValueError, match=message):
            tr.step(batch)
        assert tr.steps == 0 and all(torch.equal(p, b) for p, b in zip(tr.online.parameters(), before, strict=True))


def test_compiled_trainer_refuses_non_integer_actions_before_compiling():
    tr = DQNTrainer(OBS_DIM, N_ACTIONS, hidden=(8, 8), loss_strategy="compiled")
    batch = dict(make_batch(), action=make_batch()["action"].float() + 0.5)
    for call in (tr.step, tr.compile_for):
        with pytest.raises(ValueError, match=r"batch\['action'\]: expected an integer dtype, got float32"):
            call(batch)
    assert tr.loss_strategy.compiled.compiled_graphs == 0


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_grad_norm": -1.0}, r"max_grad_norm must be None or finite and > 0, got -1.0"),  # climbed the loss
    ({"max_grad_norm": 0.0}, r"max_grad_norm must be None or finite and > 0, got 0.0"),  # zeroed the gradients
    ({"max_grad_norm": float("nan")}, r"max_grad_norm must be None or finite and > 0, got nan"),
    ({"target_update_every": float("nan")}, r"target_update_every must be an integer >= 1, got nan"),  # never
    ({"target_update_every": 2.5}, r"target_update_every must be an integer >= 1, got 2.5"),  # every 5 steps
    ({"target_update_every": 0}, r"target_update_every must be an integer >= 1, got 0"),
    ({"lr": 0.0}, r"lr must be finite and > 0, got 0.0"),  # never trained
    ({"lr": float("inf")}, r"lr must be finite and > 0, got inf"),
    ({"tau": float("nan")}, r"tau must be in \(0, 1\], got nan"),
])
def test_bad_trainer_settings_raise(settings, message):
    with pytest.raises(ValueError, match=message):
        DQNTrainer(OBS_DIM, N_ACTIONS, **settings)


@pytest.mark.parametrize("epsilon", [float("nan"), -0.5, 1.5])
def test_act_refuses_epsilon_outside_zero_to_one(epsilon):
    """NaN and -0.5 acted greedily, 1.5 as 1."""
    tr = DQNTrainer(OBS_DIM, N_ACTIONS, hidden=(8, 8))
    with pytest.raises(ValueError, match=rf"epsilon must be in \[0, 1\], got {epsilon}"):
        tr.act(torch.zeros(2, OBS_DIM), epsilon=epsilon)
    assert tr.act(torch.zeros(2, OBS_DIM), epsilon=1.0).shape == (2,)
