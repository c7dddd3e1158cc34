"""RolloutBuffer: in-place pushes, policy versions, validation, minibatches, reuse of shared memory."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from replayd.server.buffers.rollout import RolloutBuffer, RolloutConfig, RolloutField
from replayd.server.gae import GaeWorkspace, compute_gae
from replayd.wire.errors import FailedPrecondition, InvalidArgument, NotFound

T, N, OBS = 8, 6, 3
INSTANCE = f"test{os.getpid()}"
PREFIX = f"rpd_{INSTANCE}_"


def leftover_segments() -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(PREFIX))


@pytest.fixture(autouse=True)
def no_leaked_rollout_segments():
    yield
    assert leftover_segments() == []


@pytest.fixture
def make_buffer():
    created = []

    def make(num_steps=T, num_envs=N, version=0, **kw):
        config = RolloutConfig(
            fields=(RolloutField("obs", "float32", (OBS,)), RolloutField("action", "int64")),
            num_steps=num_steps, num_envs=num_envs, **kw,
        )
        buffer = RolloutBuffer.create(f"b{uuid.uuid4().hex[:8]}", INSTANCE, config, policy_version=version)
        created.append(buffer)
        return buffer

    yield make
    for buffer in created:
        buffer.close()
        buffer.unlink()


def part(rng, steps, envs, offset=0.0):
    return {
        "obs": rng.standard_normal((steps, envs, OBS)).astype(np.float32) + offset,
        "action": rng.integers(0, 4, (steps, envs)),
        "reward": rng.standard_normal((steps, envs)).astype(np.float32),
        "value": rng.standard_normal((steps, envs)).astype(np.float32),
        "terminated": rng.random((steps, envs)) < 0.1,
        "truncated": rng.random((steps, envs)) < 0.1,
        "final_value": rng.standard_normal((steps, envs)).astype(np.float32),
    }


def fill(buffer, rng, version=None, env_chunk=2, step_chunk=4):
    """Pushes a whole random rollout in (step_chunk x env_chunk) parts; returns it as (T, N) arrays."""
    version = buffer.policy_version if version is None else version
    full = part(rng, buffer.config.num_steps, buffer.config.num_envs)
    bootstrap = rng.standard_normal(buffer.config.num_envs).astype(np.float32)
    for e in range(0, buffer.config.num_envs, env_chunk):
        for s in range(0, buffer.config.num_steps, step_chunk):
            cells = (slice(s, s + step_chunk), slice(e, e + env_chunk))
            last = s + step_chunk >= buffer.config.num_steps
            buffer.push(version, e, s, {k: v[cells] for k, v in full.items()},
                        bootstrap[e : e + env_chunk] if last else None)
    return full, bootstrap


def snapshot(buffer):
    return {name: array.copy() for name, array in buffer.shared.arrays.items()}


def assert_unchanged(buffer, before):
    for name, array in buffer.shared.arrays.items():
        assert array.tobytes() == before[name].tobytes(), name


def test_push_lands_in_place_and_gae_matches(make_buffer):
    buffer = make_buffer(gamma=0.9, gae_lambda=0.8)
    full, bootstrap = fill(buffer, np.random.default_rng(0))
    assert buffer.rollout_complete and buffer.missing_steps == 0
    for name, array in full.items():
        np.testing.assert_array_equal(buffer.columns[name], array)
    buffer.compute_advantages()
    adv, ret = np.empty((T, N), np.float32), np.empty((T, N), np.float32)
    compute_gae(full["reward"], full["value"], full["terminated"], full["truncated"], full["final_value"],
                bootstrap, 0.9, 0.8, adv, ret, GaeWorkspace(T, N))
    np.testing.assert_array_equal(buffer.advantage, adv)
    np.testing.assert_array_equal(buffer.returns, ret)


def test_calls_on_a_deleted_buffer_get_not_found(make_buffer):
    buffer = make_buffer()
    full, _ = fill(buffer, np.random.default_rng(0))
    buffer.close()
    with pytest.raises(NotFound, match=f"buffer {buffer.name!r} was deleted"):  # its name, not its segment's
        buffer.push(0, 0, 0, {k: v[:1, :1] for k, v in full.items()}, None)
    with pytest.raises(NotFound, match="was deleted"):
        next(buffer.minibatches(4))
    with pytest.raises(NotFound, match="was deleted"):
        buffer.finish_rollout(1)


def test_minibatches_stay_bound_to_the_rollout_they_checked(make_buffer, monkeypatch):
    """A FinishRollout landing between the completeness check and the stream's start must not make the
    stream serve the next (empty) rollout's cells."""
    buffer = make_buffer()
    fill(buffer, np.random.default_rng(0))
    checked = buffer.compute_advantages

    def then_another_thread_finishes() -> int:
        version = checked()
        buffer.finish_rollout(version + 1)
        return version

    monkeypatch.setattr(buffer, "compute_advantages", then_another_thread_finishes)
    stream = buffer.minibatches(8)
    with pytest.raises(FailedPrecondition, match="minibatches were for 0, the buffer moved on to 1"):
        next(stream)


