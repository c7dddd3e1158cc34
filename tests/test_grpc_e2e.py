"""End to end over a real gRPC server on loopback: concurrent inserts, sampling, and every error code."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from client import EpisodeWriter, ReplayClient
from client.replay_client import Span, spans_request
from service.grpc_server.server import ReplayServer
from service.storage.shared_arrays import SharedArrays
from service.wire import replay_pb2 as pb

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
    for batch in client.sample_stream("cartpole", 4096, mode="states", num_batches=20, include_keys=True, seed=1):
        found.update(int(e) for e in batch["episode_id"])
    assert found == all_ids


def test_sample_modes_and_stream_over_grpc(client: ReplayClient) -> None:
    rng = np.random.default_rng(0)
    client.create_buffer("b", 10_000, SCHEMA)
    client.insert_episodes("b", [episode(rng, 20) for _ in range(10)], [True] * 5 + [False] * 5)
    batch = client.sample("b", 32, n_step=3, gamma=0.9, seed=5)
    assert batch["obs"].shape == (32, 4) and batch["obs"].dtype == np.float32
    assert set(batch) >= {"obs", "action", "reward", "next_obs", "terminated", "truncated", "n_step_return",
                          "bootstrap_discount", "bootstrap_obs"}
    again = client.sample("b", 32, n_step=3, gamma=0.9, seed=5)
    np.testing.assert_array_equal(batch["obs"], again["obs"])  # seeded requests are reproducible
    pairs = client.sample("b", 64, mode="geometric", discount=0.2)
    assert set(pairs) == {"obs", "future_obs", "offset"} and (pairs["offset"] >= 1).all()
    batches = list(client.sample_stream("b", 16, num_batches=7))
    assert len(batches) == 7 and all(b["obs"].shape == (16, 4) for b in batches)


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


def _code(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


def test_errors_return_their_codes_and_leave_buffers_untouched(server: ReplayServer, client: ReplayClient) -> None:
    rng = np.random.default_rng(1)
    created = client.create_buffer("e", 100, SCHEMA)
    client.insert_episode("e", terminated=True, **episode(rng, 10))
    reader = SharedArrays.attach(created["shm_name"])
    before = {name: array.tobytes() for name, array in reader.arrays.items()}

    code, details = _code(client.sample, "missing", 4)
    assert code == grpc.StatusCode.NOT_FOUND and "missing" in details
    bad = episode(rng, 10)
    bad["obs"] = bad["obs"].astype(np.float64)
    code, details = _code(client.insert_episode, "e", True, **bad)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'obs'" in details and "float32" in details and "float64" in details
    bad = episode(rng, 10)
    bad["obs"] = np.zeros((11, 5), np.float32)
    code, details = _code(client.insert_episode, "e", True, **bad)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "(4,)" in details and "(5,)" in details
    code, details = _code(client.insert_episode, "e", True, **episode(rng, 150))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "capacity_steps=100" in details
    code, details = _code(client.insert, [pb.InsertRequest(buffer="e", steps=b"not arrow", episode_ids=[1],
                                                           span_rows=[2], begins=[True], ends=[True])])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "Arrow" in details
    code, details = _code(client.create_buffer, "e", 100, SCHEMA)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already exists" in details
    code, details = _code(client.create_buffer, "bad", 100, {"obs": ("complex64", (2,))})
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "complex64" in details
    code, details = _code(client.sample, "e", 0)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "batch_size" in details
    code, details = _code(client.sample, "e", 4, n_step=-1)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "n_step" in details
    code, details = _code(client.sample, "e", 4, mode="geometric", discount=1.5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "discount" in details
    code, details = _code(client.sample, "e", 5_000_000, mode="states")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_message_bytes" in details

    after = {name: array.tobytes() for name, array in reader.arrays.items()}
    reader.close()
    assert after == before
    assert client.sample("e", 8)["obs"].shape == (8, 4)  # still serving


def test_empty_buffer_fails_fast_or_waits_for_data(client: ReplayClient) -> None:
    client.create_buffer("empty", 100, SCHEMA)
    code, details = _code(client.sample, "empty", 4)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no sampleable steps" in details
    code, _ = _code(client.sample, "empty", 4, wait=True, timeout=0.3)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(client.sample("empty", 4, wait=True, timeout=20)))
    waiter.start()
    client.insert_episode("empty", terminated=True, **episode(np.random.default_rng(0), 3))
    waiter.join()
    assert result["obs"].shape == (4, 4)


def test_stream_insert_reports_what_was_stored(client: ReplayClient) -> None:
    rng = np.random.default_rng(2)
    client.create_buffer("s", 1000, SCHEMA)
    good = spans_request("s", [Span({**episode(rng, 4), "action": np.zeros(5, np.int64),
                                     "reward": np.zeros(5, np.float32)}, 1)])
    bad = pb.InsertRequest(buffer="s", steps=good.steps, episode_ids=[2], span_rows=[4], begins=[True], ends=[True],
                           terminated=[False])
    code, details = _code(client.insert, [good, bad])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "1 before it were stored" in details
    assert client.describe("s")["episodes"] == 1


def test_delete_unlinks_and_list(client: ReplayClient) -> None:
    info = client.create_buffer("d", 100, SCHEMA)
    assert [b["name"] for b in client.list_buffers()] == ["d"]
    client.delete_buffer("d")
    assert client.list_buffers() == []
    with pytest.raises(FileNotFoundError):
        SharedArrays.attach(info["shm_name"])
