"""PPO rollouts over gRPC: actors push parts, the learner streams minibatches, versions gate pushes."""

from __future__ import annotations

import re
import time

import grpc
import numpy as np
import pytest

from replayd.client import ReplayClient
from replayd.client.actors.ppo import PPOActorConfig, Rollout, push
from replayd.server.gae import compute_gae
from replayd.server.server import ReplayServer
from replayd.wire import codec
from replayd.wire import replay_pb2 as pb
from replayd.wire import replay_pb2_grpc as pb_grpc
from tests.conftest import TEST_INSTANCE, rpc_status

T, N = 16, 8
ENVS = 2  # one actor's slots in the push race test
SCHEMA = {"obs": ("float32", (3,)), "action": ("int64", ()), "log_prob": ("float32", ())}


def part(rng: np.random.Generator, steps: int, envs: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.normal(size=(steps, envs, 3)).astype(np.float32),
        "action": rng.integers(0, 4, (steps, envs)),
        "log_prob": rng.normal(size=(steps, envs)).astype(np.float32),
        "reward": rng.normal(size=(steps, envs)).astype(np.float32),
        "value": rng.normal(size=(steps, envs)).astype(np.float32),
        "terminated": rng.random((steps, envs)) < 0.1,
        "truncated": rng.random((steps, envs)) < 0.05,
        "final_value": rng.normal(size=(steps, envs)).astype(np.float32),
    }