def test_missing_cells_reported(make_buffer):
    buffer = make_buffer()
    rng = np.random.default_rng(1)
    buffer.push(0, 0, 0, part(rng, 4, 2))  # steps [0, 4) of envs [0, 2)
    buffer.push(0, 2, 0, part(rng, T, 4), np.zeros(4, np.float32))  # envs [2, 6) complete
    assert buffer.missing_steps == 2 * (T - 4)
    assert not buffer.rollout_complete
    assert buffer.missing_ranges() == [{"env_start": 0, "env_stop": 2, "step_ranges": [(4, T)]}]
    info = buffer.info()
    assert (info["missing_steps"], info["rollout_complete"], info["policy_version"]) == (8, False, 0)
    with pytest.raises(FailedPrecondition, match=r"8 missing.*envs \[0, 2\) steps \[\(4, 8\)\]"):
        buffer.minibatches(4)


def test_stale_push_rejected_counted_and_nothing_lands(make_buffer):
    buffer = make_buffer(version=3)
    rng = np.random.default_rng(2)
    buffer.push(3, 0, 0, part(rng, 4, 2))
    buffer.finish_rollout(4)
    buffer.push(4, 2, 0, part(rng, 4, 2))
    before = snapshot(buffer)
    with pytest.raises(FailedPrecondition, match=r"policy_version.*expected 4.*stale 3"):
        buffer.push(3, 0, 4, part(rng, 4, 2, offset=100.0), np.ones(2, np.float32))
    assert_unchanged(buffer, before)
    assert buffer.info()["counters"]["stale_pushes"] == 1
    assert buffer.missing_steps == T * N - 8
    with pytest.raises(FailedPrecondition, match=r"policy_version.*expected 4, got 5"):
        buffer.push(5, 0, 0, part(rng, 4, 2))
    assert_unchanged(buffer, before)
    assert buffer.info()["counters"]["stale_pushes"] == 1  # newer is rejected but is not stale


def test_double_push_rejected(make_buffer):
    buffer = make_buffer()
    rng = np.random.default_rng(3)
    buffer.push(0, 0, 0, part(rng, 4, 3))
    before = snapshot(buffer)
    with pytest.raises(FailedPrecondition, match=r"already pushed \(first: step 2, env 2\)"):
        buffer.push(0, 2, 2, part(rng, 2, 2))  # overlaps cells (2..3, 2)
    assert_unchanged(buffer, before)
    buffer.finish_rollout(1)
    buffer.push(1, 0, 0, part(rng, 4, 3))  # the same cells are free again under the next version


def test_a_push_overlapping_only_in_its_last_env_is_rejected_and_changes_nothing(make_buffer):
    buffer = make_buffer()
    rng = np.random.default_rng(3)
    buffer.push(0, 2, 0, part(rng, 4, 2))  # envs [2, 4)
    before = snapshot(buffer)
    with pytest.raises(FailedPrecondition, match=r"cells: .*1 already pushed \(first: step 0, env 2\)"):
        buffer.push(0, 1, 0, part(rng, 1, 2))  # envs [1, 3): only its last env, 2, was pushed
    assert_unchanged(buffer, before)
    assert buffer.missing_steps == T * N - 8
    assert buffer.info()["counters"]["rejected_pushes"] == 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.__setitem__("reward", c["reward"].astype(np.float64)), "'reward'.*float32.*float64"),
        (lambda c: c["value"].__setitem__((1, 0), np.nan), r"'value': expected finite values, got nan at \(step 1"),
        (lambda c: c["final_value"].__setitem__((0, 1), np.inf), "'final_value': expected finite values, got inf"),
        (lambda c: c.__setitem__("obs", c["obs"][..., :2]), r"'obs'.*\(2, 2, 3\).*\(2, 2, 2\)"),
        (lambda c: c.__setitem__("action", c["action"][:1]), r"'action'.*\(2, 2\).*\(1, 2\)"),
        (lambda c: c.pop("terminated"), "'terminated'.*missing"),
        (lambda c: c.__setitem__("advantage", c["value"]), "'advantage'.*not a column"),
        (lambda c: c.__setitem__("value", c["value"].tolist()), "'value'.*numpy array.*list"),
        (lambda c: c.update({k: v[:0] for k, v in c.items()}), r"push: expected >= 1 step.*\(0, 2\)"),
        (lambda c: c.update({k: v[:, :0] for k, v in c.items()}), r"push: expected >= 1 step.*\(2, 0\)"),
    ],
)
def test_malformed_push_names_field_and_changes_nothing(make_buffer, mutate, message):
    buffer = make_buffer()
    columns = part(np.random.default_rng(4), 2, 2)
    mutate(columns)
    before = snapshot(buffer)
    with pytest.raises(InvalidArgument, match=message):
        buffer.push(0, 0, 0, columns)
    assert_unchanged(buffer, before)
    assert buffer.info()["counters"]["rejected_pushes"] == 1


