"""Several servers side by side (shards): each keeps its state in its own buffer objects, nothing is shared
through the process, so a client can talk to several servers that hold buffers of the same name."""

from __future__ import annotations

import os

import grpc
import numpy as np
import safetensors.numpy

from replayd.client import ReplayClient
from replayd.server.server import ReplayServer
from tests.conftest import TEST_INSTANCE, rpc_status

SCHEMA = {"obs": ("float32", (3,)), "action": ("int64", ()), "reward": ("float32", ())}


def insert(client: ReplayClient, episode_id: int, length: int) -> None:
    client.insert_episode("shared_name", terminated=True, episode_id=episode_id,
                          obs=np.full((length + 1, 3), episode_id, np.float32),
                          action=np.zeros(length, np.int64), reward=np.ones(length, np.float32))


def segments_of(instance: str) -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"rpd_{instance}_")}


def test_two_servers_in_one_process_keep_their_own_buffers_weights_and_memory() -> None:
    instances = [f"{TEST_INSTANCE}shard{k}" for k in range(2)]
    servers = [ReplayServer("127.0.0.1:0", instance=name).start() for name in instances]
    clients = [ReplayClient(server.address, timeout=20) for server in servers]
    running = list(servers)
    try:
        for client in clients:
            client.create_buffer("shared_name", capacity_steps=1000, schema=SCHEMA)
        for episode_id in (1, 2, 3):
            insert(clients[0], episode_id, length=10)
        insert(clients[1], 7, length=4)

        described = [client.describe("shared_name") for client in clients]
        assert [(d["episodes"], d["stored_steps"]) for d in described] == [(3, 33), (1, 5)]
        assert described[0]["shm_name"] != described[1]["shm_name"]
        assert all(segments_of(name) for name in instances)

        batches = [client.sample("shared_name", 64, include_keys=True, seed=0) for client in clients]
        assert set(batches[0]["episode_id"].tolist()) <= {1, 2, 3}
        assert set(batches[1]["episode_id"].tolist()) == {7}
        np.testing.assert_array_equal(batches[1]["obs"], np.full((64, 3), 7, np.float32))

        assert clients[0].publish_weights("policy", 1, safetensors.numpy.save({"w": np.ones(2, np.float32)}))
        assert clients[1].fetch_weights("policy").version == 0  # weights live on the server that got them

        clients[0].delete_buffer("shared_name")
        code, details = rpc_status(clients[0].describe, "shared_name")
        assert code == grpc.StatusCode.NOT_FOUND, details
        assert clients[1].describe("shared_name")["episodes"] == 1

        running.remove(servers[1])
        servers[1].stop(grace=0)  # stopping one shard leaves the other serving, its memory in place
        assert not segments_of(instances[1])
        clients[0].create_buffer("shared_name", capacity_steps=1000, schema=SCHEMA)
        insert(clients[0], 9, length=2)
        assert clients[0].sample("shared_name", 8, include_keys=True)["episode_id"].tolist() == [9] * 8
        assert segments_of(instances[0])
    finally:
        for client in clients:
            client.close()
        for server in running:
            server.stop(grace=0)
    assert not any(segments_of(name) for name in instances)


def test_a_stopped_server_leaves_no_worker_thread_behind() -> None:
    """gRPC does not shut down the executor it is given, so the server does: its idle workers would live as
    long as the server object."""
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}stop").start()
    try:
        with ReplayClient(server.address, timeout=20) as client:
            client.create_buffer("shared_name", capacity_steps=100, schema=SCHEMA)
            for episode_id in range(4):
                insert(client, episode_id, length=3)
        workers = list(server._workers._threads)
        assert workers
    finally:
        server.stop(grace=0)
    for worker in workers:
        worker.join(timeout=10)
    assert not any(worker.is_alive() for worker in workers)
