"""K replay server processes (shards) for the sharded client's tests, and the checks those tests run against them.

The checks take a ShardedReplayClient and the cluster, so they run alike over loopback (tests/test_sharded.py) and
over servers in network namespaces reached by a name that resolves to all of them (tests/test_sharded_netns.py,
which runs them in a child process: `python -m tests.shard_cluster ...`, in a private mount namespace whose
/etc/hosts lists the name).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from replayd.client import EpisodeWriter, Prioritized, ReplayClient, ShardedReplayClient, States
from replayd.client.polling import wait_until
from replayd.client.shard_math import SHARD_SHIFT
from replayd.server.buffers.reader import RingReader
from replayd.server.buffers.ring import ALIVE, IS_OPEN, EpisodicRing
from replayd.server.server import ReplayServer
from replayd.server.storage.shared_arrays import segments

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"obs": ("float32", (2,)), "reward": ("float32", ())}  # obs = (episode number, step t)
EPISODES_PER_SHARD = (3, 6, 12)  # shards of 30, 60 and 120 steps
STEPS = 10
ALPHA, BETA = 0.7, 0.4


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


@dataclass
class ShardServer:
    """One `replayd serve --recover` process: restarted after a SIGKILL, it reattaches to its shared memory."""

    instance: str
    host: str
    port: int
    netns: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self, token: str | None) -> list[str]:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        return [*prefix, sys.executable, "-m", "replayd.server.cli", "serve", "--host", self.host,
                "--port", str(self.port),
                "--instance", self.instance, "--http-port", "-1", "--log-level", "WARNING", "--recover",
                *(["--token", token] if token else [])]


class ShardCluster:
    def __init__(self, servers: list[ShardServer], token: str | None = None) -> None:
        self.servers, self.token = servers, token

    @property
    def addresses(self) -> list[str]:
        return [server.address for server in self.servers]

    def start(self, k: int) -> None:
        server = self.servers[k]
        server.process = subprocess.Popen(server.command(self.token), cwd=ROOT, stdout=subprocess.DEVNULL)

    def kill(self, k: int) -> None:
        process = self.servers[k].process
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def stop(self) -> None:
        """Stops every server (SIGTERM, then SIGKILL) and removes what their instances left in /dev/shm."""
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                server.process.terminate()
        for server in self.servers:
            if server.process is not None:
                try:
                    server.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait()
            for name in segments(f"rpd_{server.instance}_"):
                os.unlink(f"/dev/shm/{name}")
            Path(f"/dev/shm/replayd-{server.instance}.lock").unlink(missing_ok=True)

    def wait_ready(self, seconds: float = 60) -> None:
        for address in self.addresses:
            with ReplayClient(address, token=self.token or "") as client:
                client.wait_ready(seconds)

    @contextmanager
    def running(self) -> Iterator[ShardCluster]:
        """Every server started and accepting connections (so their instance locks exist), stopped at the end."""
        try:
            for k in range(len(self.servers)):
                self.start(k)
            self.wait_ready()
            yield self
        finally:
            self.stop()


# ---------------------------------------------------------------------------------------------- filling
@contextmanager
def created(client: ShardedReplayClient | ReplayClient, name: str, capacity: int = 3000, **options) -> Iterator[None]:
    """An episodic buffer of SCHEMA, deleted at the end (whatever happened)."""
    client.create_buffer(name, capacity, SCHEMA, **options)
    try:
        yield
    finally:
        client.delete_buffer(name)


def episode(number: int, length: int, first_t: int = 0) -> dict[str, np.ndarray]:
    t = np.arange(first_t, first_t + length + 1, dtype=np.float32)
    return {"obs": np.stack([np.full(t.size, number, np.float32), t], axis=1),
            "reward": np.ones(length, np.float32)}


def fill_unequally(client: ShardedReplayClient, buffer: str) -> dict[int, int]:
    """EPISODES_PER_SHARD episodes of STEPS steps into each shard, directly; returns episode number -> shard index."""
    home = {}
    for shard, count in zip(client.shards.members(), EPISODES_PER_SHARD, strict=True):
        numbers = [1000 * (shard.index + 1) + e for e in range(count)]
        shard.client.insert_episodes(buffer, [episode(n, STEPS) for n in numbers], [True] * count, numbers)
        home |= dict.fromkeys(numbers, shard.index)
    return home


def steps_of(batch: dict[str, np.ndarray]) -> list[tuple[int, int]]:
    return [(int(n), int(t)) for n, t in batch["obs"]]


def draws(client: ShardedReplayClient, buffer: str, batch_size: int, batches: int, **options) -> list[dict]:
    """`batches` unary batches and as many from a stream."""
    unary = [client.sample(buffer, batch_size, States(), include_keys=True, **options) for _ in range(batches)]
    streamed = list(client.sample_stream(buffer, batch_size, States(), num_batches=batches, include_keys=True,
                                         **options))
    return unary + streamed


def assert_keys_carry_their_shard(batches: list[dict], home: dict[int, int]) -> None:
    for batch in batches:
        shards = batch["key"] >> SHARD_SHIFT
        expected = np.array([home[n] for n, _ in steps_of(batch)])
        np.testing.assert_array_equal(shards, expected)


# ---------------------------------------------------------------------------------------------- checks
def check_uniform(client: ShardedReplayClient) -> None:
    """Every stored step equally likely over shards of 30, 60 and 120 steps (chi-square, p = 0.001)."""
    with created(client, "uniform"):
        home = fill_unequally(client, "uniform")
        batches = draws(client, "uniform", 1000, 10)
    assert_keys_carry_their_shard(batches, home)
    counts: dict[tuple[int, int], int] = dict.fromkeys(((n, t) for n in home for t in range(STEPS)), 0)
    for batch in batches:
        for step in steps_of(batch):
            counts[step] += 1
    observed = np.array(list(counts.values()))
    expected = observed.sum() / observed.size
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_critical(observed.size - 1), chi2


def keys_of_every_step(client: ShardedReplayClient | ReplayClient, buffer: str) -> dict[tuple[int, int], int]:
    found: dict[tuple[int, int], int] = {}
    wait_until(lambda: found.update(zip(steps_of(batch := client.sample(buffer, 2000, States(), include_keys=True)),
                                        batch["key"].tolist(), strict=True)) or len(found) == 210 or None,
               time.monotonic() + 60, "every step drawn once")
    return found


def shard_totals(client: ShardedReplayClient, buffer: str) -> list[float]:
    return [shard["counters"]["prioritized.total"] for shard in client.describe(buffer)["shards"]]


def check_priority_routing(client: ShardedReplayClient, keys: dict[tuple[int, int], int], home: dict[int, int],
                           priority: dict[tuple[int, int], float]) -> None:
    """Updates reach the shard that served each key: after an update of the last shard's keys alone, only that
    shard's priority mass changes, to the sum of its steps' p^alpha."""
    before = shard_totals(client, "per")
    last = max(home.values())
    mine = [step for step in keys if home[step[0]] == last]
    assert client.update_priorities("per", [keys[s] for s in mine], [priority[s] for s in mine]) == (len(mine), 0)
    after = shard_totals(client, "per")
    np.testing.assert_allclose(after[:last], before[:last])
    np.testing.assert_allclose(after[last], sum(priority[s] ** ALPHA for s in mine))


def check_prioritized(client: ShardedReplayClient, reference: ReplayClient) -> None:
    """Over shards of 30, 60 and 120 steps, with the same priorities as a single server holding every episode: each
    item's probability and importance weight are the single server's, and the draws follow p^alpha / sum p^alpha
    (chi-square, p = 0.001)."""
    with created(client, "per", sampler=Prioritized(ALPHA)), created(reference, "per", sampler=Prioritized(ALPHA)):
        home = fill_unequally(client, "per")
        reference.insert_episodes("per", [episode(n, STEPS) for n in home], [True] * len(home), list(home))
        keys, reference_keys = keys_of_every_step(client, "per"), keys_of_every_step(reference, "per")
        rng = np.random.default_rng(5)
        priority = {step: float(p) for step, p in zip(sorted(keys), rng.uniform(0.1, 5.0, len(keys)), strict=True)}
        check_priority_routing(client, keys, home, priority)
        steps = sorted(keys)
        assert client.update_priorities("per", [keys[s] for s in steps], [priority[s] for s in steps]) == (210, 0)
        reference.update_priorities("per", [reference_keys[s] for s in steps], [priority[s] for s in steps])
        expected: dict[tuple[int, int], tuple[float, float]] = {}
        for batch in [reference.sample("per", 5000, States(), importance_beta=BETA) for _ in range(4)]:
            expected |= zip(steps_of(batch), zip(batch["probability"].tolist(), batch["weight"].tolist(), strict=True),
                            strict=True)
        client.describe("per")  # splits use the sizes last described (at most refresh_seconds old): these, now
        batches = draws(client, "per", 2000, 8, importance_beta=BETA)
        assert_keys_carry_their_shard(batches, home)
        drawn = [step for batch in batches for step in steps_of(batch)]
        for batch in batches:
            want = np.array([expected[step] for step in steps_of(batch)])
            np.testing.assert_allclose(batch["probability"], want[:, 0], rtol=1e-9)
            np.testing.assert_allclose(batch["weight"], want[:, 1], rtol=1e-6)
        leaves = np.array([priority[s] ** ALPHA for s in steps])
        observed = np.array([drawn.count(s) for s in steps])
        mean = len(drawn) * leaves / leaves.sum()
        chi2 = float(((observed - mean) ** 2 / mean).sum())
        assert chi2 < chi_square_critical(len(steps) - 1), chi2


def check_reference_server(client: ShardedReplayClient) -> None:
    """check_prioritized against an in-process single server on loopback."""
    server = ReplayServer("127.0.0.1:0", instance=f"test{os.getpid()}ref").start()
    try:
        with ReplayClient(server.address, timeout=30) as reference:
            check_prioritized(client, reference)
    finally:
        server.stop(grace=0)


# ---------------------------------------------------------------------------------------------- a shard killed
class Traffic:
    """A writer (EpisodeWriter, episodes of 5-40 steps in chunks of 16 rows) and a learner (a prioritized stream
    with priority updates) on one buffer, each in a thread, counting what they did."""

    def __init__(self, client: ShardedReplayClient, buffer: str) -> None:
        self.client, self.buffer = client, buffer
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.ended: dict[int, int] = {}  # episode number -> length
        self.batches: list[tuple[float, set[int]]] = []  # (time, shards the batch came from)
        self.writer = EpisodeWriter(client, buffer, chunk_rows=16, batch_rows=64)
        self.threads = [threading.Thread(target=self._guard, args=(target,), daemon=True)
                        for target in (self._write, self._learn)]
        for thread in self.threads:
            thread.start()

    def _guard(self, target) -> None:
        try:
            target()
        except BaseException as exc:
            self.errors.append(exc)

    def _write(self) -> None:
        rng = np.random.default_rng(1)
        for number in itertools.count():
            if self.stop.is_set():
                return
            length = int(rng.integers(5, 41))
            data = episode(number, length)
            for t in range(length):
                self.writer.append(obs=data["obs"][t], reward=data["reward"][t])
            self.writer.end_episode(True, obs=data["obs"][length])
            self.ended[number] = length

    def _learn(self) -> None:
        rng = np.random.default_rng(2)
        stream = self.client.sample_stream(self.buffer, 64, States(), include_keys=True, importance_beta=BETA,
                                           wait=True, timeout=300)
        try:
            for batch in stream:
                self.batches.append((time.monotonic(), set((batch["key"] >> SHARD_SHIFT).tolist())))
                self.client.update_priorities(self.buffer, batch["key"], rng.uniform(0.5, 2.0, batch["key"].size))
                if self.stop.is_set():
                    return
        finally:
            stream.close()

    def flowing(self, since: tuple[int, int], more: int = 40) -> bool:
        assert not self.errors, self.errors
        return len(self.ended) >= since[0] + more and len(self.batches) >= since[1] + more

    def sampled(self, shard_index: int, after: float) -> bool:
        """Whether a batch received after `after` (monotonic seconds) holds a step of that shard."""
        assert not self.errors, self.errors
        return any(when > after and shard_index in shards for when, shards in self.batches[-50:])

    def counts(self) -> tuple[int, int]:
        return len(self.ended), len(self.batches)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
        assert not self.errors, self.errors

        def closed() -> bool:
            self.writer.close()
            return True

        wait_until(closed, time.monotonic() + 60, "the writer delivering every span")


def stored_episodes(instance: str, buffer: str) -> list[tuple[bool, np.ndarray]]:
    """(open, obs rows) of every live episode in a shard's ring, read from its shared memory."""
    reader = RingReader.attach(f"rpd_{instance}_{buffer}")
    try:
        ring: EpisodicRing = reader.ring
        out = []
        for seq in range(int(ring.state[1]), int(ring.state[2])):  # the live extents' sequence numbers
            slot = seq % ring.extent_slots
            flags = int(ring.extent_flags[slot])
            if flags & ALIVE:
                rows = np.arange(int(ring.extent_start[slot]), int(ring.extent_last[slot]) + 1) % ring.capacity
                out.append((bool(flags & IS_OPEN), ring.columns["obs"][rows].copy()))
        return out
    finally:
        reader.close()


