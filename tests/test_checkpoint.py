"""Checkpoints: write every buffer to disk, restore into a new server, and get the same samples back."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest

from replayd.client import ReplayClient
from replayd.client.replay_client import Span, spans_request
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.checkpoint import LATEST, MANIFEST, latest_checkpoint, restore_checkpoint, write_checkpoint
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.registry import BufferRegistry
from replayd.server.schema import Field
from replayd.server.server import ReplayServer
from replayd.server.storage.shared_arrays import segments
from replayd.wire.components import Prioritized, SampleToInsertRatio, Transitions
from replayd.wire.errors import FailedPrecondition, Unavailable
from tests.conftest import TEST_INSTANCE, rpc_status

SCHEMA = {"obs": ("float32", (3,)), "action": ("int64", ()), "reward": ("float32", ())}
ROLLOUT_SCHEMA = {"obs": ("float32", (2,)), "action": ("int64", ())}
T, N = 4, 2
_instances = itertools.count()


def new_instance() -> str:
    return f"{TEST_INSTANCE}c{next(_instances)}"


def episode(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
    return {"obs": rng.normal(size=(length + 1, 3)).astype(np.float32), "action": rng.integers(0, 4, length),
            "reward": rng.normal(size=length).astype(np.float32)}


def chunk(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    return {"obs": rng.normal(size=(rows, 3)).astype(np.float32), "action": rng.integers(0, 4, rows),
            "reward": rng.normal(size=rows).astype(np.float32)}


def rollout_part(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"obs": rng.normal(size=(T, N, 2)).astype(np.float32), "action": rng.integers(0, 4, (T, N)),
            "reward": rng.normal(size=(T, N)).astype(np.float32), "value": rng.normal(size=(T, N)).astype(np.float32),
            "terminated": rng.random((T, N)) < 0.2, "truncated": np.zeros((T, N), bool),
            "final_value": np.zeros((T, N), np.float32)}


def restored_episodes(path: Path) -> dict[str, int]:
    """Restores the checkpoint at `path` into a fresh registry: episodes per restored buffer, in order."""
    other = BufferRegistry(new_instance())
    try:
        return {name: other.episodic(name).episodes for name in restore_checkpoint(path, other)}
    finally:
        other.close()


def assert_same_batches(first: list[dict[str, np.ndarray]], second: list[dict[str, np.ndarray]]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert sorted(a) == sorted(b)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def samples(client: ReplayClient) -> dict[str, list[dict[str, np.ndarray]]]:
    return {
        "uni": [client.sample("uni", 16, mode=Transitions(n_step=3), seed=seed, include_keys=True) for seed in (1, 2)],
        "pri": [client.sample("pri", 16, seed=seed, include_keys=True, importance_beta=0.5) for seed in (1, 2)],
        "ppo": list(client.rollout_minibatches("ppo", 3, epochs=2, seed=5)),
    }


def test_round_trip_through_grpc(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    instance = new_instance()
    with ReplayServer("127.0.0.1:0", instance=instance, checkpoint_dir=str(tmp_path)) as server, \
            ReplayClient(server.address, timeout=20) as client:
        client.create_buffer("uni", 200, SCHEMA,
                             rate_limiter=SampleToInsertRatio(1.0, min_size_to_sample=5, error_buffer=500))
        client.create_buffer("pri", 200, SCHEMA, sampler=Prioritized(alpha=0.7))
        client.create_rollout_buffer("ppo", T, N, ROLLOUT_SCHEMA, gamma=0.9, gae_lambda=0.8)
        for name in ("uni", "pri"):
            client.insert_episodes(name, [episode(rng, n) for n in (5, 9, 3, 12)], [True, False, True, True])
            client.insert([spans_request(name, [Span(chunk(rng, 6), 77, begins=True, ends=False)])])
        keys = client.sample("pri", 8, seed=9, include_keys=True)["key"]
        assert client.update_priorities("pri", keys, np.linspace(0.1, 3.0, len(keys)))[0] > 0
        client.push_rollout("ppo", 0, 0, 0, bootstrap_value=np.ones(N, np.float32), **rollout_part(rng))
        list(client.rollout_minibatches("ppo", 4))  # the learner trains on rollout 0, then moves on to version 3
        client.finish_rollout("ppo", 3)
        client.push_rollout("ppo", 3, 0, 0, bootstrap_value=np.ones(N, np.float32), **rollout_part(rng))
        client.sample("uni", 8, seed=3)  # counted against the limiter's samples per insert
        assert client.describe("uni")["counters"]["rate_limiter.samples"] == 8
        manifest = client.checkpoint()  # into the server's --checkpoint-dir
        assert Path(manifest).name == MANIFEST and (tmp_path / LATEST).is_file()
        infos = {name: client.describe(name) for name in ("uni", "pri", "ppo")}
        trees = {name: server.registry.episodic("pri").storage.arrays[name].copy()
                 for name in ("prioritized.sum", "prioritized.min", "prioritized.max_priority")}
        before = samples(client)
    tail = chunk(rng, 4)
    with ReplayServer("127.0.0.1:0", instance=instance, restore_from=str(tmp_path)) as server, \
            ReplayClient(server.address, timeout=20) as client:
        # Counters included: the limiter's samples are restored, not reset (they decide what it admits).
        assert {name: client.describe(name) for name in ("uni", "pri", "ppo")} == infos
        ppo = server.registry.rollout("ppo")
        assert (ppo.policy_version, ppo.config.gamma, ppo.config.gae_lambda) == (3, 0.9, 0.8)
        for name, tree in trees.items():
            np.testing.assert_array_equal(server.registry.episodic("pri").storage.arrays[name], tree)
        after = samples(client)
        for name in ("uni", "pri", "ppo"):
            assert_same_batches(before[name], after[name])
        for name in ("uni", "pri"):
            # The open episode continues where it was: its next chunk (offset 6) is accepted and closes it.
            episodes = client.describe(name)["episodes"]
            client.insert([spans_request(name, [Span(tail, 77, begins=False, ends=True, terminated=True,
                                                     offset=6)])])
            info = client.describe(name)
            assert info["episodes"] == episodes + 1 and info["counters"]["open_episodes"] == 0


def test_keep_leaves_the_newest_checkpoints(tmp_path: Path) -> None:
    registry = BufferRegistry(new_instance())
    try:
        buffer = EpisodicBuffer("b", registry.instance, FIELDS, 100)
        registry.add("b", buffer)
        written = []
        for episode_id in range(4):
            insert(buffer, [episode_id], 3)
            written.append(write_checkpoint(registry, tmp_path, keep=2).parent)
        assert sorted(p for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == written[-2:]
        assert latest_checkpoint(tmp_path) == written[-1]
    finally:
        registry.close()


def test_incomplete_checkpoints_are_ignored(tmp_path: Path) -> None:
    registry = BufferRegistry(new_instance())
    try:
        buffer = EpisodicBuffer("b", registry.instance, FIELDS, 100)
        registry.add("b", buffer)
        insert(buffer, [1, 2], 9)
        good = write_checkpoint(registry, tmp_path).parent
        # A crash mid-write leaves a temporary directory, or (renamed by hand) one without a manifest.
        shutil.copytree(good, tmp_path / ".tmp-ckpt-000002-1-ab")
        (tmp_path / ".tmp-ckpt-000002-1-ab" / MANIFEST).unlink()
        shutil.copytree(tmp_path / ".tmp-ckpt-000002-1-ab", tmp_path / "ckpt-000003")
        assert latest_checkpoint(tmp_path) == good
        (tmp_path / LATEST).write_text("ckpt-000003\n")  # a pointer to an incomplete one falls back
        assert latest_checkpoint(tmp_path) == good
        (tmp_path / LATEST).write_bytes(b"\xff\xfe")  # so does one damaged past decoding
        assert latest_checkpoint(tmp_path) == good
        (tmp_path / LATEST).unlink()
        assert latest_checkpoint(tmp_path) == good
        assert (tmp_path / good.name / MANIFEST).is_file()
        assert restored_episodes(tmp_path) == {"b": 2}
        with pytest.raises(FailedPrecondition, match="no complete checkpoint"):
            restore_checkpoint(tmp_path / "empty", BufferRegistry(new_instance()))
    finally:
        registry.close()


def test_a_checkpoint_removes_what_writers_that_died_left(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid names a process no longer running
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    registry = BufferRegistry(new_instance())
    try:
        registry.add("b", EpisodicBuffer("b", registry.instance, FIELDS, 100))
        left = [f".tmp-ckpt-000004-{dead.pid}-0a1b2c3d", f".tmp-ckpt-000005-{os.getpid()}-0a1b2c3d",
                ".tmp-removing-ckpt-000001-0a1b2c3d"]
        for name in left:
            (tmp_path / name / "b").mkdir(parents=True)
            (tmp_path / name / "b" / "obs.arrow").write_bytes(b"partial")
        (tmp_path / f".tmp-LATEST-{dead.pid}-0a1b2c3d").write_text("ckpt-000004\n")
        kept = [f".tmp-ckpt-000006-{alive.pid}-0a1b2c3d", "notes.txt"]  # a running writer's; not ours at all
        (tmp_path / kept[0]).mkdir()
        (tmp_path / kept[1]).write_text("mine")
        final = write_checkpoint(registry, tmp_path).parent
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([final.name, LATEST, *kept])
        assert final.name == "ckpt-000001"
    finally:
        alive.stdin.close()
        alive.wait()
        registry.close()


def test_incompatible_checkpoints_are_refused(tmp_path: Path) -> None:
    registry = BufferRegistry(new_instance())
    try:
        registry.add("b", EpisodicBuffer("b", registry.instance, FIELDS, 100))
        path = write_checkpoint(registry, tmp_path)
        # Same instance: the segments exist already (a server of this instance is running).
        with pytest.raises(FailedPrecondition, match=r"buffer 'b'.*already exists"):
            restore_checkpoint(tmp_path, BufferRegistry(registry.instance))
        # A registry that has a buffer of that name already.
        with pytest.raises(FailedPrecondition, match=r"buffer 'b'.*already exists"):
            restore_checkpoint(tmp_path, registry)
        manifest = json.loads(path.read_text())
        other = BufferRegistry(new_instance())
        bad = json.loads(json.dumps(manifest))
        bad["layout_version"] = 99
        path.write_text(json.dumps(bad))
        with pytest.raises(FailedPrecondition, match="layout_version 99, this code reads"):
            restore_checkpoint(tmp_path, other)
        bad = json.loads(json.dumps(manifest))
        bad["buffers"][0]["config"]["fields"][0]["shape"] = [5]  # obs (3,) -> (5,): the code builds another array
        path.write_text(json.dumps(bad))
        with pytest.raises(FailedPrecondition, match=r"buffer 'b': array 'field.obs' is float32 \[100, 3\] in the "
                                                     r"checkpoint, but this code builds float32 \[100, 5\]"):
            restore_checkpoint(tmp_path, other)
        bad = json.loads(json.dumps(manifest))
        bad["buffers"][0]["arrays"].append({"name": "field.extra", "dtype": "int8", "shape": [100],
                                            "file": "field.extra.arrow"})
        path.write_text(json.dumps(bad))
        with pytest.raises(FailedPrecondition, match=r"buffer 'b': array 'field\.extra' of the checkpoint"):
            restore_checkpoint(tmp_path, other)
        bad = json.loads(json.dumps(manifest))
        bad["buffers"][0]["arrays"][0]["file"] = "../../outside.arrow"  # only the buffer's own files are read
        path.write_text(json.dumps(bad))
        with pytest.raises(FailedPrecondition, match=r"points to file '\.\./\.\./outside\.arrow', expected"):
            restore_checkpoint(tmp_path, other)
        # A manifest that does not list its buffers by name is refused by name, not with a KeyError at startup.
        for broken in ({k: v for k, v in manifest.items() if k != "buffers"},
                       {**manifest, "buffers": [{k: v for k, v in manifest["buffers"][0].items() if k != "name"}]}):
            path.write_text(json.dumps(broken))
            with pytest.raises(FailedPrecondition, match="does not list its buffers by name"):
                restore_checkpoint(tmp_path, other)
        path.write_text("[]")
        with pytest.raises(FailedPrecondition, match="holds a list, not an object"):
            restore_checkpoint(tmp_path, other)
        assert other.all() == []
    finally:
        registry.close()


def write_arrow(path: Path, name: str, values: np.ndarray) -> None:
    """Replaces a checkpoint's array file with `values` (one column named `name`, in their own dtype)."""
    array = pa.array(values)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, pa.schema([pa.field(name, array.type)])) as out:
        out.write_batch(pa.record_batch([array], names=[name]))