@pytest.mark.parametrize(
    "env_start, step_start, bootstrap, message",
    [
        (5, 0, None, "env_start.*got 5"),
        (-1, 0, None, "env_start.*got -1"),
        (0, 7, None, "step_start.*got 7"),
        (0, T - 2, None, "bootstrap_value: required"),
        (0, T - 2, np.zeros(2, np.float64), "bootstrap_value: expected dtype float32, got float64"),
        (0, T - 2, np.zeros(3, np.float32), r"bootstrap_value: expected shape \(2,\), got \(3,\)"),
        (0, 0, np.zeros(2, np.float32), "bootstrap_value: only valid"),
        (0, T - 2, np.array([0, np.nan], np.float32), "bootstrap_value: expected finite values, got nan at env 1"),
        (0, T - 2, np.array([np.inf, 0], np.float32), "bootstrap_value: expected finite values, got inf at env 0"),
    ],
)
def test_bad_ranges_and_bootstrap_rejected(make_buffer, env_start, step_start, bootstrap, message):
    buffer = make_buffer()
    before = snapshot(buffer)
    with pytest.raises(InvalidArgument, match=message):
        buffer.push(0, env_start, step_start, part(np.random.default_rng(5), 2, 2), bootstrap)
    assert_unchanged(buffer, before)


def test_minibatches_cover_every_sample_once_per_epoch(make_buffer):
    buffer = make_buffer()
    full, _ = fill(buffer, np.random.default_rng(6))
    full["obs"][..., 0] = np.arange(T * N).reshape(T, N)  # tag samples by their time-major index
    buffer.columns["obs"][..., 0] = full["obs"][..., 0]
    batches = list(buffer.minibatches(5, epochs=3, normalize_advantages=False, seed=0))
    assert [len(b["obs"]) for b in batches] == [5] * 9 + [3] + [5] * 9 + [3] + [5] * 9 + [3]
    epochs = [np.concatenate([b["obs"][:, 0] for b in batches[i * 10 : (i + 1) * 10]]) for i in range(3)]
    for ids in epochs:
        np.testing.assert_array_equal(np.sort(ids), np.arange(T * N))
    assert not np.array_equal(epochs[0], epochs[1])  # a fresh permutation per epoch
    flat_index = epochs[0][:5].astype(int)
    first = batches[0]
    assert set(first) == set(full) | {"advantage", "return"}
    for name, array in full.items():
        if name != "obs":
            np.testing.assert_array_equal(first[name], array.reshape(T * N, *array.shape[2:])[flat_index])
    np.testing.assert_array_equal(first["advantage"], buffer.advantage.reshape(-1)[flat_index])
    np.testing.assert_array_equal(first["return"], buffer.returns.reshape(-1)[flat_index])
    assert buffer.info()["counters"]["minibatches_served"] == 30

    kept = list(buffer.minibatches(5, epochs=2, drop_last=True, seed=1))
    assert [len(b["reward"]) for b in kept] == [5] * 18
    assert len({int(i) for b in kept[:9] for i in b["obs"][:, 0]}) == 45


def test_advantages_normalized_per_minibatch(make_buffer):
    buffer = make_buffer()
    fill(buffer, np.random.default_rng(7))
    raw = list(buffer.minibatches(16, normalize_advantages=False, seed=3))
    normalized = list(buffer.minibatches(16, normalize_advantages=True, seed=3))
    for r, n in zip(raw, normalized, strict=True):
        a = r["advantage"].astype(np.float64)
        expected = (a - a.mean()) / (a.std(ddof=1) + 1e-8)
        np.testing.assert_allclose(n["advantage"], expected, rtol=1e-5, atol=1e-6)
        assert n["advantage"].dtype == np.float32
        np.testing.assert_array_equal(n["return"], r["return"])
    assert abs(float(normalized[0]["advantage"].mean())) < 1e-5


