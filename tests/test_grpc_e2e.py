"""End to end over a real gRPC server on loopback: concurrent inserts, sampling, and every error code."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc
import numpy as np
import pytest

from replayd.client import EpisodeWriter, ReplayClient
from replayd.client.replay_client import Span, spans_request, split_spans
from replayd.client.replay_client import episode_span as client_episode_span
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.grpc_server import convert
from replayd.server.grpc_server.in_place import IN_PLACE_MIN_BYTES
from replayd.server.grpc_server.servicer import KEY_ITEM_BYTES, _Ahead, sample_mode, wait_seconds
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.server.samplers.uniform import UniformSampler
from replayd.server.schema import Field
from replayd.server.server import ReplayServer
from replayd.server.storage.shared_arrays import SharedArrays
from replayd.server.worker_seats import WorkerSeats
from replayd.wire import codec, errors
from replayd.wire import replay_pb2 as pb
from replayd.wire import replay_pb2_grpc as pb_grpc
from replayd.wire.components import Geometric, MaxTimesSampled, States, Transitions
from replayd.wire.frames import sample_response_batch
from tests.conftest import TEST_INSTANCE, free_port, rpc_status

SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}


def episode(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.normal(size=(length + 1, 4)).astype(np.float32),
        "action": rng.integers(0, 2, length),
        "reward": np.ones(length, np.float32),
    }


def test_concurrent_inserts_and_sampling_account_for_every_episode(client: ReplayClient) -> None:
    client.create_buffer("cartpole", 200_000, SCHEMA)
    inserted_ids: list[list[int]] = [[] for _ in range(4)]
    stop = threading.Event()
    sampled_ids: set[int] = set()
    errors: list[BaseException] = []

    def actor(index: int) -> None:
        try:
            rng = np.random.default_rng(index)
            for _ in range(50):
                inserted_ids[index].append(
                    client.insert_episode("cartpole", terminated=True, **episode(rng, int(rng.integers(5, 50))))
                )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def learner() -> None:
        try:
            while not stop.is_set():
                batch = client.sample("cartpole", 64, include_keys=True, wait=True, timeout=10)
                sampled_ids.update(int(e) for e in batch["episode_id"])
        except BaseException as exc:
            errors.append(exc)

    sampler = threading.Thread(target=learner)
    sampler.start()
    actors = [threading.Thread(target=actor, args=(i,)) for i in range(4)]
    for thread in actors:
        thread.start()
    for thread in actors:
        thread.join()
    stop.set()
    sampler.join()
    assert not errors, errors
    all_ids = {e for ids in inserted_ids for e in ids}
    assert len(all_ids) == 200
    info = client.describe("cartpole")
    assert info["episodes"] == 200
    assert info["counters"]["inserted_episodes"] == 200
    assert sampled_ids and sampled_ids <= all_ids
    # Every stored episode can be found by sampling its states.
    found: set[int] = set()
    for batch in client.sample_stream("cartpole", 4096, mode=States(), num_batches=20, include_keys=True, seed=1):
        found.update(int(e) for e in batch["episode_id"])
    assert found == all_ids


def test_sample_modes_and_stream_over_grpc(client: ReplayClient) -> None:
    rng = np.random.default_rng(0)
    client.create_buffer("b", 10_000, SCHEMA)
    client.insert_episodes("b", [episode(rng, 20) for _ in range(10)], [True] * 5 + [False] * 5)
    batch = client.sample("b", 32, mode=Transitions(n_step=3, gamma=0.9), seed=5)
    assert batch["obs"].shape == (32, 4) and batch["obs"].dtype == np.float32
    assert set(batch) >= {"obs", "action", "reward", "next_obs", "terminated", "truncated", "n_step_return",
                          "bootstrap_discount", "bootstrap_obs"}
    again = client.sample("b", 32, mode=Transitions(n_step=3, gamma=0.9), seed=5)
    np.testing.assert_array_equal(batch["obs"], again["obs"])  # seeded requests are reproducible
    pairs = client.sample("b", 64, mode=Geometric(discount=0.2))
    assert set(pairs) == {"obs", "future_obs", "offset"} and (pairs["offset"] >= 1).all()
    batches = list(client.sample_stream("b", 16, num_batches=7))
    assert len(batches) == 7 and all(b["obs"].shape == (16, 4) for b in batches)


def test_episode_writer_sends_what_is_left_when_closed(client: ReplayClient) -> None:
    client.create_buffer("w", 1000, SCHEMA)
    with EpisodeWriter(client, "w", batch_rows=10_000) as writer:
        for _ in range(2):
            for t in range(6):
                writer.append(obs=np.full(4, t, np.float32), action=0, reward=1.0)
            writer.end_episode(terminated=True, obs=np.full(4, 6, np.float32))
        for t in range(5):  # an episode still open when the block ends
            writer.append(obs=np.full(4, 10 + t, np.float32), action=1, reward=0.5)
        assert client.describe("w")["sampleable_steps"] == 0  # all of it still pending
    info = client.describe("w")
    assert info["episodes"] == 2 and info["sampleable_steps"] == 2 * 6 + 4  # the open one's last step waits
    with pytest.raises(ValueError, match="closed"):
        writer.append(obs=np.zeros(4, np.float32), action=0, reward=0.0)
    writer.close()  # closing twice sends nothing more

    with pytest.raises(RuntimeError, match="actor failed"), EpisodeWriter(client, "w", batch_rows=10_000) as failed:
        failed.append(obs=np.zeros(4, np.float32), action=0, reward=0.0)
        failed.end_episode(terminated=True, obs=np.ones(4, np.float32))
        raise RuntimeError("actor failed")
    assert failed.closed and client.describe("w")["episodes"] == 2  # nothing sent over the error


def test_episode_writer_chunks_long_episodes(client: ReplayClient) -> None:
    client.create_buffer("w", 1000, SCHEMA)
    writer = EpisodeWriter(client, "w", chunk_rows=8, batch_rows=64)
    for t in range(20):
        writer.append(obs=np.full(4, t, np.float32), action=t % 2, reward=1.0)
    # chunks of 8 rows went out: their steps with a successor are already sampleable
    assert client.describe("w")["sampleable_steps"] == 15
    writer.end_episode(terminated=True, obs=np.full(4, 20, np.float32))
    for _ in range(3):
        for t in range(5):
            writer.append(obs=np.full(4, 100 + t, np.float32), action=0, reward=0.5)
        writer.end_episode(terminated=False, obs=np.full(4, 105, np.float32))
    writer.flush()
    info = client.describe("w")
    assert info["episodes"] == 4 and info["sampleable_steps"] == 20 + 15
    batch = client.sample("w", 512, seed=0)
    first = batch["obs"][:, 0] < 100
    np.testing.assert_array_equal(batch["next_obs"][first, 0], batch["obs"][first, 0] + 1)
    assert (batch["terminated"] == (batch["next_obs"][:, 0] == 20)).all()
    assert (batch["truncated"] == (batch["next_obs"][:, 0] == 105)).all()


def test_episode_writer_refuses_a_wrong_value_where_it_is_given_and_goes_on(client: ReplayClient) -> None:
    client.create_buffer("v", 1000, SCHEMA)
    writer = EpisodeWriter(client, "v")
    step = {"obs": np.zeros(4, np.float32), "action": 1, "reward": 0.5}
    writer.append(**step)
    with pytest.raises(ValueError, match=r"append: buffer 'v' expects fields \['action', 'obs', 'reward'\], got "
                                         r"\['acton', 'obs', 'reward'\]"):
        writer.append(obs=np.zeros(4, np.float32), acton=1, reward=0.5)
    with pytest.raises(ValueError, match=r"append: field 'obs' expected shape \(4,\), got \(5,\)"):
        writer.append(**{**step, "obs": np.zeros(5)})
    with pytest.raises(ValueError, match="append: field 'action' cannot be int64: got <U4 values"):
        writer.append(**{**step, "action": "left"})
    with pytest.raises(ValueError, match="append: field 'action' cannot be int64: got float64 values"):
        writer.append(**{**step, "action": 1.7})  # refused, not truncated to 1
    with pytest.raises(ValueError, match="append: field 'action' cannot be int64: values out of its range"):
        writer.append(**{**step, "action": 2**63})  # refused, not wrapped
    with pytest.raises(ValueError, match="append: field 'reward' cannot be float32: values out of its range"):
        writer.append(**{**step, "reward": 1e300})  # refused, not made inf (which the flush would then fail on)
    with pytest.raises(ValueError, match="append: field 'obs' cannot be float32: values out of its range"):
        writer.append(**{**step, "obs": np.full(4, -1e39)})
    writer.append(**{**step, "obs": np.array([np.inf, -np.inf, np.nan, 0.0])})  # non-finite as given: kept
    writer.append(**{**step, "obs": np.zeros(4), "reward": 1})  # float64 into float32, an int into float32
    with pytest.raises(ValueError, match=r"end_episode: field 'obs' expected shape \(4,\), got \(5,\)"):
        writer.end_episode(terminated=True, obs=np.ones(5, np.float32))
    writer.end_episode(terminated=True, obs=np.ones(4, np.float32))
    writer.close()
    info = client.describe("v")
    assert info["episodes"] == 1 and info["stored_steps"] == 4  # three steps and the final observation


def test_episode_writer_takes_ints_that_fit_an_unsigned_field(client: ReplayClient) -> None:
    """numpy's same_kind casting refuses int64 -> uint8 whatever the values, so the writer checks the values
    themselves: a Python int action that fits a uint8 field is taken, not refused as a dtype."""
    client.create_buffer("u", 100, {"obs": ("uint8", (2,)), "action": ("uint8", ()), "reward": ("float32", ())})
    writer = EpisodeWriter(client, "u")
    for action in (3, np.int64(4), np.int32(255), True):
        writer.append(obs=[1, 2], action=action, reward=1.0)  # the obs too: a list of Python ints
    for action in (300, -1):
        with pytest.raises(ValueError, match="append: field 'action' cannot be uint8: values out of its range"):
            writer.append(obs=[1, 2], action=action, reward=1.0)
    writer.end_episode(terminated=True, obs=np.array([3, 4]))
    writer.close()
    batch = client.sample("u", 64, seed=0)
    assert set(batch["action"].tolist()) == {3, 4, 255, 1} and batch["action"].dtype == np.uint8


def test_episode_writer_keeps_what_the_server_accepts_after_a_refused_flush(client: ReplayClient) -> None:
    """The writer's open episode is evicted by another actor's episodes: the flush that continues it is
    refused, the whole episode flushed with it is still stored, and the writer goes on."""
    client.create_buffer("r", 40, SCHEMA)
    writer = EpisodeWriter(client, "r", chunk_rows=4, batch_rows=10_000)
    rng = np.random.default_rng(0)

    def steps(count: int, first: float) -> None:
        for t in range(count):
            writer.append(obs=np.full(4, first + t, np.float32), action=0, reward=1.0)

    def evict_the_open_episode() -> None:
        for _ in range(3):
            client.insert_episode("r", terminated=True, **episode(rng, 11))

    steps(4, 50)  # episode A: its first chunk goes out
    evict_the_open_episode()
    steps(2, 54)
    writer.end_episode(terminated=True, obs=np.full(4, 56, np.float32))
    steps(3, 100)  # episode B, whole
    writer.end_episode(terminated=False, obs=np.full(4, 103, np.float32))
    code, details = rpc_status(writer.flush)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not open" in details
    stored = client.sample("r", 256, seed=1)
    assert not ((stored["obs"][:, 0] >= 50) & (stored["obs"][:, 0] < 100)).any()  # no row of A
    assert {100, 101, 102} <= set(stored["obs"][:, 0].tolist())  # B is in
    assert writer.episodes_written == 1 and writer.pending_rows == 0

    steps(4, 200)  # episode C: its first chunk goes out, then C is evicted while still open
    evict_the_open_episode()
    with pytest.raises(grpc.RpcError) as refused:
        steps(4, 204)  # its next chunk is refused: C goes on as a new episode from its next step
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    steps(2, 208)
    writer.end_episode(terminated=True, obs=np.full(4, 210, np.float32))
    writer.close()
    stored = client.sample("r", 256, seed=2)
    c_rows = stored["obs"][:, 0] >= 200
    assert set(stored["obs"][c_rows, 0].tolist()) == {208, 209}  # the new episode's two steps
    assert writer.episodes_written == 2


def test_errors_return_their_codes_and_leave_buffers_untouched(server: ReplayServer, client: ReplayClient) -> None:
    rng = np.random.default_rng(1)
    created = client.create_buffer("e", 100, SCHEMA)
    client.insert_episode("e", terminated=True, **episode(rng, 10))
    reader = SharedArrays.attach(created["shm_name"])
    before = {name: array.tobytes() for name, array in reader.arrays.items()}

    code, details = rpc_status(client.sample, "missing", 4)
    assert code == grpc.StatusCode.NOT_FOUND and "missing" in details
    bad = episode(rng, 10)
    bad["obs"] = bad["obs"].astype(np.float64)
    code, details = rpc_status(client.insert_episode, "e", True, **bad)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'obs'" in details and "float32" in details and "float64" in details
    bad = episode(rng, 10)
    bad["obs"] = np.zeros((11, 5), np.float32)
    code, details = rpc_status(client.insert_episode, "e", True, **bad)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "(4,)" in details and "(5,)" in details
    code, details = rpc_status(client.insert_episode, "e", True, **episode(rng, 150))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "capacity_steps=100" in details
    code, details = rpc_status(client.insert, [pb.InsertRequest(buffer="e", steps=b"not arrow", episode_ids=[1],
                                                           span_rows=[2], begins=[True], ends=[True])])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("insert.steps: malformed Arrow IPC payload")
    code, details = rpc_status(client.create_buffer, "e", 100, SCHEMA)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already exists" in details
    code, details = rpc_status(client.create_buffer, "bad", 100, {"obs": ("complex64", (2,))})
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "complex64" in details
    code, details = rpc_status(client.sample, "e", 0)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "batch_size" in details
    def raw_sample(mode: pb.BatchMode) -> pb.SampleResponse:  # past the client's own checks of its options
        return client._stub.Sample(pb.SampleRequest(buffer="e", batch_size=4, mode=mode))

    for n_step in (-1, 0):  # 0 is refused, not taken for "unset" (the field has presence)
        code, details = rpc_status(raw_sample, pb.BatchMode(transitions=pb.TransitionsMode(n_step=n_step)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"n_step must be an integer in 1..1000, got {n_step}" in details
    unset = pb.SampleRequest(buffer="e", batch_size=4, mode=pb.BatchMode(transitions=pb.TransitionsMode()))
    assert convert.mode_from_request(unset).n_step == 1  # a client that sets no n_step
    code, details = rpc_status(raw_sample, pb.BatchMode(geometric=pb.GeometricMode(discount=1.5)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "discount" in details
    code, details = rpc_status(raw_sample, pb.BatchMode())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "mode must be one of" in details
    code, details = rpc_status(client.sample, "e", 5_000_000, States())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_message_bytes" in details

    after = {name: array.tobytes() for name, array in reader.arrays.items()}
    reader.close()
    assert after == before
    assert client.sample("e", 8)["obs"].shape == (8, 4)  # still serving


def test_a_buffer_created_with_a_reward_field_sums_that_field(server: ReplayServer, client: ReplayClient) -> None:
    """reward_field names the per-step reward even when another field is called "reward"."""
    client.create_buffer("rf", 1000, {**SCHEMA, "r": ("float32", ())}, reward_field="r")
    steps = 20
    client.insert_episode("rf", terminated=False, obs=np.zeros((steps + 1, 4), np.float32),
                          action=np.arange(steps), reward=np.zeros(steps, np.float32),
                          r=np.arange(steps, dtype=np.float32))
    with grpc.insecure_channel(server.address) as channel:
        described = pb_grpc.ReplayStub(channel).DescribeBuffer(pb.DescribeBufferRequest(name="rf"), timeout=20)
    assert described.episodic.reward_field == "r"
    batch = client.sample("rf", 64, mode=Transitions(n_step=1), seed=0)
    np.testing.assert_array_equal(batch["n_step_return"], batch["action"].astype(np.float32))  # r[t] = t


def test_a_sample_request_without_gamma_discounts_by_0_99(server: ReplayServer, client: ReplayClient) -> None:
    """A client that sets no gamma (the field has presence) gets the documented default, 0.99."""
    steps = 50
    client.create_buffer("g", 1000, SCHEMA)
    client.insert_episode("g", terminated=False, obs=np.arange(steps + 1, dtype=np.float32)[:, None].repeat(4, 1),
                          action=np.zeros(steps, np.int64), reward=np.ones(steps, np.float32))
    request = pb.SampleRequest(buffer="g", batch_size=256, seed=0,
                               mode=pb.BatchMode(transitions=pb.TransitionsMode(n_step=3)))
    assert not request.mode.transitions.HasField("gamma")
    with grpc.insecure_channel(server.address) as channel:
        sample = channel.unary_unary("/replayd.v1.Replay/Sample", request_serializer=pb.SampleRequest.SerializeToString,
                                     response_deserializer=pb.SampleResponse.FromString)
        batch = codec.decode(sample(request, timeout=20).batch)
    n_eff = np.minimum(3, steps - batch["obs"][:, 0].astype(np.int64))  # the truncated episode keeps bootstrapping
    np.testing.assert_allclose(batch["bootstrap_discount"], 0.99 ** n_eff, rtol=1e-6)
    np.testing.assert_allclose(batch["n_step_return"], (1 - 0.99 ** n_eff) / (1 - 0.99), rtol=1e-6)
    assert (n_eff == 3).any()


def test_empty_buffer_fails_fast_or_waits_for_data(client: ReplayClient) -> None:
    client.create_buffer("empty", 100, SCHEMA)
    code, details = rpc_status(client.sample, "empty", 4)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no sampleable steps" in details
    # The server's own DEADLINE_EXCEEDED, saying what it waited for, not the client's bare one. The server gives
    # up 125 ms before this deadline, a head start only: a loaded machine that stalls this process for longer
    # around the deadline lets the client's own bare one come first, so the server's reply must win one of
    # three calls.
    for _ in range(3):
        code, details = rpc_status(client.sample, "empty", 4, wait=True, timeout=0.5)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        if "buffer 'empty' got no step to draw" in details:
            break
    assert "buffer 'empty' got no step to draw" in details
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(client.sample("empty", 4, wait=True, timeout=20)))
    waiter.start()
    client.insert_episode("empty", terminated=True, **episode(np.random.default_rng(0), 3))
    waiter.join()
    assert result["obs"].shape == (4, 4)


@pytest.mark.parametrize(("remaining", "waits"), [(2.0, 1.8), (0.4, 0.3), (0.0, 0.0)])
def test_a_waiting_sample_gives_up_just_before_the_calls_deadline(remaining: float, waits: float) -> None:
    """Its DEADLINE_EXCEEDED says what it waited for; waiting the whole deadline, the client's own bare
    "Deadline Exceeded" often came first (seen with a 2 s timeout against a server process)."""
    class Context:
        def time_remaining(self) -> float:
            return remaining

    request = pb.SampleRequest(buffer="b", batch_size=1, wait=True)
    assert wait_seconds(request, Context()) == pytest.approx(waits)


def test_stream_insert_reports_what_was_stored(client: ReplayClient) -> None:
    rng = np.random.default_rng(2)
    client.create_buffer("s", 1000, SCHEMA)
    good = spans_request("s", [Span({**episode(rng, 4), "action": np.zeros(5, np.int64),
                                     "reward": np.zeros(5, np.float32)}, 1)])
    bad = pb.InsertRequest(buffer="s", steps=good.steps, episode_ids=[2], span_rows=[4], begins=[True], ends=[True],
                           terminated=[False])
    code, details = rpc_status(client.insert, [good, bad])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "1 before it were stored" in details
    assert client.describe("s")["episodes"] == 1


def test_a_malformed_request_after_stored_ones_says_they_were_stored(client: ReplayClient) -> None:
    """As every other refusal in a stream does: the client then knows what a retry must resend."""
    rng = np.random.default_rng(2)
    client.create_buffer("m", 1000, SCHEMA)
    good = spans_request("m", [Span({**episode(rng, 4), "action": np.zeros(5, np.int64),
                                     "reward": np.zeros(5, np.float32)}, 1)])
    with grpc.insecure_channel(client.address) as channel:
        insert = channel.stream_unary("/replayd.v1.Replay/Insert")  # bytes as they are: one frame malformed
        code, details = rpc_status(insert, iter([good.serialize(), b"\xff"]), timeout=20)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.endswith("(request 1 of the stream; the 1 before it were stored)")
    assert client.describe("m")["episodes"] == 1



@pytest.mark.parametrize(("buffer", "status"), [("missing", grpc.StatusCode.NOT_FOUND),
                                                ("ro", grpc.StatusCode.INVALID_ARGUMENT)])
def test_a_request_naming_no_episodic_buffer_after_stored_ones_says_they_were_stored(
        client: ReplayClient, buffer: str, status: grpc.StatusCode) -> None:
    """A later request of the stream that names an unknown or a rollout buffer: refused as any other, saying
    that the requests before it were stored."""
    rng = np.random.default_rng(2)
    client.create_buffer("n", 1000, SCHEMA)
    client.create_rollout_buffer("ro", 2, 2, {})
    columns = {**episode(rng, 4), "action": np.zeros(5, np.int64), "reward": np.zeros(5, np.float32)}
    code, details = rpc_status(client.insert, [spans_request("n", [Span(columns, 1)]),
                                               spans_request(buffer, [Span(columns, 2)])], retry=False)
    assert code == status and repr(buffer) in details
    assert details.endswith("(request 1 of the stream; the 1 before it were stored)")
    assert client.describe("n")["episodes"] == 1

def test_an_insert_response_counts_the_rows_of_its_spans(client: ReplayClient) -> None:
    rng = np.random.default_rng(2)
    client.create_buffer("rows", 1000, SCHEMA)
    spans = [client_episode_span(episode(rng, steps), True, ("obs",)) for steps in (3, 5)]  # 4 and 6 rows
    response = client.insert([spans_request("rows", spans)])
    assert (response.requests, response.spans, response.rows) == (1, 2, 10)
    assert response.episodes_completed == 2 and response.duplicate_spans == 0
    assert client.describe("rows")["stored_steps"] == 10


def test_delete_unlinks_and_list(client: ReplayClient) -> None:
    info = client.create_buffer("d", 100, SCHEMA)
    assert [b["name"] for b in client.list_buffers()] == ["d"]
    client.delete_buffer("d")
    assert client.list_buffers() == []
    with pytest.raises(FileNotFoundError):
        SharedArrays.attach(info["shm_name"])


def test_stream_is_plain_protobuf_reproducible_and_exact(server: ReplayServer, client: ReplayClient) -> None:
    rng = np.random.default_rng(3)
    client.create_buffer("p", 10_000, SCHEMA)
    client.insert_episodes("p", [episode(rng, 30) for _ in range(8)], [True] * 8)
    before = client.describe("p")["counters"].get("sampled_batches", 0)
    # Any gRPC client with the generated classes reads the stream: the messages are ordinary SampleResponses.
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_stream("/replayd.v1.Replay/SampleStream",
                                    request_serializer=pb.SampleStreamRequest.SerializeToString,
                                    response_deserializer=pb.SampleResponse.FromString)
        request = pb.SampleStreamRequest(request=ReplayClient.sample_request("p", 16, seed=7), num_batches=5)
        responses = list(call(request, timeout=20))
    plain = [codec.decode(response.batch) for response in responses]
    assert len(plain) == 5 and all(batch["obs"].shape == (16, 4) for batch in plain)
    # Sampled ahead of gRPC, still one generator per stream: seeded streams repeat batch after batch, and
    # the first batch is the unary sample of the same seed.
    ours = list(client.sample_stream("p", 16, num_batches=5, seed=7))
    for a, b in zip(plain, ours, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    np.testing.assert_array_equal(client.sample("p", 16, seed=7)["obs"], ours[0]["obs"])
    # ... and the generator goes on from batch to batch: a seeded stream does not repeat its first batch.
    assert all(not np.array_equal(a["obs"], b["obs"]) for a, b in itertools.pairwise(ours))
    # Exactly num_batches were sampled per stream (none ahead of the end), plus the unary one.
    assert client.describe("p")["counters"]["sampled_batches"] == before + 11
    sent = server.metrics.get_sample_value("replayd_rpc_sent_bytes_total",
                                           {"method": "SampleStream", "buffer": "p"})
    assert sent == sum(len(response.batch) for response in responses) * 2  # payload bytes, both streams


def test_a_stream_of_large_batches_gathered_into_its_messages_holds_the_stored_steps(client: ReplayClient) -> None:
    """Batches over IN_PLACE_MIN_BYTES are gathered straight into their messages from the stream's second or
    third on: each one still holds the rows its keys name, exactly."""
    rng = np.random.default_rng(4)
    schema = {"frame": ("uint8", (32, 32, 4)), "action": ("int64", ()), "reward": ("float32", ())}
    client.create_buffer("frames", 5_000, schema, observation_fields=("frame",))
    episodes = []
    for _ in range(20):
        length = int(rng.integers(10, 50))
        episodes.append({"frame": rng.integers(0, 256, (length + 1, 32, 32, 4), dtype=np.uint8),
                         "action": rng.integers(0, 6, length), "reward": rng.normal(size=length).astype(np.float32)})
    client.insert_episodes("frames", episodes, [True] * len(episodes))
    frames = np.concatenate([e["frame"] for e in episodes])  # the ring has not wrapped: row = key
    actions = np.concatenate([np.append(e["action"], 0) for e in episodes])
    batches = list(client.sample_stream("frames", 80, num_batches=6, include_keys=True, seed=2))
    assert 80 * 2 * frames[0].nbytes >= IN_PLACE_MIN_BYTES
    for batch in batches:
        np.testing.assert_array_equal(batch["frame"], frames[batch["key"]])
        np.testing.assert_array_equal(batch["next_frame"], frames[batch["key"] + 1])
        np.testing.assert_array_equal(batch["action"], actions[batch["key"]])
        assert all(array.flags.aligned for array in batch.values())
    first = client.sample("frames", 80, include_keys=True, seed=2)
    for name in first:
        np.testing.assert_array_equal(first[name], batches[0][name])


def test_cancelled_stream_stops_its_producer(client: ReplayClient) -> None:
    client.create_buffer("c", 10_000, SCHEMA)
    client.insert_episodes("c", [episode(np.random.default_rng(4), 30) for _ in range(4)], [True] * 4)
    stream = client.sample_stream("c", 8)  # until cancelled
    for _ in range(3):
        next(stream)
    stream.close()
    deadline = time.monotonic() + 10
    while any(t.name == "replayd-ahead" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "replayd-ahead" for t in threading.enumerate())
    code, details = rpc_status(lambda: list(client.sample_stream("c", 8, num_batches=-1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_batches" in details
    code, details = rpc_status(lambda: list(client.sample_stream("missing", 8, num_batches=2)))
    assert code == grpc.StatusCode.NOT_FOUND


class _StreamContext:
    """What SampleStream uses of a grpc.ServicerContext when its request does not wait: abort, on failure."""

    def is_active(self) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"the stream failed: {code} {details}")


def _ahead_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "replayd-ahead"}


def test_a_stream_whose_draws_count_draws_only_the_batches_it_hands_out(server: ReplayServer,
                                                                         client: ReplayClient) -> None:
    """On a buffer whose draws count (a max_times_sampled remover; a rate limiter likewise), a stream samples
    a batch only when gRPC asks for it: a batch sampled ahead and never sent, its stream cancelled, would
    have retired its steps. Driven here as gRPC drives it (the handler's generator, asked for 3 batches then
    closed), since over a socket the transport may take batches its client never reads."""
    client.create_buffer("once", 10_000, SCHEMA, remover=MaxTimesSampled(1))
    client.insert_episodes("once", [episode(np.random.default_rng(5), 30) for _ in range(4)], [True] * 4)
    before = _ahead_threads()
    request = pb.SampleStreamRequest(request=ReplayClient.sample_request("once", 8, seed=1))  # until cancelled
    stream = server.servicer.SampleStream(request, _StreamContext())
    batches = [codec.decode(sample_response_batch(next(stream))) for _ in range(3)]
    assert _ahead_threads() - before == set()  # no producer running ahead of gRPC
    stream.close()  # gRPC closes the handler of a cancelled stream
    deadline = time.monotonic() + 10
    while _ahead_threads() - before:
        assert time.monotonic() < deadline, "the stream's producer never stopped"
        time.sleep(0.01)
    assert [len(batch["obs"]) for batch in batches] == [8] * 3
    info = client.describe("once")
    assert info["counters"]["sampled_batches"] == 3 and info["counters"]["sampled_items"] == 24
    assert info["counters"]["remover.retired_steps"] == 24 and info["sampleable_steps"] == 4 * 30 - 24


def _messages(count: int, log: list, fail_after: int | None = None):
    try:
        for i in range(count):
            if i == fail_after:
                raise errors.InvalidArgument(f"message {i}")
            log.append(("produced", i, threading.current_thread().name))
            yield i
    finally:
        log.append(("closed", threading.current_thread().name))


def test_ahead_keeps_order_bounds_its_lead_and_raises_in_place() -> None:
    log: list = []
    ahead = _Ahead(_messages(6, log), depth=2, observe=None, seats=WorkerSeats())
    first = next(ahead)
    deadline = time.monotonic() + 10
    while len(ahead._ready) < 2:  # the producer runs ahead `depth` messages, then waits for the consumer
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert first == 0 and sum(entry[0] == "produced" for entry in log) == 1 + 2
    assert list(ahead) == [1, 2, 3, 4, 5]
    assert log[-1] == ("closed", "replayd-ahead")  # advanced and closed on its own thread only
    log.clear()
    failing = _Ahead(_messages(6, log, fail_after=3), depth=1, observe=None, seats=WorkerSeats())
    assert [next(failing) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(errors.InvalidArgument, match="message 3"):
        next(failing)
    with pytest.raises(StopIteration):
        next(failing)


def test_closing_ahead_closes_the_generator_on_its_thread() -> None:
    log: list = []
    timed: list = []
    ahead = _Ahead(_messages(1000, log), depth=1, observe=lambda seconds, message: timed.append(seconds),
                   seats=WorkerSeats())
    assert next(ahead) == 0
    ahead.close()
    deadline = time.monotonic() + 5
    while not log or log[-1][0] != "closed":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert log[-1] == ("closed", "replayd-ahead")
    produced = sum(entry[0] == "produced" for entry in log)
    assert produced <= 3 and len(timed) == produced  # each message's production timed


def test_a_long_episode_goes_out_in_requests_under_the_message_limit(server: ReplayServer) -> None:
    """The first chunk of a long episode is at most twice max_request_bytes, not half the episode."""
    with ReplayClient(server.address, max_message_bytes=256 * 1024, max_request_bytes=64 * 1024) as client:
        client.create_buffer("long", 20_000, {"obs": ("float32", (64,)), "action": ("int64", ())})
        rng = np.random.default_rng(0)
        obs = rng.normal(size=(8001, 64)).astype(np.float32)  # 2 MB: 8x the message limit
        client.insert_episode("long", terminated=True, obs=obs, action=np.arange(8000))
        info = client.describe("long")
        assert info["episodes"] == 1 and info["stored_steps"] == 8001
        batch = client.sample("long", 256, include_keys=True)
        np.testing.assert_array_equal(batch["obs"], obs[batch["action"]])
        np.testing.assert_array_equal(batch["next_obs"], obs[batch["action"] + 1])


def test_requests_fit_the_clients_message_limit_whatever_max_request_bytes_says(server: ReplayServer) -> None:
    with ReplayClient(server.address, max_message_bytes=256 * 1024) as client:  # default max_request_bytes 8 MiB
        assert 2 * client.max_request_bytes < 256 * 1024
        client.create_buffer("long", 20_000, {"obs": ("float32", (64,)), "action": ("int64", ())})
        client.insert_episode("long", terminated=True, obs=np.zeros((4001, 64), np.float32), action=np.arange(4000))
        assert client.describe("long")["stored_steps"] == 4001


def test_a_timeout_bounds_a_retried_call_in_all() -> None:
    """Retries of an idempotent call stay within its timeout, pauses included (a timeout of its own for each
    retry would stretch 0.3 s to seconds against a port nothing listens on)."""
    port = free_port()
    with ReplayClient(f"127.0.0.1:{port}", retries=5, timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            client.describe("any")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        # Retries past the timeout pause at least 0.05 + 0.1 + 0.2 + 0.4 + 0.8 = 1.55 s (backoff, before
        # jitter): a bound below that catches them and leaves a loaded machine over a second of slack.
        assert time.monotonic() - started < 1.5


def test_an_explicit_zero_timeout_is_passed_on_not_replaced_by_the_default(client: ReplayClient) -> None:
    client.create_buffer("z", 100, SCHEMA)
    client.insert_episode("z", terminated=True, **episode(np.random.default_rng(0), 10))
    seen: list[float | None] = []
    real = client._server_sampling

    def sample(request, timeout=None):
        seen.append(timeout)
        return real.sample(request, timeout=20)  # a real 0 may or may not expire before the reply

    client.use_sample_workers = False
    client._server_sampling = type(real)(sample, real.stream)
    client.sample("z", 4, timeout=0)
    client.sample("z", 4)
    assert seen[0] == 0 and client.timeout - 1 < seen[1] <= client.timeout


def test_a_first_sample_asks_about_its_buffer_within_the_samples_timeout() -> None:
    """The describe a buffer's first sample makes (sample workers, side effects) runs within the sample's
    timeout: with the client's default, sample(timeout=0.3) against a server that is down would take the
    describe's retries (seconds)."""
    port = free_port()
    with ReplayClient(f"127.0.0.1:{port}", retries=5, timeout=60) as client:
        for first_call in (lambda: client.sample("any", 4, timeout=0.3),
                           lambda: next(iter(client.sample_stream("any", 4, timeout=0.3)))):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                first_call()
            assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert time.monotonic() - started < 1.5  # the describe's retries alone would pause >= 1.55 s