def test_an_array_file_of_the_wrong_length_type_or_content_is_refused_naming_it(tmp_path: Path) -> None:
    registry = BufferRegistry(new_instance())
    try:
        registry.add("b", EpisodicBuffer("b", registry.instance, FIELDS, 100))
        insert(registry.episodic("b"), [1, 2], 9)
        directory = write_checkpoint(registry, tmp_path).parent
    finally:
        registry.close()
    file = directory / "b" / "field.reward.arrow"
    with pa.memory_map(str(file)) as source:
        rewards = pa.ipc.open_file(source).read_all().column(0).to_numpy().copy()
    assert rewards.dtype == np.float32 and len(rewards) == 100
    other = BufferRegistry(new_instance())
    try:
        write_arrow(file, "field.reward", rewards[:50])  # a truncated file: its tail would restore as zeros
        with pytest.raises(FailedPrecondition, match=r"buffer 'b': array 'field\.reward': .* holds 50 values, "
                                                     r"expected 100"):
            restore_checkpoint(tmp_path, other)
        write_arrow(file, "field.reward", rewards.astype(np.float64))  # cast silently into float32 otherwise
        with pytest.raises(FailedPrecondition, match=r"array 'field\.reward': .*expected one column field\.reward: "
                                                     r"float"):
            restore_checkpoint(tmp_path, other)
        assert other.all() == []
        write_arrow(file, "field.reward", rewards)
        assert restored_episodes(tmp_path) == {"b": 2}
        starts_file = directory / "b" / "extent.start.arrow"
        with pa.memory_map(str(starts_file)) as source:
            starts = pa.ipc.open_file(source).read_all().column(0).to_numpy().copy()
        flipped = starts.copy()
        flipped[1] ^= 64  # one bit: the file is still valid Arrow of the right length and type
        write_arrow(starts_file, "extent.start", flipped)
        with pytest.raises(FailedPrecondition, match=r"buffer 'b': array 'extent\.start': .* CRC-32 is 0x[0-9a-f]{8}, "
                                                     r"the manifest's is 0x[0-9a-f]{8} \(the file was damaged\)"):
            restore_checkpoint(tmp_path, other)
        assert other.all() == [] and not segments(f"rpd_{other.instance}_")
        write_arrow(starts_file, "extent.start", starts)
        manifest_file = directory / MANIFEST
        manifest = json.loads(manifest_file.read_text())
        del manifest["buffers"][0]["arrays"][0]["crc32"]
        manifest_file.write_text(json.dumps(manifest))
        with pytest.raises(FailedPrecondition, match=r"buffer 'b': array '.*' has no CRC-32 in the manifest"):
            restore_checkpoint(tmp_path, other)
    finally:
        other.close()


