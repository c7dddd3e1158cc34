"""ShardedReplayClient over K = 3 server processes on loopback: global uniform and prioritized sampling across shards
of unequal sizes (chi-square, and each item's probability and weight against a single server's), priority updates
routed by the keys' shard, buffers and their descriptions split and merged, rollout buffers and weights, and a shard
SIGKILLed while a writer inserts and a learner samples (tests/shard_cluster.py holds the checks)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import safetensors.numpy

from replayd.client import (
    MinSize,
    Prioritized,
    ReplayClient,
    SampleToInsertRatio,
    ShardedReplayClient,
    States,
    Transitions,
)
from replayd.client.polling import wait_until
from replayd.client.shard_set import resolve
from replayd.client.sharded import connect
from replayd.server.server import ReplayServer
from tests import shard_cluster
from tests.conftest import TEST_INSTANCE, free_port, rpc_status
from tests.shard_cluster import SCHEMA, ShardCluster, ShardServer, created

pytestmark = pytest.mark.timeout(600)


def loopback_cluster(name: str) -> ShardCluster:
    return ShardCluster([ShardServer(f"{TEST_INSTANCE}{name}{k}", "127.0.0.1", free_port()) for k in range(3)])


@pytest.fixture(scope="module")
def cluster() -> Iterator[ShardCluster]:
    with loopback_cluster("shards").running() as running:
        yield running


@pytest.fixture
def client(cluster: ShardCluster) -> Iterator[ShardedReplayClient]:
    with ShardedReplayClient(cluster.addresses, timeout=30) as sharded:
        sharded.wait_ready(60)
        yield sharded


def test_a_uniform_batch_draws_every_step_of_unequal_shards_alike(client: ShardedReplayClient) -> None:
    shard_cluster.check_uniform(client)


def test_a_prioritized_batch_follows_global_priorities_with_a_single_servers_probabilities_and_weights(
        client: ShardedReplayClient) -> None:
    shard_cluster.check_reference_server(client)


def test_a_buffer_is_created_on_every_shard_with_its_capacity_and_limiter_split(client: ShardedReplayClient) -> None:
    info = client.create_buffer("split", 1000, SCHEMA, rate_limiter=SampleToInsertRatio(2.0, 10, 6.0))
    try:
        check_split_and_merged(client, info)
    finally:
        client.delete_buffer("split")
    code, _ = rpc_status(client.describe, "split")
    assert code == grpc.StatusCode.NOT_FOUND


def check_split_and_merged(client: ShardedReplayClient, info: dict) -> None:
    shards = info["shards"]
    assert [shard["capacity_steps"] for shard in shards] == [334, 333, 333] and info["capacity_steps"] == 1000
    assert [shard["address"] for shard in shards] == [shard.address for shard in client.shards.members()]
    assert {shard["rate_limiter"] for shard in shards} == {SampleToInsertRatio(2.0, 4, 2.0)}
    assert info["rate_limiter"] == SampleToInsertRatio(2.0, 12, 6.0)  # the shards' sizes, summed
    client.insert_episodes("split", [shard_cluster.episode(n, 9) for n in range(30)], [True] * 30)
    described = client.describe("split")
    assert described["episodes"] == 30 and described["stored_steps"] == 300
    assert sum(shard["episodes"] for shard in described["shards"]) == 30
    assert all(shard["episodes"] for shard in described["shards"])  # a stable hash spreads the episodes
    assert described["counters"]["inserted_episodes"] == 30
    assert [b["name"] for b in client.list_buffers()] == ["split"]


def test_an_empty_buffer_answers_as_one_server_would(client: ShardedReplayClient) -> None:
    with created(client, "empty", rate_limiter=MinSize(1)):
        code, details = rpc_status(client.sample, "empty", 8, States())
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        code, details = rpc_status(client.sample, "empty", 8, States(), wait=True, timeout=0.5)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details


def test_a_seeded_request_draws_the_same_batch_again(client: ShardedReplayClient) -> None:
    with created(client, "seeded"):
        shard_cluster.fill_unequally(client, "seeded")
        first, again = (client.sample("seeded", 256, Transitions(), include_keys=True, seed=7) for _ in range(2))
    assert len(set((first["key"] >> 48).tolist())) == 3
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    assert first["bootstrap_obs"] is first["next_obs"]  # a merged batch keeps one server's aliases


def test_a_rollout_buffer_lives_on_one_shard_and_weights_on_every_shard(client: ShardedReplayClient) -> None:
    info = client.create_rollout_buffer("rollout", 4, 2, {"obs": ("float32", (3,))})
    assert len(info["shards"]) == 1
    columns = {"obs": np.ones((4, 2, 3), np.float32), "reward": np.ones((4, 2), np.float32),
               "value": np.zeros((4, 2), np.float32), "terminated": np.zeros((4, 2), bool),
               "truncated": np.zeros((4, 2), bool), "final_value": np.zeros((4, 2), np.float32)}
    pushed = client.push_rollout("rollout", 0, 0, 0, bootstrap_value=np.zeros(2, np.float32), **columns)
    assert pushed["rollout_complete"]
    assert sum(len(batch["advantage"]) for batch in client.rollout_minibatches("rollout", 4)) == 8
    assert client.describe("rollout")["shards"][0]["address"] == info["shards"][0]["address"]
    client.delete_buffer("rollout")
    blob = safetensors.numpy.save({"w": np.arange(3, dtype=np.float32)})
    assert client.publish_weights("policy", 1, blob)
    assert not client.publish_weights("policy", 1, blob)
    assert all(shard.client.fetch_weights("policy").version == 1 for shard in client.shards.members())
    fetched = client.fetch_weights("policy")
    assert (fetched.version, fetched.safetensors, fetched.final) == (1, blob, False)


def test_priority_updates_of_keys_no_shard_handed_out_are_refused(client: ShardedReplayClient) -> None:
    with created(client, "keys", sampler=Prioritized(0.6)), \
            pytest.raises(ValueError, match=r"shard index 9 .* is no shard of this client"):
        client.update_priorities("keys", [9 << 48], [1.0])


def test_a_shard_killed_while_sampling_and_inserting_is_left_out_and_rejoins() -> None:
    with loopback_cluster("kill").running() as cluster, \
            ShardedReplayClient(cluster.addresses, timeout=30) as client:
        client.wait_ready(60)
        shard_cluster.check_kill_and_rejoin(client, cluster)


def test_a_shard_restored_from_a_checkpoint_rejoins_without_a_new_client(tmp_path) -> None:
    """One of two in-process servers stops; the client samples the other; the server started again on its port
    with --restore (restore_from) holds its steps again, and the client draws them without being made anew."""
    directories = [tmp_path / "a", tmp_path / "b"]
    servers = [ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}restore{k}", checkpoint_dir=str(directory))
               .start() for k, directory in enumerate(directories)]
    try:
        with ShardedReplayClient([server.address for server in servers], timeout=30) as client:
            client.create_buffer("restored", 200, SCHEMA)
            a, b = client.shards.members()
            for shard, number in ((a, 1), (b, 2)):
                shard.client.insert_episode("restored", True, episode_id=number, **shard_cluster.episode(number, 9))
            assert len(client.checkpoint()) == 2
            servers[1].stop(grace=0)
            only_a = client.sample("restored", 64, States())  # finds b down, and draws the batch from a alone
            assert not b.up and set(only_a["obs"][:, 0].tolist()) == {1.0}
            servers[1] = ReplayServer(b.address, instance=f"{TEST_INSTANCE}restore1",
                                      restore_from=str(directories[1])).start()
            wait_until(lambda: b.up, time.monotonic() + 60, "the restored shard rejoining")
            episodes = set(client.sample("restored", 256, States(), include_keys=True)["obs"][:, 0].tolist())
            assert episodes == {1.0, 2.0}
            client.delete_buffer("restored")
    finally:
        for server in servers:
            server.stop(grace=0)


def test_command_lines_name_one_server_a_name_for_every_shard_or_a_list() -> None:
    with connect("127.0.0.1:1") as one:
        assert isinstance(one, ReplayClient)
    with connect("127.0.0.1:1,127.0.0.1:2") as listed:
        assert [shard.address for shard in listed.shards.members()] == ["127.0.0.1:1", "127.0.0.1:2"]
    with connect("shards:localhost:3") as named:
        assert [shard.address for shard in named.shards.members()] == resolve("localhost:3")


def test_a_name_resolves_to_every_address_it_has() -> None:
    port = free_port()
    expected = {f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}"
                for info in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)}
    assert set(resolve(f"localhost:{port}")) == expected
    with pytest.raises(ValueError, match="expected host:port"):
        resolve("localhost")


def test_compressed_stacked_frames_on_every_shard(client: ShardedReplayClient) -> None:
    """A buffer of compressed frames stacked at sample time, sized by bytes on every shard: a writer's episodes and
    a merged batch decompressed by the client name their own episode and steps, and the ratio is over all shards."""
    from replayd.client import EpisodeWriter, Frames
    from tests.test_compressed_frames import FRAME, frame_of, named

    schema = {"obs": ("uint8", FRAME, Frames(stack=4, stack_axis=0, compression="zstd")), "t": ("int64", ()),
              "reward": ("float32", ())}
    info = client.create_buffer("pix", 3000, schema, capacity_bytes=3 * 400_000)
    try:
        assert info["capacity_bytes"] == 3 * 400_000 and info["frames"]["obs"].compression == "zstd"
        with EpisodeWriter(client, "pix", chunk_rows=16) as writer:
            for episode in range(30):
                for t in range(20):
                    writer.append(obs=frame_of(episode, t), t=t, reward=1.0)
                writer.end_episode(terminated=True, obs=frame_of(episode, 20))
        for decompress in ("server", "client"):
            batch = client.sample("pix", 64, Transitions(), decompress=decompress)
            _, steps = named(batch["obs"].reshape(-1, *FRAME))
            np.testing.assert_array_equal(steps.reshape(64, 4), np.maximum(batch["t"][:, None] + np.arange(-3, 1), 0))
        counters = client.describe("pix")["counters"]
        shards = [shard["counters"] for shard in client.describe("pix")["shards"]]
        raw = sum(c["frames.obs.compression_ratio"] * c["frames.obs.stored_bytes"] for c in shards)
        assert counters["frames.obs.compression_ratio"] == pytest.approx(raw / counters["frames.obs.stored_bytes"])
    finally:
        client.delete_buffer("pix")