def test_split_spans_bounds_every_request() -> None:
    row_bytes = 8 * 4 + 8
    limit = 100 * row_bytes  # 100 rows per request
    columns = {"obs": np.zeros((1001, 8), np.float32), "action": np.zeros(1001, np.int64)}
    requests = split_spans([Span(columns, 7, True, True, True, 0)], limit)
    rows = [sum(len(s.columns["obs"]) for s in request) for request in requests]
    assert sum(rows) == 1001 and rows[0] == 200 and max(rows[1:]) <= 100
    offsets = [s.offset for request in requests for s in request]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert [s.begins for request in requests for s in request].count(True) == 1
    assert requests[-1][-1].ends and requests[-1][-1].terminated


def test_an_oversized_sample_is_refused_before_it_is_drawn() -> None:
    """A batch over max_message_bytes is refused from the request alone: its draw would count (here a
    max_times_sampled=1 remover would retire the steps it drew, and the client would get nothing)."""
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}big", max_message_bytes=2**20).start()
    try:
        with ReplayClient(server.address, timeout=20, max_message_bytes=2**20) as client:
            # The step field `blob` dominates the batch; observations alone would fit many times over.
            schema = {"obs": ("float32", (1,)), "blob": ("uint8", (8192,)), "reward": ("float32", ())}
            client.create_buffer("big", 400, schema, remover=MaxTimesSampled(1))
            length = 150
            client.insert_episodes("big", [{"obs": np.zeros((length + 1, 1), np.float32),
                                            "blob": np.zeros((length, 8192), np.uint8),
                                            "reward": np.ones(length, np.float32)}] * 2, [True, True])
            before = client.describe("big")
            for sample in (lambda: client.sample("big", 200),
                           lambda: next(iter(client.sample_stream("big", 200, num_batches=1)))):
                code, details = rpc_status(sample)
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
                assert "batch_size=200" in details and "max_message_bytes=1048576" in details
            after = client.describe("big")
            assert after["sampleable_steps"] == before["sampleable_steps"] == 2 * length
            assert after["counters"] == before["counters"]
            assert client.sample("big", 64)["blob"].shape == (64, 8192)  # a batch that fits is served
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_the_size_check_counts_every_column_a_batch_holds(sampler: str) -> None:
    """sample_mode's bytes per item are the batch's column bytes exactly, framing within FRAMING_BYTES."""
    fields = [Field("obs", "float32", (3, 2), observation=True), Field("pixels", "uint8", (5,), observation=True),
              Field("action", "int64", ()), Field("reward", "float32", ()), Field("extra", "float16", (7,))]
    no_reward = [f for f in fields if f.name != "reward"]
    requests = [pb.SampleRequest(batch_size=32, mode=pb.BatchMode(transitions=pb.TransitionsMode(n_step=1))),
                pb.SampleRequest(batch_size=32, mode=pb.BatchMode(transitions=pb.TransitionsMode(n_step=3))),
                pb.SampleRequest(batch_size=32, mode=pb.BatchMode(geometric=pb.GeometricMode(discount=0.9))),
                pb.SampleRequest(batch_size=32, mode=pb.BatchMode(states=pb.StatesMode()))]
    for schema, reward_field in ((fields, "reward"), (no_reward, None)):
        buffer = EpisodicBuffer("sized", f"{TEST_INSTANCE}sz", schema, 200, reward_field=reward_field,
                                sampler=PrioritizedSampler(0.6) if sampler == "prioritized" else UniformSampler())
        try:
            rng = np.random.default_rng(0)
            columns = {f.name: rng.integers(0, 9, (41, *f.shape)).astype(f.dtype) for f in schema}
            buffer.insert(columns, Spans.whole_episodes(np.array([40]), np.array([1]), np.array([True])))
            for request in [r for r in requests if reward_field or r.mode.transitions.n_step != 3]:
                for include_keys in (False, True):
                    request.include_keys = include_keys
                    mode = sample_mode(request, buffer.reader, 2**30)
                    item_bytes = (mode.item_bytes(buffer.ring) + buffer.sampler.extra_item_bytes
                                  + (KEY_ITEM_BYTES if include_keys else 0))
                    batch = buffer.sample(32, mode, rng, include_keys=include_keys, importance_beta=0.4)
                    unique = {id(a): a.nbytes for a in batch.values()}  # an aliased column is sent once
                    assert sum(unique.values()) == 32 * item_bytes, (request, include_keys, reward_field)
                    encoded = codec.encoded_size(codec.encode_parts(batch))
                    assert 32 * item_bytes < encoded <= 32 * item_bytes + codec.FRAMING_BYTES
        finally:
            buffer.close()