def test_restore_error_over_grpc_startup(tmp_path: Path) -> None:
    (tmp_path / "ckpt-000001").mkdir()
    server = ReplayServer("127.0.0.1:0", instance=new_instance(), restore_from=str(tmp_path))
    with pytest.raises(FailedPrecondition, match="no complete checkpoint"):
        server.start()
    assert server.registry.all() == []


FIELDS = (Field("obs", "float32", (3,), True), Field("action", "int64", (), False),
          Field("reward", "float32", (), False))


def insert(buffer: EpisodicBuffer, ids: list[int], length: int, width: int = 3) -> None:
    """Whole episodes whose obs[:, 0] is the episode id (so a torn row would show)."""
    rows = length + 1
    obs = np.zeros((rows * len(ids), width), np.float32)
    obs[:, 0] = np.repeat(np.asarray(ids, np.float32), rows)
    columns = {"obs": obs, "action": np.zeros(rows * len(ids), np.int64),
               "reward": np.ones(rows * len(ids), np.float32)}
    buffer.insert(columns, Spans.whole_episodes(np.full(len(ids), length), np.asarray(ids, np.uint64),
                                                np.ones(len(ids), bool)))


def test_sampling_is_served_while_a_checkpoint_is_written(tmp_path: Path) -> None:
    fields = (Field("obs", "float32", (64,), True), Field("action", "int64", (), False),
              Field("reward", "float32", (), False))
    registry = BufferRegistry(new_instance())
    try:
        buffer = EpisodicBuffer("big", registry.instance, fields, 40_000)
        registry.add("big", buffer)
        for start in range(0, 200, 50):
            insert(buffer, list(range(start + 1, start + 51)), 99, width=64)  # 20,000 rows, 5 MB
        episodes = buffer.episodes
        sampled = threading.Event()
        stop = threading.Event()
        served = [0]

        def sample() -> None:
            rng = np.random.default_rng(0)
            while not stop.is_set():
                buffer.sample(32, TransitionsMode(1, 0.99), rng)
                served[0] += 1
                sampled.set()

        waited: list[bool] = []

        def on_chunk() -> None:
            # Between chunks the lock is free: a sample gets through, and an insert (that evicts nothing).
            sampled.clear()
            waited.append(sampled.wait(timeout=10))
            if len(waited) == 1:
                insert(buffer, [1000], 5, width=64)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            manifest = write_checkpoint(registry, tmp_path, chunk_bytes=2**18, on_chunk=on_chunk)
        finally:
            stop.set()
            sampler.join()
        assert len(waited) >= 15 and all(waited), waited  # 256 kB chunks of 5 MB of rows (fits a 64 MB /dev/shm)
        entry = json.loads(manifest.read_text())["buffers"][0]
        assert entry["snapshot_attempts"] == 1
        other = BufferRegistry(new_instance())
        try:
            restore_checkpoint(tmp_path, other)
            assert other.episodic("big").episodes == episodes  # the snapshot: before the insert in between
            assert buffer.episodes == episodes + 1
        finally:
            other.close()
    finally:
        registry.close()