def check_kill_and_rejoin(client: ShardedReplayClient, cluster: ShardCluster, victim: int = 1) -> None:
    """A shard SIGKILLed while a writer inserts and a learner samples: the learner's stream goes on from the other
    shards, the writer's new episodes go to them, the shard restarted with --recover rejoins without a new client,
    and every episode the writer ended is stored once, whole, on one shard."""
    client.create_buffer("kill", 3 * 20_000, SCHEMA, sampler=Prioritized(ALPHA))
    shard = next(s for s in client.shards.members() if s.address == cluster.servers[victim].address)
    traffic = Traffic(client, "kill")
    deadline = time.monotonic() + 120
    try:
        wait_until(lambda: traffic.flowing((0, 0)), deadline, "inserts and samples flowing")
        killed = traffic.counts()
        cluster.kill(victim)
        wait_until(lambda: traffic.flowing(killed) and not shard.up, deadline,
                   "traffic flowing without the killed shard")
        assert client.metrics.get_sample_value("replayd_client_shard_failures_total", {"shard": shard.address}) == 1
        down = traffic.counts()
        wait_until(lambda: traffic.flowing(down), deadline, "traffic flowing on while the shard is down")
        assert not shard.up
        unary = client.sample("kill", 256, States(), include_keys=True)
        assert shard.index not in set((unary["key"] >> SHARD_SHIFT).tolist())
        cluster.start(victim)
        wait_until(lambda: shard.up, deadline, "the restarted shard rejoining")
        rejoined = time.monotonic()
        wait_until(lambda: traffic.sampled(shard.index, after=rejoined), deadline, "batches from the rejoined shard")
        assert client.metrics.get_sample_value("replayd_client_shard_rejoins_total", {"shard": shard.address}) == 1
    finally:
        traffic.finish()
    check_stored_once(traffic.ended, [server.instance for server in cluster.servers], "kill")
    client.delete_buffer("kill")