def test_minibatch_arguments_checked_eagerly(make_buffer):
    buffer = make_buffer()
    fill(buffer, np.random.default_rng(8))
    with pytest.raises(InvalidArgument, match="minibatch_size"):
        buffer.minibatches(0)
    with pytest.raises(InvalidArgument, match="minibatch_size"):
        buffer.minibatches(T * N + 1)
    with pytest.raises(InvalidArgument, match="epochs"):
        buffer.minibatches(4, epochs=0)
    stream = buffer.minibatches(4)
    next(stream)
    buffer.finish_rollout(1)
    with pytest.raises(FailedPrecondition, match="moved on"):
        next(stream)


def test_finish_rollout_requires_newer_version(make_buffer):
    buffer = make_buffer(version=2)
    with pytest.raises(FailedPrecondition, match=r"next_version.*> 2, got 2"):
        buffer.finish_rollout(2)
    buffer.finish_rollout(5)
    assert (buffer.policy_version, buffer.missing_steps) == (5, T * N)


def test_arrays_reused_across_rollouts(make_buffer):
    buffer = make_buffer()
    rng = np.random.default_rng(9)
    addresses = {name: a.__array_interface__["data"][0] for name, a in buffer.shared.arrays.items()}
    objects = {name: id(a) for name, a in buffer.shared.arrays.items()}
    for version in range(4):
        full, _ = fill(buffer, rng, env_chunk=3, step_chunk=8)
        next(buffer.minibatches(T * N))
        np.testing.assert_array_equal(buffer.columns["obs"], full["obs"])
        buffer.finish_rollout(version + 1)
    assert {name: a.__array_interface__["data"][0] for name, a in buffer.shared.arrays.items()} == addresses
    assert {name: id(a) for name, a in buffer.shared.arrays.items()} == objects
    assert buffer.info()["counters"]["gae_computations"] == 4


def test_sample_bytes_counts_every_cell_and_the_computed_advantage_and_return(make_buffer):
    """The server sizes minibatches against its message limit with sample_bytes: every byte must count."""
    buffer = make_buffer()
    cells = 4 * OBS + 8 + 4 + 4 + 1 + 1 + 4  # obs, action, reward, value, terminated, truncated, final_value
    assert buffer.sample_bytes == cells + 4 + 4  # advantage, return
    fill(buffer, np.random.default_rng(10))
    batch = next(buffer.minibatches(1))
    assert buffer.sample_bytes == sum(array.nbytes for array in batch.values())


def test_config_validation():
    with pytest.raises(InvalidArgument, match=r"'advantage'.*reserved"):
        RolloutConfig(fields=(RolloutField("advantage", "float32"),), num_steps=2, num_envs=2)
    with pytest.raises(InvalidArgument, match=r"'_filled'.*reserved"):  # the fill mask's own name
        RolloutConfig(fields=(RolloutField("_filled", "bool"),), num_steps=2, num_envs=2)
    with pytest.raises(InvalidArgument, match=r"'obs': listed twice"):
        RolloutConfig(fields=(RolloutField("obs", "float32", (3,)), RolloutField("obs", "float32", (4,))),
                      num_steps=2, num_envs=2)
    with pytest.raises(InvalidArgument, match=r"'obs'.*positive"):
        RolloutConfig(fields=(RolloutField("obs", "float32", (0,)),), num_steps=2, num_envs=2)
    with pytest.raises(InvalidArgument, match=r"gamma: expected a value in \[0, 1\], got 1.5"):
        RolloutConfig(fields=(), num_steps=2, num_envs=2, gamma=1.5)
    with pytest.raises(InvalidArgument, match=r"gae_lambda: expected a value in \[0, 1\], got -0.1"):
        RolloutConfig(fields=(), num_steps=2, num_envs=2, gae_lambda=-0.1)
    with pytest.raises(InvalidArgument, match=r"'reward'.*float32.*float64"):
        RolloutConfig(fields=(RolloutField("reward", "float64"),), num_steps=2, num_envs=2)
    with pytest.raises(InvalidArgument, match="num_envs"):
        RolloutConfig(fields=(), num_steps=2, num_envs=0)
    with pytest.raises(InvalidArgument, match=r"'obs'.*not supported"):
        RolloutConfig(fields=(RolloutField("obs", "complex64"),), num_steps=2, num_envs=2)
    with pytest.raises(InvalidArgument, match="buffer name 'no/pe'"):
        RolloutBuffer.create("no/pe", INSTANCE, RolloutConfig(fields=(), num_steps=2, num_envs=2))