@pytest.mark.parametrize("turns", [1, 2])
def test_snapshot_stays_consistent_when_the_ring_turns_over(tmp_path: Path, turns: int) -> None:
    registry = BufferRegistry(new_instance())
    try:
        buffer = EpisodicBuffer("b", registry.instance, FIELDS, 2000)
        registry.add("b", buffer)
        insert(buffer, list(range(1, 21)), 99)
        next_id = itertools.count(100)

        def on_chunk() -> None:
            nonlocal turns
            if turns:  # a whole turn of the ring between two chunks of this attempt
                turns -= 1
                insert(buffer, [next(next_id) for _ in range(20)], 99)

        expected_attempts = turns + 1
        manifest = write_checkpoint(registry, tmp_path, chunk_bytes=32 * 100, on_chunk=on_chunk)
        assert json.loads(manifest.read_text())["buffers"][0]["snapshot_attempts"] == expected_attempts
        other = BufferRegistry(new_instance())
        try:
            restore_checkpoint(tmp_path, other)
            restored = other.episodic("b")
            mode = TransitionsMode(1, 0.99)
            for seed in range(3):
                a = buffer.sample(64, mode, np.random.default_rng(seed), include_keys=True)
                b = restored.sample(64, mode, np.random.default_rng(seed), include_keys=True)
                assert_same_batches([a], [b])
                np.testing.assert_array_equal(b["obs"][:, 0], b["episode_id"].astype(np.float32))
        finally:
            other.close()
    finally:
        registry.close()