def test_the_size_check_bounds_the_framing_of_wide_schemas() -> None:
    """Many columns with long names and rank-8 rows: the framing outgrows a flat 64 KiB, so the size check
    allows 1 KiB per column the batch may hold; a batch it admits is never drawn (and counted) and then
    refused."""
    shape = (1,) * 8
    observations = [Field(f"o{i:02d}".ljust(64, "x"), "uint8", shape, observation=True) for i in range(64)]
    steps = [Field(f"s{i:02d}".ljust(64, "x"), "uint8", shape) for i in range(64)]
    fields = [*observations, *steps, Field("reward", "float32", ())]
    buffer = EpisodicBuffer("wide", f"{TEST_INSTANCE}wide", fields, 200, sampler=PrioritizedSampler(0.6))
    try:
        columns = {f.name: np.zeros((41, *f.shape), f.dtype) for f in fields}
        buffer.insert(columns, Spans.whole_episodes(np.array([40]), np.array([1]), np.array([True])))
        request = pb.SampleRequest(batch_size=8, mode=pb.BatchMode(transitions=pb.TransitionsMode(n_step=3)),
                                   include_keys=True)
        mode = sample_mode(request, buffer.reader, 2**30)
        item_bytes = mode.item_bytes(buffer.ring) + buffer.sampler.extra_item_bytes + KEY_ITEM_BYTES
        batch = buffer.sample(8, mode, np.random.default_rng(0), include_keys=True, importance_beta=0.4)
        framing = codec.encoded_size(codec.encode_parts(batch)) - 8 * item_bytes
        assert codec.FRAMING_BYTES < framing <= codec.framing_bytes(3 * len(fields) + 8)
    finally:
        buffer.close()