def check_stored_once(ended: dict[int, int], instances: list[str], buffer: str) -> None:
    """Every ended episode is one closed episode on one shard, its steps consecutive up to its end: from step 0, or,
    for an episode whose shard went down while it was open, from where it went on (its first steps are an open
    episode on that shard)."""
    closed: dict[int, list[np.ndarray]] = {}
    open_parts: dict[int, list[np.ndarray]] = {}
    for instance in instances:
        for is_open, obs in stored_episodes(instance, buffer):
            (open_parts if is_open else closed).setdefault(int(obs[0, 0]), []).append(obs)
    for number, length in ended.items():
        copies = closed.get(number, [])
        assert len(copies) == 1, f"episode {number} stored {len(copies)} times"
        t = copies[0][:, 1]
        np.testing.assert_array_equal(t, np.arange(t[0], length + 1))
        if t[0] > 0:
            assert number in open_parts, f"episode {number} went on from step {t[0]} without an open part"
    restarted = [n for n in ended if closed[n][0][0, 1] > 0]
    assert len(restarted) <= 1, restarted


# ---------------------------------------------------------------------------------------------- in a child process
def main(argv: list[str] | None = None) -> None:
    """Starts the servers (in their network namespaces), then runs every check through one name."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="name:port that resolves to every shard")
    parser.add_argument("--hosts", required=True, help="the shards' addresses, comma-separated")
    parser.add_argument("--netns", required=True, help="the shards' network namespaces, comma-separated")
    parser.add_argument("--instances", required=True, help="the shards' instance names, comma-separated")
    parser.add_argument("--token", required=True)
    args = parser.parse_args(argv)
    _, port = args.name.rsplit(":", 1)
    servers = [ShardServer(instance, host, int(port), netns) for host, netns, instance in
               zip(args.hosts.split(","), args.netns.split(","), args.instances.split(","), strict=True)]
    with ShardCluster(servers, args.token).running() as cluster, \
            ShardedReplayClient(args.name, timeout=30, token=args.token) as client:
        assert sorted(client.shards.members(), key=lambda s: s.address) == client.shards.members()
        assert [s.address for s in client.shards.members()] == sorted(cluster.addresses)
        client.wait_ready(60)
        check_uniform(client)
        check_reference_server(client)
        check_kill_and_rejoin(client, cluster)
    print("every check passed", flush=True)


if __name__ == "__main__":
    main()