def test_periodic_checkpoints(tmp_path: Path) -> None:
    with ReplayServer("127.0.0.1:0", instance=new_instance(), checkpoint_dir=str(tmp_path), checkpoint_every=0.05,
                      checkpoint_keep=2) as server, ReplayClient(server.address, timeout=20) as client:
        client.create_buffer("b", 100, SCHEMA)
        deadline = time.monotonic() + 20
        while len([p for p in tmp_path.iterdir() if p.name.startswith("ckpt-")]) < 2 or \
                not any(entry["name"] == "b" for entry in
                        json.loads((latest_checkpoint(tmp_path) / MANIFEST).read_text())["buffers"]):
            assert time.monotonic() < deadline, os.listdir(tmp_path)
            time.sleep(0.01)
        # The RPC without a directory writes to the server's --checkpoint-dir.
        assert Path(client.checkpoint()).parent.parent == tmp_path
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("ckpt-")]) <= 3


@pytest.mark.parametrize(("every", "has_dir"), [(0, True), (-1.0, True), (5.0, False), (float("nan"), True),
                                               (float("inf"), True), (1e10, True)])
def test_periodic_checkpoints_need_a_positive_period_and_a_directory(tmp_path: Path, every: float,
                                                                    has_dir: bool) -> None:
    """A period of 0 (or NaN) would write checkpoints back to back for as long as the server runs; one longer
    than a wait can take (inf) ended the checkpoint thread with an OverflowError."""
    with pytest.raises(ValueError, match=r"checkpoint_every: expected seconds > 0 \(at most 9223372036\) and a "
                                         rf"checkpoint_dir, got {every!r}"):
        ReplayServer("127.0.0.1:0", instance=new_instance(), checkpoint_dir=str(tmp_path) if has_dir else None,
                     checkpoint_every=every).stop(grace=0)  # the stop runs only if it was wrongly accepted
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_rpc_needs_a_checkpoint_dir(client: ReplayClient, tmp_path: Path) -> None:
    """Without one the server has nowhere a client may make it write."""
    code, details = rpc_status(client.checkpoint)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "the server has no --checkpoint-dir" in details
    code, _ = rpc_status(client.checkpoint, str(tmp_path))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("directory", ["/tmp/elsewhere", "../up", "..", ".", "a/b", "-x", "a\0b", "x" * 65])
