"""Replay shards as Ray actors on a local Ray cluster of 3 nodes that the tests start (ray.cluster_utils.Cluster: a
head and two worker nodes, each with its own resources): shards on distinct nodes that serve one sharded buffer, a
shard whose server dies restarted by Ray on its node and reattached to its shared memory, `replayd ray up/down`, and
DQN actors and a learner training through the shards while a shard's node is removed (Ray restarts the shard on
another node, it restores its checkpoint and rejoins, the learner keeps going).

The nodes share this host, and so its /dev/shm: each shard's instance names its node, so a shard on another node
finds none of its segments there and restores its checkpoint, as it would on another machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

# Every node of the test's cluster, and every process of theirs, on 127.0.0.1: Ray's setting for a cluster on one
# host, read when ray is imported (here, before any test module imports it; only Ray reads it).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="the `ray` extra is not installed (pip install 'replayd[ray]'; `make test` "
                                        "installs it)")

from ray.cluster_utils import Cluster  # noqa: E402

from replayd.client import ReplayClient, States  # noqa: E402
from replayd.client.learners.dqn import CARTPOLE_SCHEMA  # noqa: E402
from replayd.client.polling import wait_until  # noqa: E402
from replayd.client.ray import BufferSpec, find_shards, run_actors, start_shards  # noqa: E402
from replayd.client.ray.resolver import NAMESPACE, actor_name, distinct  # noqa: E402
from replayd.client.sharded import connect  # noqa: E402
from replayd.server.storage.shared_arrays import segments  # noqa: E402
from tests.conftest import TEST_INSTANCE  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"obs": ("float32", (2,)), "reward": ("float32", ())}
SHM = 2**30  # each node's /dev/shm as the node resource `shm` (bytes)
SHARD_SHM = 64 * 2**20  # what each shard reserves of it


def group(suffix: str) -> str:
    return f"{TEST_INSTANCE}{suffix}"  # the shards' instances start with it: conftest's leak check sees them


class LocalCluster:
    """A head node (where the driver, the learner and the actors run: resource `head`) and two worker nodes, each
    with a resource of its own (`node_b`, `node_c`) and `shm`."""

    def __init__(self) -> None:
        self.cluster = Cluster()
        self.workers = {}

    def start(self) -> None:
        common = {"object_store_memory": 80 * 2**20}
        self.cluster.add_node(num_cpus=4, resources={"head": 1, "shm": SHM}, include_dashboard=False, **common)
        for name in ("node_b", "node_c"):
            self.workers[name] = self.cluster.add_node(num_cpus=2, resources={name: 1, "shm": SHM}, **common)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False)
        self.head_id = ray.get_runtime_context().get_node_id()

    def node(self, node_id: str):
        return next(node for node in self.workers.values() if node.node_id == node_id)

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


def processes_of(temp_dir: str) -> list[psutil.Process]:
    """The Ray processes of the cluster (every one's command line or working files name its temp_dir) and the
    replayd servers the tests started (their instances start with TEST_INSTANCE), still running."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if temp_dir in command or ("replayd.server.cli serve" in command and f"--instance {TEST_INSTANCE}" in command):
            found.append(process)
    return found


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    temp_dir = tempfile.mkdtemp(prefix="rpdray", dir="/tmp")  # short: Ray's socket paths live under it
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TMPDIR", temp_dir)  # the cluster's sessions, logs and sockets, removed at the end
        local = LocalCluster()
        try:
            local.start()
            yield local
        finally:
            try:
                local.shutdown()
                wait_until(lambda: not processes_of(temp_dir), time.monotonic() + 60, "the cluster's processes ending")
            finally:
                shutil.rmtree(temp_dir, ignore_errors=True)


def actor_gone(name: str) -> bool:
    try:
        ray.get_actor(actor_name(name, 0), namespace=NAMESPACE)
    except ValueError:
        return True
    return False


def episode(number: int, steps: int = 9) -> dict[str, np.ndarray]:
    obs = np.stack([np.full(steps + 1, number, np.float32), np.arange(steps + 1, dtype=np.float32)], axis=1)
    return {"obs": obs, "reward": np.ones(steps, np.float32)}


def test_an_address_two_shards_told_is_the_one_that_told_it_last() -> None:
    """Shard 0 moved away from 127.0.0.1:5, where shard 1 listens now; shard 0's new address is not known yet."""
    assert distinct(["127.0.0.1:5", "127.0.0.1:5", "127.0.0.1:7"], [1.0, 2.0, 1.5]) == {"1": "127.0.0.1:5",
                                                                                       "2": "127.0.0.1:7"}
    assert distinct(["127.0.0.1:5", "127.0.0.1:6"], [1.0, 0.5]) == {"0": "127.0.0.1:5", "1": "127.0.0.1:6"}


def test_run_actors_refuses_options_the_programs_do_not_have() -> None:
    with pytest.raises(ValueError, match=r"actor options \['epsilon'\] are not options of DQNActorConfig"):
        run_actors("replayd", "dqn", actor_options={"epsilon": 0.1})
    with pytest.raises(ValueError, match=r"learner options \['actors'\] are not options of DQNLearnerConfig"):
        run_actors("replayd", "dqn", learner_options={"actors": 2})
    with pytest.raises(ValueError, match="algo: expected one of"):
        run_actors("replayd", "a2c")


def test_shards_land_on_distinct_nodes_and_serve_one_buffer_found_by_name(cluster: LocalCluster) -> None:
    name = group("a")
    started = start_shards(3, [BufferSpec("spread", 3000, SCHEMA)], name=name, strategy="STRICT_SPREAD",
                           shm_bytes=SHARD_SHM, http_port=-1)
    try:
        info = started.info()
        table = ray.util.placement_group_table(started._group)
        assert [shard["node_id"] for shard in info] == [table["bundles_to_node_id"][k] for k in range(3)]
        assert len({shard["node_id"] for shard in info}) == 3  # the head and both worker nodes
        alive = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
        assert {shard["node_id"] for shard in info} == set(alive)
        assert all(alive[shard["node_id"]]["shm"] == SHM for shard in info)
        assert [shard["started_from"] for shard in info] == ["empty"] * 3
        with started.client(timeout=30) as client:
            described = client.describe("spread")
            assert described["capacity_steps"] == 3000
            assert [shard["capacity_steps"] for shard in described["shards"]] == [1000, 1000, 1000]
            client.insert_episodes("spread", [episode(n) for n in range(30)], [True] * 30)
            assert client.describe("spread")["episodes"] == 30  # (describing takes the shards' sizes now)
            batch = client.sample("spread", 256, States(), include_keys=True)
            assert len(set((batch["key"] >> 48).tolist())) == 3
        # Another driver's client finds them by name alone (`--address ray:NAME`).
        with connect(f"ray:{name}") as named:
            assert [shard.address for shard in named.shards.members()] == [shard["address"] for shard in info]
            assert named.describe("spread")["episodes"] == 30
        assert find_shards(name).addresses() == [shard["address"] for shard in info]
    finally:
        started.stop()
    assert actor_gone(name)
    assert segments(f"rpd_{name}") == []


def test_a_shard_whose_server_dies_is_restarted_on_its_node_and_reattaches_its_shared_memory(
        cluster: LocalCluster) -> None:
    name = group("r")
    started = start_shards(2, [BufferSpec("kept", 2000, SCHEMA)], name=name, shm_bytes=SHARD_SHM, http_port=-1)
    try:
        with started.client(timeout=30) as client:
            client.insert_episodes("kept", [episode(n) for n in range(40)], [True] * 40)
            before = started.info()
            held = [shard["episodes"] for shard in client.describe("kept")["shards"]]
            assert all(held) and sum(held) == 40
            os.kill(before[0]["server_pid"], signal.SIGKILL)  # the actor exits with it, and Ray restarts it
            after = wait_until(lambda: restarted(started, 0, before[0]["server_pid"]), time.monotonic() + 120,
                               "Ray restarting the shard")
            assert after["node_id"] == before[0]["node_id"] and after["instance"] == before[0]["instance"]
            assert after["started_from"] == "recovered" and after["restarted"]
            with ReplayClient(after["address"], timeout=30) as shard:
                assert shard.describe("kept")["episodes"] == held[0]  # every episode, from its shared memory
            # The client asks the actors where they are, and the shard rejoins it (as shard 0, at its new port).
            wait_until(lambda: after["address"] in [s.address for s in client.shards.up()], time.monotonic() + 60,
                       "the restarted shard rejoining the client")
            assert [s.address for s in client.shards.members()] == [after["address"], before[1]["address"]]
            wait_until(lambda: client.describe("kept")["episodes"] == 40, time.monotonic() + 60,
                       "both shards' episodes described")
    finally:
        started.stop()
    assert segments(f"rpd_{name}") == []


def restarted(started, index: int, old_pid: int) -> dict | None:
    info = ray.get(started.handles[index].info.remote(), timeout=60)
    return info if info["server_pid"] != old_pid else None


def test_replayd_ray_up_status_run_and_down_as_commands(cluster: LocalCluster, tmp_path: Path) -> None:
    """`up` starts shards that outlive the command (detached); `run` trains a DQN learner and an actor against them as
    Ray tasks; `down` stops them."""
    name = group("cli")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def replayd(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "replayd.server.cli", "ray", *args, "--name", name,
                               "--address", cluster.cluster.address], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    try:
        up = replayd("up", "--shards", "2", "--strategy", "STRICT_SPREAD", "--shm-gb", "0.0625", "--http-port", "-1")
        addresses = find_shards(name).addresses()  # the command has exited: the detached shards still serve
        assert all(address in up for address in addresses) and f"--address ray:{name}" in up
        with connect(f"ray:{name}") as client:
            client.wait_ready(30)
            client.create_buffer("cli", 100, SCHEMA)
            client.insert_episodes("cli", [episode(n) for n in range(4)], [True] * 4)
            assert client.describe("cli")["episodes"] == 4
        status = replayd("status")
        assert all(address in status for address in addresses)
        ran = replayd("run", "--algo", "dqn", "--actors", "1", "--seconds", "3", "--run-dir", str(tmp_path / "run"))
        assert "learner: " in ran and "1 actor(s)" in ran, ran
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["learner_steps"] > 0
        assert "2 shard(s)" in replayd("down")
    finally:
        if not actor_gone(name):
            find_shards(name).stop()
    assert actor_gone(name)
    assert segments(f"rpd_{name}") == []


def test_dqn_actors_and_a_learner_train_through_shards_while_a_shards_node_is_removed(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """Runs last: it removes a worker node from the module's cluster."""
    name = group("dqn")
    on_head = {"resources": {"head": 0.01}}  # the learner and the actors stay on the node that is not removed
    started = start_shards(2, [BufferSpec("cartpole", 20_000, CARTPOLE_SCHEMA)], name=name, strategy="STRICT_SPREAD",
                           shm_bytes=SHARD_SHM, checkpoint_dir=str(tmp_path / "checkpoints"), http_port=-1)
    run = None
    try:
        run = run_actors(started, "dqn", actors=2, actor_options={"seconds": 300},
                         learner_options={"seconds": 45, "run_dir": str(tmp_path / "run"), "capacity_steps": 20_000,
                                          "learning_starts": 500, "batch_size": 64, "publish_every": 10,
                                          "eval_every": 10**6, "eval_episodes": 2},
                         actor_ray_options=on_head, learner_ray_options={**on_head, "max_retries": 0})
        with started.client(timeout=30) as client:
            # Training: the learner publishes new weights every 10 steps, from batches drawn on both shards.
            wait_until(lambda: client.fetch_weights("q").version >= 3, time.monotonic() + 180, "the learner training")
            wait_until(lambda: all(shard["episodes"] for shard in client.describe("cartpole")["shards"]),
                       time.monotonic() + 60, "episodes on both shards")
            before = started.info()
            victim = next(shard for shard in before if shard["node_id"] != cluster.head_id)
            with ReplayClient(victim["address"], timeout=30) as shard:
                inserted = shard.describe("cartpole")["counters"]["inserted_episodes"]  # at most what is checkpointed
            assert len(client.checkpoint()) == 2  # every shard's checkpoint, in its directory on the shared storage

            index = next(s.index for s in client.shards.members() if s.address == victim["address"])
            cluster.cluster.remove_node(cluster.node(victim["node_id"]))
            version = client.fetch_weights("q").version
            moved = wait_until(lambda: restarted(started, victim["index"], victim["server_pid"]),
                               time.monotonic() + 120, "Ray restarting the shard on another node")
            assert moved["node_id"] != victim["node_id"] and moved["started_from"] == "restored"
            assert moved["node_id"] not in {shard["node_id"] for shard in before if shard is not victim}
            with ReplayClient(moved["address"], timeout=30) as shard:  # its counters, and rows, from the checkpoint
                assert shard.describe("cartpole")["counters"]["inserted_episodes"] >= inserted > 0
            # It rejoins the client through the launcher, as the same shard (its keys' index), and the learner keeps
            # going over both shards.
            wait_until(lambda: moved["address"] in [s.address for s in client.shards.up()], time.monotonic() + 60,
                       "the moved shard rejoining the client")
            assert next(s.index for s in client.shards.members() if s.address == moved["address"]) == index
            wait_until(lambda: client.fetch_weights("q").version >= version + 3, time.monotonic() + 60,
                       "the learner training on")
            drawn = wait_until(lambda: index in (client.sample("cartpole", 256, States(), include_keys=True)["key"]
                                                 >> 48).tolist(), time.monotonic() + 60, "a batch from the moved shard")
            assert drawn
        summary, reports = run.result(timeout=240)
        run = None
        assert summary["learner_steps"] >= 10 * (version + 3) - 10
        assert all(report.env_steps > 0 for report in reports)
        assert (tmp_path / "run" / "summary.json").exists()
    finally:
        if run is not None:  # the test failed before the run ended
            run.cancel()
        started.stop()
    assert segments(f"rpd_{name}") == []