def test_a_buffer_deleted_while_the_list_is_made_is_left_out(server: ReplayServer, client: ReplayClient,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    client.create_buffer("kept", 100, SCHEMA)
    client.create_buffer("gone", 100, SCHEMA)
    listed = server.registry.all()  # the list's snapshot, taken before the delete lands
    client.delete_buffer("gone")
    monkeypatch.setattr(server.registry, "all", lambda: listed)
    assert [b["name"] for b in client.list_buffers()] == ["kept"]


@pytest.mark.parametrize("name", ["abc\n", "abc\r", "a b", ""])
def test_names_with_a_line_break_or_space_are_refused(client: ReplayClient, name: str) -> None:
    code, details = rpc_status(client.create_buffer, name, 100, SCHEMA)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "buffer name" in details
    code, details = rpc_status(client.create_buffer, "b", 100, {**SCHEMA, name: ("float32", ())})
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "field name" in details
    code, details = rpc_status(client.create_rollout_buffer, name, 4, 2, {"obs": ("float32", (2,))})
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "buffer name" in details
    code, details = rpc_status(client.publish_weights, name, 1, b"")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "name" in details
    assert client.list_buffers() == []


def test_an_insert_stream_its_client_abandons_is_not_a_server_error(server: ReplayServer, client: ReplayClient,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A client whose deadline passes mid-stream ends the call: the server neither logs an error nor counts
    a rejected insert; the requests it had read are stored."""
    client.create_buffer("e", 1000, SCHEMA)
    span = client_episode_span(episode(np.random.default_rng(0), 10), True, ("obs",), episode_id=7)
    abandoned = threading.Event()

    def requests():
        yield spans_request("e", [span])
        abandoned.wait(10)  # the client's deadline passes while the stream waits for its next request

    def inserts_finished() -> float:
        labels = {"method": "Insert", "buffer": "e"}
        return server.metrics.get_sample_value("replayd_rpc_latency_seconds_count", labels) or 0

    before = inserts_finished()
    with caplog.at_level("ERROR", logger="replayd"):
        code, _ = rpc_status(client.insert, requests(), timeout=0.5, retry=False)
        abandoned.set()
        deadline = time.monotonic() + 10  # the handler ends after the client gave up: wait for its record
        while inserts_finished() == before:
            assert time.monotonic() < deadline, "the server never finished the abandoned insert"
            time.sleep(0.01)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "Insert" not in server.servicer.rejected
    assert client.describe("e")["episodes"] == 1