def test_actors_push_learner_streams_minibatches(client: ReplayClient) -> None:
    rng = np.random.default_rng(0)
    info = client.create_rollout_buffer("ppo", T, N, SCHEMA, gamma=0.9, gae_lambda=0.8)
    assert info["kind"] == "rollout" and info["missing_steps"] == T * N
    full = part(rng, T, N)
    bootstrap = rng.normal(size=N).astype(np.float32)
    # two actors, each owning half of the env slots, pushing in two time chunks
    for env_start in (0, N // 2):
        envs = slice(env_start, env_start + N // 2)
        first = client.push_rollout("ppo", 0, env_start, 0, **{k: v[:10, envs] for k, v in full.items()})
        assert not first["rollout_complete"]
        last = client.push_rollout("ppo", 0, env_start, 10, bootstrap_value=bootstrap[envs],
                                   **{k: v[10:, envs] for k, v in full.items()})
    assert last["rollout_complete"] and last["missing_steps"] == 0

    advantage, returns = np.zeros((T, N), np.float32), np.zeros((T, N), np.float32)
    compute_gae(full["reward"], full["value"], full["terminated"], full["truncated"], full["final_value"], bootstrap,
                0.9, 0.8, advantage, returns)
    seen = np.zeros(T * N, int)
    stream = client.rollout_minibatches("ppo", 24, epochs=2, normalize_advantages=False, seed=3)
    assert stream._call.time_remaining() is None  # no deadline: the client's 20 s unary timeout would end updates
    batches = list(stream)
    assert len(batches) == 2 * int(np.ceil(T * N / 24))
    for batch in batches:
        # identify each sample by its (unique) value; check its advantage and return against GAE
        index = np.array([np.flatnonzero(full["value"].reshape(-1) == v)[0] for v in batch["value"]])
        seen[index] += 1
        np.testing.assert_allclose(batch["advantage"], advantage.reshape(-1)[index], rtol=1e-6)
        np.testing.assert_allclose(batch["return"], returns.reshape(-1)[index], rtol=1e-6)
        np.testing.assert_array_equal(batch["obs"], full["obs"].reshape(-1, 3)[index])
    np.testing.assert_array_equal(seen, 2)  # every sample exactly once per epoch
    assert client.describe("ppo")["counters"]["served_samples"] == 2 * T * N  # the status page's samples/s
    assert client.describe("ppo")["capacity_steps"] == T * N  # a rollout buffer has cells, not a ring


def test_stale_and_incomplete_rollouts_are_rejected(client: ReplayClient) -> None:
    rng = np.random.default_rng(1)
    client.create_rollout_buffer("ppo", T, N, SCHEMA)
    with pytest.raises(grpc.RpcError) as error:
        next(client.rollout_minibatches("ppo", 8))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "missing" in error.value.details()
    client.finish_rollout("ppo", 1)
    with pytest.raises(grpc.RpcError) as error:
        client.push_rollout("ppo", 0, 0, 0, **part(rng, 4, N))
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = client.describe("ppo")
    assert info["counters"]["stale_pushes"] == 1 and info["missing_steps"] == T * N and info["policy_version"] == 1
    bad = part(rng, 4, N)
    bad["obs"] = bad["obs"].astype(np.float64)
    with pytest.raises(grpc.RpcError) as error:
        client.push_rollout("ppo", 1, 0, 0, **bad)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "obs" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        client.sample("ppo", 4)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rollout" in error.value.details()


def test_actor_push_refused_as_too_new_is_pushed_again_once_the_learner_catches_up(
        client: ReplayClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner's finish_rollout lands between the refusal of a too-new push and the actor's check of
    the version: the part is still stored (not reported pushed and lost)."""
    rollout = Rollout(T, ENVS, (3,))
    client.create_rollout_buffer("race", T, ENVS, {"obs": ("float32", (3,)), "action": ("int64", ()),
                                                   "log_prob": ("float32", ())})
    client.finish_rollout("race", 1)
    real_push = client.push_rollout
    refusals = []

    def push_then_learner_finishes(buffer: str, version: int, *args, **kwargs) -> dict:
        try:
            return real_push(buffer, version, *args, **kwargs)
        except grpc.RpcError as exc:
            refusals.append(exc.details())
            client.finish_rollout("race", 2)  # the learner, right after the refusal
            raise

    monkeypatch.setattr(client, "push_rollout", push_then_learner_finishes)
    config = PPOActorConfig(address="unused", buffer="race", num_envs=ENVS, rollout_steps=T)
    assert push(client, config, 2, rollout, np.zeros(ENVS, np.float32), time.monotonic() + 30, lambda: False)
    assert len(refusals) == 1 and "policy_version" in refusals[0]
    info = client.describe("race")
    assert info["policy_version"] == 2 and info["rollout_complete"]  # the part landed


@pytest.mark.parametrize("landed", [True, False], ids=["response-lost", "server-unreachable"])
def test_actor_push_is_retried_while_the_server_is_unreachable(
        client: ReplayClient, monkeypatch: pytest.MonkeyPatch, landed: bool) -> None:
    """UNAVAILABLE on a push (the server restarting, or the response lost after the part landed): the actor
    retries; a retry of a part that landed is refused as "already pushed", and either way it counts as pushed."""
    rollout = Rollout(T, ENVS, (3,))
    client.create_rollout_buffer("retry", T, ENVS, SCHEMA)
    client.finish_rollout("retry", 1)
    real_push = client.push_rollout
    attempts = []

    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "injected"

    def flaky_push(*args, **kwargs) -> dict:
        attempts.append(1)
        if len(attempts) == 1:
            if landed:
                real_push(*args, **kwargs)
            raise Unavailable()
        return real_push(*args, **kwargs)

    monkeypatch.setattr(client, "push_rollout", flaky_push)
    config = PPOActorConfig(address="unused", buffer="retry", num_envs=ENVS, rollout_steps=T)
    assert push(client, config, 1, rollout, np.zeros(ENVS, np.float32), time.monotonic() + 30, lambda: False)
    assert len(attempts) == 2
    info = client.describe("retry")
    assert info["policy_version"] == 1 and info["rollout_complete"]


def test_actor_push_ends_when_the_rollout_buffer_was_created_again(client: ReplayClient) -> None:
    """A learner that restarted creates the buffer again at an older version: the actor's newer part can
    never be taken, nor can the learner's older rollout complete without the actor. The push raises
    instead of waiting on each other until the deadline; a deleted buffer raises too."""
    rollout = Rollout(T, ENVS, (3,))
    config = PPOActorConfig(address="unused", buffer="again", num_envs=ENVS, rollout_steps=T)
    client.create_rollout_buffer("again", T, ENVS, SCHEMA)
    client.finish_rollout("again", 2)
    assert push(client, config, 2, rollout, np.zeros(ENVS, np.float32), time.monotonic() + 30, lambda: False)
    client.delete_buffer("again")
    with pytest.raises(grpc.RpcError) as gone:
        push(client, config, 3, rollout, np.zeros(ENVS, np.float32), time.monotonic() + 30, lambda: False, 2)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    client.create_rollout_buffer("again", T, ENVS, SCHEMA)
    client.finish_rollout("again", 1)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="went back to policy version 1 after this actor pushed version 2"):
        push(client, config, 3, rollout, np.zeros(ENVS, np.float32), time.monotonic() + 30, lambda: False, 2)
    assert time.monotonic() - started < 10


def test_an_oversized_minibatch_is_refused_before_any_is_cut() -> None:
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}mb", max_message_bytes=2**20).start()
    try:
        with ReplayClient(server.address, timeout=20, max_message_bytes=2**20) as client:
            steps, envs = 8, 4
            client.create_rollout_buffer("wide", steps, envs, {"obs": ("float32", (16384,))})  # 64 KiB per cell
            rng = np.random.default_rng(0)
            columns = {k: v for k, v in part(rng, steps, envs).items() if k not in ("obs", "action", "log_prob")}
            for env in range(envs):  # one env per push: each request stays under the message limit
                client.push_rollout("wide", 0, env, 0, bootstrap_value=np.zeros(1, np.float32),
                                    obs=np.zeros((steps, 1, 16384), np.float32),
                                    **{k: v[:, env:env + 1] for k, v in columns.items()})
            arrays = server.registry.rollout("wide").shared.arrays
            before = {name: array.copy() for name, array in arrays.items()}
            code, details = rpc_status(lambda: list(client.rollout_minibatches("wide", 32)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "minibatch_size=32" in details and "max_message_bytes=1048576" in details
            counters = client.describe("wide")["counters"]
            assert counters["minibatches_served"] == 0 and counters.get("gae_computations", 0) == 0  # GAE ran first
            for name, array in arrays.items():
                np.testing.assert_array_equal(array, before[name], err_msg=name)
            assert [b["obs"].shape for b in client.rollout_minibatches("wide", 8)] == [(8, 16384)] * 4
    finally:
        server.stop(grace=0)


def _full_rollout(client: ReplayClient, rng: np.random.Generator) -> dict[str, np.ndarray]:
    client.create_rollout_buffer("ppo", T, N, SCHEMA)
    full = part(rng, T, N)
    client.push_rollout("ppo", 0, 0, 0, bootstrap_value=rng.normal(size=N).astype(np.float32), **full)
    return full


def _push_request(rng: np.random.Generator, bootstrap: dict[str, np.ndarray]) -> pb.PushRolloutRequest:
    """A raw PushRolloutRequest of the whole rollout, as any gRPC client may send it."""
    flat = {name: array.reshape(T * N, *array.shape[2:]) for name, array in part(rng, T, N).items()}
    return pb.PushRolloutRequest(buffer="ppo", policy_version=0, env_start=0, step_start=0, num_envs=N,
                                 steps=codec.encode(flat), bootstrap=codec.encode(bootstrap))


def test_a_bootstrap_with_more_than_the_value_column_is_refused(server: ReplayServer, client: ReplayClient) -> None:
    rng = np.random.default_rng(4)
    client.create_rollout_buffer("ppo", T, N, SCHEMA)
    values = np.zeros(N, np.float32)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ReplayStub(channel)
        for bootstrap in ({"value": values, "x": values}, {"values": values}):
            code, details = rpc_status(stub.PushRollout, _push_request(rng, bootstrap), timeout=20)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert re.search(r"bootstrap must hold exactly one column 'value', got \[", details), details
        info = client.describe("ppo")
        assert info["missing_steps"] == T * N and not info["rollout_complete"]  # nothing was written
        response = stub.PushRollout(_push_request(rng, {"value": values}), timeout=20)
        assert response.rollout_complete and response.missing_steps == 0



def test_a_part_larger_than_the_rollout_names_its_size(server: ReplayServer, client: ReplayClient) -> None:
    """A part of more env slots (num_envs) or steps than the buffer holds: the message says so, not that
    env_start = 0 (or step_start = 0) is out of a range no value fits ("0 <= env_start <= 4 - 8")."""
    rng = np.random.default_rng(6)
    client.create_rollout_buffer("ppo", T, N, SCHEMA)
    wide = _push_request(rng, {"value": np.zeros(2 * N, np.float32)})
    wide.num_envs = 2 * N  # the same rows as T / 2 steps of 2 N envs
    long = _push_request(rng, {"value": np.zeros(1, np.float32)})
    long.num_envs = 1  # T N steps of one env
    empty = _push_request(rng, {"value": np.zeros(1, np.float32)})
    empty.steps = codec.encode({name: array[:0] for name, array in codec.decode(empty.steps).items()})
    empty.num_envs = 2**62  # divides the 0 rows; as (0, 2**62) cells the rows would not even be shaped
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ReplayStub(channel)
        code, details = rpc_status(stub.PushRollout, wide, timeout=20)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith(f"num_envs: expected <= {N} (the buffer's env slots), got {2 * N}"), details
        code, details = rpc_status(stub.PushRollout, long, timeout=20)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith(f"push: expected <= {T} steps (the buffer's num_steps), got {T * N}"), details
        code, details = rpc_status(stub.PushRollout, empty, timeout=20)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith(f"num_envs: expected <= {N} (the buffer's env slots), got {2**62}"), details
    assert client.describe("ppo")["missing_steps"] == T * N

def test_a_minibatch_request_without_epochs_streams_one_epoch(server: ReplayServer, client: ReplayClient) -> None:
    """epochs is 0 on the wire when a client leaves it out: one pass over the rollout, each sample once."""
    full = _full_rollout(client, np.random.default_rng(5))
    request = pb.RolloutMinibatchesRequest(buffer="ppo", minibatch_size=32, seed=1)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_stream("/replayd.v1.Replay/RolloutMinibatches",
                                    request_serializer=pb.RolloutMinibatchesRequest.SerializeToString,
                                    response_deserializer=pb.SampleResponse.FromString)
        batches = [codec.decode(response.batch) for response in call(request, timeout=20)]
    assert len(batches) == T * N // 32
    values = np.sort(np.concatenate([batch["value"] for batch in batches]))
    np.testing.assert_array_equal(values, np.sort(full["value"].reshape(-1)))


def test_a_rollout_config_without_gamma_and_lambda_gets_the_defaults(server: ReplayServer) -> None:
    """gamma and gae_lambda have presence: a client that sets neither gets 0.99 and 0.95 (as the proto says)."""
    config = pb.RolloutConfig(fields=[pb.FieldSpec(name="obs", dtype="float32", shape=[3])], num_steps=T, num_envs=N)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ReplayStub(channel)
        created = stub.CreateBuffer(pb.CreateBufferRequest(name="ppo", rollout=config), timeout=20)
        described = stub.DescribeBuffer(pb.DescribeBufferRequest(name="ppo"), timeout=20)
    for info in (created, described):
        assert info.rollout.HasField("gamma") and info.rollout.gamma == 0.99
        assert info.rollout.HasField("gae_lambda") and info.rollout.gae_lambda == 0.95


def test_a_partly_pushed_rollout_describes_the_steps_it_holds(client: ReplayClient) -> None:
    rng = np.random.default_rng(6)
    client.create_rollout_buffer("ppo", T, 4, SCHEMA)
    client.push_rollout("ppo", 0, 0, 0, bootstrap_value=np.zeros(1, np.float32), **part(rng, T, 1))  # env 0 of 4
    info = client.describe("ppo")
    assert info["stored_steps"] == T and info["missing_steps"] == 3 * T and info["capacity_steps"] == 4 * T
    client.push_rollout("ppo", 0, 1, 0, **part(rng, T // 2, 2))  # envs 1-2, the first half
    assert client.describe("ppo")["stored_steps"] == T + T // 2 * 2


@pytest.mark.parametrize("epochs", [0, -1, 1.5, True, None])
def test_epochs_that_are_not_an_integer_of_at_least_1_are_refused(client: ReplayClient, epochs) -> None:
    """epochs=0 is the wire's "not set": the server would run one epoch."""
    client.create_rollout_buffer("ppo", T, N, SCHEMA)
    with pytest.raises(ValueError, match=re.escape(f"epochs: expected an integer >= 1, got {epochs!r}")):
        client.rollout_minibatches("ppo", 8, epochs=epochs)


@pytest.mark.parametrize("option", ["minibatch_size", "normalize_advantages", "drop_last"])
def test_minibatch_options_given_as_none_are_refused(client: ReplayClient, option: str) -> None:
    """protobuf takes None as "not set": normalize_advantages (True by default) would be False, a size 0."""
    client.create_rollout_buffer("ppo", T, N, SCHEMA)
    arguments = {"minibatch_size": 8, option: None}
    with pytest.raises(ValueError, match=re.escape(f"{option}: expected a value, got None")):
        client.rollout_minibatches("ppo", **arguments)


@pytest.mark.parametrize(("value", "env", "message"), [
    (1e39, 1, "got 1e+39 at env 1 of the part (float32 makes it inf)"),  # the server would report inf
    (-1e-46, 2, "got -1e-46 at env 2 of the part (float32 makes it -0.0)"),  # silently 0
])
def test_a_bootstrap_value_float32_cannot_hold_is_refused(client: ReplayClient, value: float, env: int,
                                                           message: str) -> None:
    rng = np.random.default_rng(7)
    client.create_rollout_buffer("ppo", T, N, SCHEMA)
    bootstrap = np.zeros(N)  # float64, as an actor's critic in float64 would give it
    bootstrap[env] = value
    with pytest.raises(ValueError, match=re.escape(f"bootstrap_value: expected values float32 can hold, {message}")):
        client.push_rollout("ppo", 0, 0, 0, bootstrap_value=bootstrap, **part(rng, T, N))
    assert client.describe("ppo")["missing_steps"] == T * N  # nothing was sent
    bootstrap[env] = 1e-40  # a float32 subnormal: kept
    assert client.push_rollout("ppo", 0, 0, 0, bootstrap_value=bootstrap, **part(rng, T, N))["rollout_complete"]