def test_checkpoint_rpc_writes_only_under_the_checkpoint_dir(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                           monkeypatch: pytest.MonkeyPatch, directory: str) -> None:
    """The Checkpoint RPC writes only under the server's --checkpoint-dir: a path of the client's choosing would
    be written with the server's rights (a LATEST file there replaced)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))  # should the check fail, relative paths land in a temp dir
    root = tmp_path / "checkpoints"
    with ReplayServer("127.0.0.1:0", instance=new_instance(), checkpoint_dir=str(root)) as server, \
            ReplayClient(server.address, timeout=20) as client:
        code, details = rpc_status(client.checkpoint, directory)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("checkpoint.directory: expected empty or the name of a subdirectory")
        assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["checkpoints"])
        assert Path(client.checkpoint("run-1.a")).parent.parent == root / "run-1.a"


def test_a_buffer_deleted_during_a_checkpoint_is_left_out_and_the_rest_is_saved(tmp_path: Path) -> None:
    registry = BufferRegistry(new_instance())
    try:
        for name in ("a", "b"):
            registry.add(name, EpisodicBuffer(name, registry.instance, FIELDS, 1000))
            insert(registry.episodic(name), list(range(1, 21)), 9)

        def delete_b() -> None:  # a DeleteBuffer RPC while "a" is being written
            if "b" in registry:
                registry.delete("b")

        manifest = write_checkpoint(registry, tmp_path, chunk_bytes=32 * 40, on_chunk=delete_b)
        assert [entry["name"] for entry in json.loads(manifest.read_text())["buffers"]] == ["a"]
        assert not (manifest.parent / "b").exists()
        assert restored_episodes(tmp_path) == {"a": 20}
    finally:
        registry.close()


def test_a_checkpoint_the_server_stopped_under_is_discarded(tmp_path: Path) -> None:
    """A Checkpoint call still writing when the server stops: the stop unlinks every buffer under it. It
    left them all out and published an empty checkpoint as LATEST (a --restore then started empty)."""
    registry = BufferRegistry(new_instance())
    try:
        for name in ("a", "b"):
            registry.add(name, EpisodicBuffer(name, registry.instance, FIELDS, 1000))
            insert(registry.episodic(name), list(range(1, 21)), 9)
        first = write_checkpoint(registry, tmp_path)

        def stop() -> None:  # the server stops while "a" is being written
            if not registry.closed:
                registry.close()

        with pytest.raises(Unavailable, match="server stopped while it was being written"):
            write_checkpoint(registry, tmp_path, chunk_bytes=32 * 40, on_chunk=stop)
        assert latest_checkpoint(tmp_path) == first.parent
        assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, first.parent.name]
        assert restored_episodes(tmp_path) == {"a": 20, "b": 20}
    finally:
        registry.close()


def test_recovery_without_a_checkpoint_yet_serves_what_it_recovered(tmp_path: Path) -> None:
    """Killed before its first periodic checkpoint: the buffers recovery refuses are lost, the rest served."""
    instance = new_instance()
    kept = EpisodicBuffer("kept", instance, FIELDS, 1000)
    insert(kept, [1, 2], 9)
    kept.close(unlink=False)  # the process dies: its segments stay
    for name in ("junk", "orphan.data"):  # fails the checks; a data segment whose header was never made
        shared_memory.SharedMemory(name=f"rpd_{instance}_{name}", create=True, size=64).close()
    server = ReplayServer("127.0.0.1:0", instance=instance, recover=True, checkpoint_dir=str(tmp_path / "none"))
    try:
        server.start()
        assert [name for name, _ in server.registry.all()] == ["kept"]
        assert server.registry.episodic("kept").episodes == 2
        assert segments(f"rpd_{instance}_") == [f"rpd_{instance}_kept", f"rpd_{instance}_kept.data"]
    finally:
        server.stop(grace=0)
        for name in segments(f"rpd_{instance}_"):
            os.unlink(f"/dev/shm/{name}")


def test_a_server_that_cannot_start_its_http_side_unlinks_what_it_restored(tmp_path: Path) -> None:
    registry = BufferRegistry(new_instance())
    registry.add("r", EpisodicBuffer("r", registry.instance, FIELDS, 1000))
    insert(registry.episodic("r"), [1, 2], 9)
    write_checkpoint(registry, tmp_path)
    registry.close()
    instance = new_instance()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = ReplayServer("127.0.0.1:0", instance=instance, restore_from=str(tmp_path),
                              http_address=f"127.0.0.1:{busy.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(OSError, match="the HTTP side could not serve"):
            server.start()
        assert time.monotonic() - started < 15  # not the 30 s start timeout
    assert segments(f"rpd_{instance}_") == []


def test_a_buffer_deleted_after_its_last_chunk_is_saved_whole(tmp_path: Path) -> None:
    """A delete landing after a buffer's last chunk is copied: the snapshot is complete, so it is saved with
    every array in its manifest entry (an entry without arrays would make the whole checkpoint unrestorable)."""
    registry = BufferRegistry(new_instance())
    try:
        registry.add("b", EpisodicBuffer("b", registry.instance, FIELDS, 64))
        insert(registry.episodic("b"), [1, 2, 3], 9)
        row_bytes = registry.episodic("b").row_bytes
        chunks = []

        def delete_after_the_last_chunk() -> None:
            chunks.append(1)
            if len(chunks) == 4:  # 64 rows in chunks of 16
                registry.delete("b")

        manifest = write_checkpoint(registry, tmp_path, chunk_bytes=16 * row_bytes,
                                    on_chunk=delete_after_the_last_chunk)
        assert len(chunks) == 4 and "b" not in registry
        assert restored_episodes(manifest.parent) == {"b": 3}
    finally:
        registry.close()


def test_a_failed_write_of_latest_leaves_it_naming_the_previous_checkpoint(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    registry = BufferRegistry(new_instance())
    try:
        registry.add("b", EpisodicBuffer("b", registry.instance, FIELDS, 100))
        insert(registry.episodic("b"), [1], 9)
        first = write_checkpoint(registry, tmp_path).parent
        insert(registry.episodic("b"), [2], 9)
        rename = os.rename

        def crash_before_latest_is_replaced(src, dst) -> None:  # the process dies while LATEST is written
            if Path(dst).name == LATEST:
                raise OSError("injected: died while writing LATEST")
            rename(src, dst)

        monkeypatch.setattr(os, "rename", crash_before_latest_is_replaced)
        with pytest.raises(OSError, match="died while writing LATEST"):
            write_checkpoint(registry, tmp_path)
        monkeypatch.undo()
        assert (tmp_path / LATEST).read_text() == f"{first.name}\n"
        assert latest_checkpoint(tmp_path) == first
        assert restored_episodes(tmp_path) == {"b": 1}
    finally:
        registry.close()


def test_a_checkpoint_gets_its_final_name_only_once_complete(tmp_path: Path) -> None:
    """While a checkpoint is written, no ckpt-N directory names it (a reader, or `keep`, would take a
    half-written one for a checkpoint)."""
    registry = BufferRegistry(new_instance())
    try:
        registry.add("b", EpisodicBuffer("b", registry.instance, FIELDS, 64))
        insert(registry.episodic("b"), [1, 2, 3], 9)
        seen: list[list[str]] = []

        def look() -> None:
            seen.append(sorted(p.name for p in tmp_path.iterdir() if re.fullmatch(r"ckpt-\d+", p.name)))

        manifest = write_checkpoint(registry, tmp_path, chunk_bytes=16 * registry.episodic("b").row_bytes,
                                    on_chunk=look)
        assert seen == [[]] * 4  # 64 rows in chunks of 16
        assert manifest.parent.name == "ckpt-000001" and manifest.is_file()
    finally:
        registry.close()


def test_a_whole_episode_retried_after_a_restore_is_stored_once(tmp_path: Path) -> None:
    registry = BufferRegistry(new_instance())
    try:
        buffer = EpisodicBuffer("b", registry.instance, FIELDS, 100)
        registry.add("b", buffer)
        rows = 10
        obs = np.zeros((rows, 3), np.float32)
        obs[:, 0] = 42
        columns = {"obs": obs, "action": np.zeros(rows, np.int64), "reward": np.ones(rows, np.float32)}
        spans = replace(Spans.whole_episodes(np.array([rows - 1]), np.array([42], np.uint64), np.ones(1, bool)),
                        offsets=np.zeros(1, np.int64))  # named (episode 42, offset 0), as clients send them
        assert buffer.insert_result(columns, spans).duplicate_spans == 0
        write_checkpoint(registry, tmp_path)
    finally:
        registry.close()
    other = BufferRegistry(new_instance())
    try:
        restore_checkpoint(tmp_path, other)
        restored = other.episodic("b")
        result = restored.insert_result(columns, spans)  # the client retries: its response was lost
        assert (result.completed, result.duplicate_spans) == (1, 1)
        assert restored.episodes == 1 and restored.stored_steps == rows
    finally:
        other.close()
