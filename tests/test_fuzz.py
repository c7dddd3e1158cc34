"""Hostile input at a live server: random and mutated protobuf bytes, mutated Arrow payloads, and
out-of-range request values, sent through raw (identity-serializer) calls.

Every call must end OK (the mutation happened to be valid) or with a client-error status, never INTERNAL;
a rejected call must leave every buffer's shared memory byte-identical; and the server must stay up.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replayd.client import ReplayClient
from replayd.client.replay_client import Span, spans_request
from replayd.server.server import ReplayServer
from replayd.server.storage.shared_arrays import SharedArrays
from replayd.wire import codec
from replayd.wire import replay_pb2 as pb
from replayd.wire.components import Prioritized

# The server persists across examples on purpose: state left by one hostile call is what the next one sees.
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SERVICE = "/replayd.v1.Replay/"
# Statuses that mean the server failed rather than the request: a missing validation, or a crash.
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.UNIMPLEMENTED}
EPISODIC_SCHEMA = {"obs": ("float32", (3,)), "action": ("int64", ()), "reward": ("float32", ())}
ROLLOUT_SCHEMA = {"obs": ("float32", (2,))}
STEPS, ENVS = 4, 2
UNARY = ["CreateBuffer", "DeleteBuffer", "DescribeBuffer", "Sample", "UpdatePriorities", "PushRollout",
         "FinishRollout", "PublishWeights", "FetchWeights"]
RESPONSE_STREAMING = ["SampleStream", "RolloutMinibatches"]


def _identity(data: bytes) -> bytes:
    return data


class Target:
    """The live server, its buffers' shared memory, and raw calls that check the invariants."""

    def __init__(self, server: ReplayServer, client: ReplayClient) -> None:
        self.server = server
        self.client = client
        self.channel = client._channel
        self.snapshot = self._take_snapshot()

    def _take_snapshot(self) -> dict[str, bytes]:
        state = {}
        for info in self.client.list_buffers():
            shared = SharedArrays.attach(info["shm_name"])
            try:
                state |= {f"{info['name']}/{name}": array.tobytes() for name, array in shared.arrays.items()}
            finally:
                shared.close()
        return state

    def call(self, method: str, payload: bytes) -> grpc.StatusCode:
        path = SERVICE + method
        try:
            if method == "Insert":
                self.channel.stream_unary(path, request_serializer=_identity, response_deserializer=_identity)(
                    iter([payload]), timeout=10)
            elif method in RESPONSE_STREAMING:
                call = self.channel.unary_stream(path, request_serializer=_identity,
                                                 response_deserializer=_identity)(payload, timeout=10)
                # A valid request may stream forever (num_batches=0): two batches are enough.
                for _, _ in zip(range(2), call, strict=False):
                    pass
                call.cancel()
            else:
                self.channel.unary_unary(path, request_serializer=_identity, response_deserializer=_identity)(
                    payload, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.CANCELLED:  # our own cancel after two batches
                code = grpc.StatusCode.OK
            assert code not in SERVER_FAULTS, f"{method}: {code.name}: {exc.details()}"
            assert exc.details(), f"{method}: {code.name} without a message"
        after = self._take_snapshot()
        if code != grpc.StatusCode.OK:
            changed = sorted(k for k in self.snapshot.keys() & after.keys() if self.snapshot[k] != after[k])
            assert not changed, f"{method} was rejected ({code.name}) but changed {changed}"
        self.snapshot = after
        return code

    def healthy(self) -> None:
        """A good call still succeeds."""
        batch = self.client.sample("ep", 4, seed=0)
        assert batch["obs"].shape == (4, 3)


def _episode(steps: int, reward: float = 1.0) -> dict[str, np.ndarray]:
    return {"obs": np.arange((steps + 1) * 3, dtype=np.float32).reshape(steps + 1, 3),
            "action": np.arange(steps + 1, dtype=np.int64), "reward": np.full(steps + 1, reward, np.float32)}


def _insert_request(columns: dict[str, np.ndarray], episode_id: int = 1) -> bytes:
    rows = len(next(iter(columns.values())))
    return spans_request("ep", [Span(columns, episode_id)]).serialize() if rows else b""


def _push_request(steps: bytes, bootstrap: bytes = b"", policy_version: int = 0, **fields: int) -> bytes:
    request = pb.PushRolloutRequest(buffer="ro", policy_version=policy_version, env_start=0, step_start=0,
                                    num_envs=ENVS, steps=steps, bootstrap=bootstrap)
    for name, value in fields.items():
        setattr(request, name, value)
    return request.SerializeToString()


def _rollout_columns() -> dict[str, np.ndarray]:
    rows = STEPS * ENVS
    return {"obs": np.ones((rows, 2), np.float32), "reward": np.ones(rows, np.float32),
            "value": np.zeros(rows, np.float32), "terminated": np.zeros(rows, bool),
            "truncated": np.zeros(rows, bool), "final_value": np.zeros(rows, np.float32)}


def _safetensors(data: bytes = b"\x00" * 16) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    return struct.pack("<Q", len(header)) + header + data


def _valid_requests() -> dict[str, bytes]:
    sample = pb.SampleRequest(buffer="ep", batch_size=4,
                              mode=pb.BatchMode(transitions=pb.TransitionsMode(n_step=2, gamma=0.9)),
                              include_keys=True, seed=3)
    return {
        "CreateBuffer": pb.CreateBufferRequest(name="fresh", episodic=pb.EpisodicConfig(
            fields=[pb.FieldSpec(name="obs", dtype="uint8", shape=[2, 2], observation=True),
                    pb.FieldSpec(name="reward", dtype="float32")], capacity_steps=64)).SerializeToString(),
        "DescribeBuffer": pb.DescribeBufferRequest(name="ep").SerializeToString(),
        "Insert": _insert_request(_episode(5), episode_id=99),
        "Sample": sample.SerializeToString(),
        "SampleStream": pb.SampleStreamRequest(request=sample, num_batches=2).SerializeToString(),
        "UpdatePriorities": pb.UpdatePrioritiesRequest(buffer="ep", keys=[0, 1, 2],
                                                       priorities=[0.5, 1.0, 2.0]).SerializeToString(),
        "PushRollout": _push_request(codec.encode(_rollout_columns()),
                                     codec.encode({"value": np.zeros(ENVS, np.float32)})),
        "RolloutMinibatches": pb.RolloutMinibatchesRequest(buffer="ro", minibatch_size=4).SerializeToString(),
        "FinishRollout": pb.FinishRolloutRequest(buffer="ro", next_version=1).SerializeToString(),
        "PublishWeights": pb.PublishWeightsRequest(name="policy", version=2,
                                                   safetensors=_safetensors()).SerializeToString(),
        "FetchWeights": pb.FetchWeightsRequest(name="policy").SerializeToString(),
    }


VALID = _valid_requests()


@pytest.fixture
def target(server: ReplayServer, client: ReplayClient) -> Iterator[Target]:
    # Mutated capacities and shapes must not make the test allocate gigabytes of shared memory.
    server.servicer.max_buffer_bytes = 2**24
    client.create_buffer("ep", 200, EPISODIC_SCHEMA, sampler=Prioritized())
    for i in range(3):
        client.insert([spans_request("ep", [Span(_episode(6 + i), 1000 + i)])])
    client.create_rollout_buffer("ro", STEPS, ENVS, ROLLOUT_SCHEMA)
    client.publish_weights("policy", 1, _safetensors())
    yield Target(server, client)


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` with a few byte flips, insertions, deletions, or a truncation."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if not out and kind != "insert":
            continue
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind == "flip":
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            out[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF]))
        elif kind == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del out[at:at + draw(st.integers(1, 8))]
        else:
            del out[at:]
    return bytes(out)


@given(method=st.sampled_from(["Insert", *UNARY, *RESPONSE_STREAMING]), payload=st.binary(max_size=300))
@FUZZ
def test_random_bytes(target: Target, method: str, payload: bytes) -> None:
    target.call(method, payload)
    target.healthy()


@given(data=st.data(), method=st.sampled_from(sorted(VALID)))
@FUZZ
def test_mutated_protobuf(target: Target, data: st.DataObject, method: str) -> None:
    target.call(method, data.draw(mutated(VALID[method])))
    target.healthy()


def _with_metadata(payload: bytes, field_meta: dict[bytes, bytes] | None, schema_meta: dict[bytes, bytes] | None,
                   field: str) -> bytes:
    """Re-encodes a payload with one field's (or the schema's) metadata replaced."""
    batch = pa.ipc.open_stream(payload).read_next_batch()
    schema = batch.schema
    if field_meta is not None:
        index = schema.get_field_index(field)
        schema = schema.set(index, schema.field(index).with_metadata(field_meta))
    if schema_meta is not None:
        schema = schema.with_metadata(schema_meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(batch.columns, schema=schema))
    return sink.getvalue().to_pybytes()


ARROW_DTYPES = sorted(codec.ALLOWED_DTYPES)
metadata_values = st.one_of(
    st.sampled_from([b"float32", b"int64", b"bool", b"float64", b"object", b"", b"\xff\xfe", b"<f4", b"S8"]),
    st.binary(max_size=16),
)
shape_values = st.one_of(
    st.sampled_from([b"[3]", b"[]", b"[1, 3]", b"[-3]", b"[0]", b"[4294967296, 4294967296]", b"3", b"\"3\"",
                     b"{}", b"[[3]]", b"[3.5]", b"null", b"[" * 5000 + b"]" * 5000]),
    st.binary(max_size=16),
)


@given(data=st.data())
@FUZZ
def test_mutated_arrow_inserts(target: Target, data: st.DataObject) -> None:
    steps = data.draw(st.integers(1, 6))
    columns = _episode(steps)
    variant = data.draw(st.sampled_from(["bytes", "dtype", "shape", "rows", "fields", "metadata", "reward"]))
    field = data.draw(st.sampled_from(sorted(columns)))
    if variant == "dtype":
        columns[field] = columns[field].astype(data.draw(st.sampled_from(ARROW_DTYPES)))
    elif variant == "shape":
        extra = data.draw(st.lists(st.integers(1, 4), max_size=3))
        columns[field] = np.zeros((len(columns[field]), *extra), columns[field].dtype)
    elif variant == "rows":
        columns[field] = columns[field][: data.draw(st.integers(0, steps))]
        columns = {name: array[: len(columns[field])] for name, array in columns.items()}
    elif variant == "fields":
        if data.draw(st.booleans()):
            del columns[field]
        else:
            columns[data.draw(st.sampled_from(["extra", "next_obs", "key"]))] = columns["action"]
    elif variant == "reward":
        columns["reward"][data.draw(st.integers(0, steps))] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    request = pb.InsertRequest(buffer="ep", episode_ids=[7], span_rows=[steps + 1], begins=[True], ends=[True],
                               terminated=[True])
    payload = codec.encode(columns) if columns else b""
    if variant == "bytes":
        payload = data.draw(mutated(payload))
    elif variant == "metadata" and payload:
        if data.draw(st.booleans()):
            meta = {b"dtype": data.draw(metadata_values), b"shape": data.draw(shape_values)}
            payload = _with_metadata(payload, meta, None, field)
        else:
            payload = _with_metadata(payload, None, {b"aliases": data.draw(st.sampled_from(
                [b'{"x": "obs"}', b'{"x": "missing"}', b"[1]", b"nope", b'{"obs": 5}']))}, field)
    request.steps = payload
    target.call("Insert", request.SerializeToString())
    target.healthy()


@given(data=st.data())
@FUZZ
def test_mutated_arrow_rollout_pushes(target: Target, data: st.DataObject) -> None:
    columns = _rollout_columns()
    field = data.draw(st.sampled_from(sorted(columns)))
    variant = data.draw(st.sampled_from(["bytes", "dtype", "shape", "missing", "bootstrap", "ranges"]))
    bootstrap = codec.encode({"value": np.zeros(ENVS, np.float32)})
    fields: dict[str, int] = {}
    if variant == "dtype":
        columns[field] = columns[field].astype(data.draw(st.sampled_from(ARROW_DTYPES)))
    elif variant == "shape":
        columns[field] = np.zeros((len(columns[field]), *data.draw(st.lists(st.integers(1, 3), min_size=1,
                                                                             max_size=2))), columns[field].dtype)
    elif variant == "missing":
        del columns[field]
    elif variant == "bootstrap":
        bootstrap = data.draw(st.one_of(
            mutated(bootstrap),
            st.sampled_from([codec.encode({"value": np.zeros(ENVS + 1, np.float32)}),
                             codec.encode({"value": np.zeros(ENVS, np.float64)}),
                             codec.encode({"v": np.zeros(ENVS, np.float32)}), b""]),
        ))
    elif variant == "ranges":
        big = st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-3, 10))
        fields = {name: data.draw(big) for name in
                  data.draw(st.lists(st.sampled_from(["num_envs", "env_start", "step_start", "policy_version"]),
                                     min_size=1, unique=True))}
    steps = codec.encode(columns)
    if variant == "bytes":
        steps = data.draw(mutated(steps))
    version = target.client.describe("ro")["policy_version"]
    code = target.call("PushRollout", _push_request(steps, bootstrap, **{"policy_version": version, **fields}))
    if code == grpc.StatusCode.OK:  # the rollout is complete: start the next, so later pushes can land too
        target.client.finish_rollout("ro", version + 1)
        target.snapshot = target._take_snapshot()
    target.healthy()


floats = st.floats(allow_nan=True, allow_infinity=True)
int64s = st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-2, 40))


@given(batch_size=int64s, mode=st.sampled_from(["transitions", "geometric", "states", "none"]), n_step=st.one_of(
    st.integers(-2**31, 2**31 - 1), st.integers(0, 8)), gamma=floats, discount=floats, beta=floats,
       wait=st.booleans(), num_batches=int64s)
@FUZZ
def test_sample_arguments(target: Target, batch_size: int, mode: str, n_step: int, gamma: float, discount: float,
                          beta: float, wait: bool, num_batches: int) -> None:
    request = pb.SampleRequest(buffer="ep", batch_size=batch_size, importance_beta=beta, wait=wait)
    if mode == "transitions":
        request.mode.transitions.CopyFrom(pb.TransitionsMode(n_step=n_step, gamma=gamma))
    elif mode == "geometric":
        request.mode.geometric.CopyFrom(pb.GeometricMode(discount=discount))
    elif mode == "states":
        request.mode.states.CopyFrom(pb.StatesMode())
    target.call("Sample", request.SerializeToString())
    target.call("SampleStream", pb.SampleStreamRequest(request=request, num_batches=num_batches).SerializeToString())
    target.healthy()


@given(keys=st.lists(int64s, max_size=20), priorities=st.lists(floats, max_size=20))
@FUZZ
def test_update_priorities_arguments(target: Target, keys: list[int], priorities: list[float]) -> None:
    code = target.call("UpdatePriorities",
                       pb.UpdatePrioritiesRequest(buffer="ep", keys=keys, priorities=priorities).SerializeToString())
    if code == grpc.StatusCode.OK:
        assert len(keys) == len(priorities) and all(math.isfinite(p) and p >= 0 for p in priorities)
    target.healthy()


names = st.one_of(st.sampled_from(["obs", "reward", "next_obs", "key", "", "a" * 65, "_x", "x y", "é"]),
                  st.text(max_size=12))
dims = st.one_of(st.integers(-2, 5), st.sampled_from([2**31, 2**40, 2**62]))
field_specs = st.builds(pb.FieldSpec, name=names, dtype=st.one_of(st.sampled_from(ARROW_DTYPES),
                                                                  st.sampled_from(["object", "<f4", "", "S3"])),
                        shape=st.lists(dims, max_size=10), observation=st.booleans())


@given(name=names, fields=st.lists(field_specs, max_size=4), kind=st.sampled_from(["episodic", "rollout", "none"]),
       size=st.one_of(st.integers(-3, 300), st.sampled_from([2**31, 2**40, 2**62])), envs=int64s, gamma=floats,
       alpha=floats, max_times=int64s, limits=st.tuples(int64s, floats, floats))
@FUZZ
def test_create_buffer_arguments(target: Target, name: str, fields: list[pb.FieldSpec], kind: str, size: int,
                                 envs: int, gamma: float, alpha: float, max_times: int,
                                 limits: tuple[int, float, float]) -> None:
    request = pb.CreateBufferRequest(name=name)
    if kind == "episodic":
        request.episodic.CopyFrom(pb.EpisodicConfig(
            fields=fields, capacity_steps=size,
            sampler=pb.SamplerConfig(prioritized=pb.PrioritizedSampler(alpha=alpha)),
            remover=pb.RemoverConfig(max_times_sampled=pb.MaxTimesSampledRemover(max_times_sampled=max_times)),
            rate_limiter=pb.RateLimiterConfig(sample_to_insert_ratio=pb.SampleToInsertRatioLimiter(
                min_size_to_sample=limits[0], samples_per_insert=limits[1], error_buffer=limits[2]))))
    elif kind == "rollout":
        request.rollout.CopyFrom(pb.RolloutConfig(fields=fields, num_steps=size, num_envs=envs, gamma=gamma))
    if target.call("CreateBuffer", request.SerializeToString()) == grpc.StatusCode.OK:
        target.client.delete_buffer(name)
    target.healthy()


@given(name=names, version=int64s, payload=st.one_of(
    st.binary(max_size=64),
    st.builds(lambda header, data: struct.pack("<Q", len(header)) + header + data,
              st.sampled_from([b"{}", b"[]", b'{"w": 1}', b'{"w": {"data_offsets": [0, 99]}}',
                               b'{"w": {"data_offsets": [8, 4]}}', b'{"w": {"data_offsets": "x"}}',
                               b'{"__metadata__": {"a": "b"}}', b"[" * 5000]), st.binary(max_size=32)),
    st.builds(lambda n: struct.pack("<Q", n), st.integers(0, 2**64 - 1)),
))
@FUZZ
def test_publish_weights_arguments(target: Target, name: str, version: int, payload: bytes) -> None:
    target.call("PublishWeights",
                pb.PublishWeightsRequest(name=name, version=version, safetensors=payload).SerializeToString())
    target.healthy()


def test_rejected_inserts_name_the_problem(target: Target) -> None:
    def details(method: Callable[[], object]) -> str:
        with pytest.raises(grpc.RpcError) as info:
            method()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return info.value.details()

    bad = _episode(4, reward=1.0)
    bad["reward"][2] = np.nan
    assert "'reward' row 2" in details(lambda: target.client.insert([spans_request("ep", [Span(bad, 5)])]))
    twice = [Span(_episode(2), 8), Span(_episode(3), 8)]
    assert "episode_ids[0] = 8" in details(lambda: target.client.insert([spans_request("ep", twice)]))
    assert "batch_size" in details(lambda: target.client.sample("ep", 2**40))
    assert "malformed request" in details(lambda: target.channel.unary_unary(
        SERVICE + "Sample", request_serializer=_identity)(b"\xff\xff\xff", timeout=10))
    long_name = "x" * 100_000  # quoted in the message, which must stay below the metadata limit
    with pytest.raises(grpc.RpcError) as info:
        target.client.describe(long_name)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and len(info.value.details()) < 2000


def test_oversized_buffers_are_refused_before_allocating(target: Target) -> None:
    with pytest.raises(grpc.RpcError) as info:
        target.client.create_buffer("huge", 2**40, {"obs": ("float32", (4,))})
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The buffer's name, not its segment's, and a size a reader takes in at a glance
    assert re.match(r"buffer 'huge': needs [\d,]+\.\d GB \(\d+ bytes\) of shared memory", info.value.details())
    with pytest.raises(grpc.RpcError) as info:
        target.client.create_rollout_buffer("huge", 2**20, 2**20, {})
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details().startswith("buffer 'huge': needs ")
    assert [b["name"] for b in target.client.list_buffers()] == ["ep", "ro"]


def test_a_compressed_insert_is_refused_and_changes_nothing(target: Target) -> None:
    """A zstd body inflates on the server to what it claims (a 66 KB request held 2 GiB): refused as a
    malformed payload naming the request field, the buffer untouched, the server serving."""
    batch = pa.ipc.open_stream(codec.encode(_episode(5))).read_next_batch()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_batch(batch)
    request = pb.InsertRequest(buffer="ep", steps=sink.getvalue().to_pybytes(), episode_ids=[77], span_rows=[6],
                               begins=[True], ends=[True], terminated=[True], span_offsets=[0])
    before = target.client.describe("ep")
    with pytest.raises(grpc.RpcError) as info:
        target.channel.stream_unary(SERVICE + "Insert", request_serializer=_identity)(
            iter([request.SerializeToString()]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("insert.steps: compressed record batches are not supported")
    assert target._take_snapshot() == target.snapshot
    assert target.client.describe("ep") == before
    target.healthy()
