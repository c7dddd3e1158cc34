"""A server killed with SIGKILL leaves its segments; the next server of that instance reports them."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from replayd.client import ReplayClient
from replayd.server.buffers.episodic import EpisodicBuffer
from replayd.server.cli import main as cli_main
from replayd.server.schema import Field
from replayd.server.server import ReplayServer
from replayd.server.storage.instance_lock import InstanceLock, lock_path
from replayd.server.storage.shared_arrays import segments
from replayd.wire.errors import FailedPrecondition, InvalidArgument
from tests.conftest import TEST_INSTANCE, free_port


def _start(port: int, instance: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "replayd.server.cli", "serve", "--port", str(port), "--instance",
                             instance, "--http-port", "-1", "--log-level", "WARNING", *extra],
                            stdout=subprocess.PIPE, text=True)


def test_stale_segments_are_reported_and_removed() -> None:
    instance = f"{TEST_INSTANCE}stale"
    port = free_port()
    crashed = _start(port, instance)
    try:
        with ReplayClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=60)
            client.create_buffer("b", 100, {"obs": ("float32", (2,)), "reward": ("float32", ())})
        os.kill(crashed.pid, signal.SIGKILL)
        crashed.wait(timeout=30)
        assert segments(f"rpd_{instance}_") == [f"rpd_{instance}_b", f"rpd_{instance}_b.data"]

        port = free_port()
        second = _start(port, instance)
        try:
            with ReplayClient(f"127.0.0.1:{port}") as client:
                client.wait_ready(timeout=60)
                with pytest.raises(grpc.RpcError) as error:
                    client.create_buffer("b", 100, {"obs": ("float32", (2,)), "reward": ("float32", ())})
                assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "already exists" in error.value.details() and "--remove" in error.value.details()
        finally:
            second.terminate()
            out, _ = second.communicate(timeout=30)
        assert "survive a previous server" in out and f"rpd_{instance}_b" in out

        port = free_port()
        third = _start(port, instance, "--remove-stale")
        try:
            with ReplayClient(f"127.0.0.1:{port}") as client:
                client.wait_ready(timeout=60)
                client.create_buffer("b", 100, {"obs": ("float32", (2,)), "reward": ("float32", ())})
                client.insert_episode("b", True, obs=np.zeros((3, 2), np.float32), reward=np.ones(2, np.float32))
        finally:
            third.terminate()
            out, _ = third.communicate(timeout=30)
        assert "removed 2 stale" in out
        assert segments(f"rpd_{instance}_") == []  # the third server unlinked its buffer on exit
    finally:
        for name in segments(f"rpd_{instance}_"):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("instance", ["a_b", "x y", "rpd/../x", "a" * 33])
def test_instance_names_cannot_overlap_another_instances_segment_prefix(instance: str) -> None:
    """rpd_<instance>_<buffer>: with an underscore, instance "a_b" would own instance "a"'s buffer "b_c"
    (recovery and --remove-stale act on every segment of the prefix)."""
    # The stop and the close run only if the name was wrongly accepted: nothing it built outlives the test.
    with pytest.raises(InvalidArgument, match=f"instance name '{re.escape(instance)}' must match"):
        ReplayServer("127.0.0.1:0", instance=instance).stop(grace=0)
    with pytest.raises(InvalidArgument, match=f"instance name '{re.escape(instance)}' must match"):
        EpisodicBuffer("b_c", instance, [Field("obs", "float32", (2,), observation=True)], 8).close()
    assert not segments(f"rpd_{instance}")
    assert not os.path.exists(lock_path(instance))


def test_a_running_servers_instance_cannot_be_taken_nor_its_segments_removed() -> None:
    """A second server under a live server's --instance would take its segments for a crashed server's:
    it is refused, and `replayd segments --remove` keeps a running instance's segments."""
    instance = f"{TEST_INSTANCE}live"
    first = ReplayServer("127.0.0.1:0", instance=instance).start()
    try:
        with ReplayClient(first.address) as client:
            client.create_buffer("b", 100, {"obs": ("float32", (2,)), "reward": ("float32", ())})
        with pytest.raises(FailedPrecondition, match=f"instance '{instance}' is served by another running process"):
            ReplayServer("127.0.0.1:0", instance=instance)
        port = free_port()
        refused = subprocess.run([sys.executable, "-m", "replayd.server.cli", "serve", "--port", str(port),
                                  "--instance", instance, "--http-port", "-1", "--remove-stale"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "served by another running process" in refused.stderr
        listed = subprocess.run([sys.executable, "-m", "replayd.server.cli", "segments", "--instance", instance,
                                 "--remove"],
                                capture_output=True, text=True, timeout=60, check=True)
        assert "in use" in listed.stdout and "removed 0 segment(s)" in listed.stdout
        assert segments(f"rpd_{instance}_") == [f"rpd_{instance}_b", f"rpd_{instance}_b.data"]
        with ReplayClient(first.address) as client:
            client.insert_episode("b", True, obs=np.zeros((3, 2), np.float32), reward=np.ones(2, np.float32))
    finally:
        first.stop(grace=0)
    assert not os.path.exists(lock_path(instance))
    ReplayServer("127.0.0.1:0", instance=instance).start().stop(grace=0)  # free again once it stopped


def test_a_server_starting_while_segments_are_listed_waits_for_the_lock() -> None:
    """`replayd segments` holds each instance's lock for a moment while it looks: a server starting under
    that instance then waits for it instead of being refused as if the instance were served."""
    instance = f"{TEST_INSTANCE}probe"
    probe = InstanceLock(instance)
    releaser = threading.Timer(0.2, probe.release)
    releaser.start()
    try:
        ReplayServer("127.0.0.1:0", instance=instance).start().stop(grace=0)
    finally:
        releaser.join()


def test_a_lock_file_replaced_while_it_was_being_locked_is_locked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The previous holder unlinks the lock file as it releases it: a server that opened the old file just
    before then locks a file nobody else will ever open, while a third process creates and locks the new
    one; both would serve the instance. The lock must notice the file changed and lock the new one."""
    instance = f"{TEST_INSTANCE}swap"
    path = lock_path(instance)
    real_flock = fcntl.flock
    replaced = []

    def flock_after_the_file_was_replaced(fd: int, operation: int) -> None:
        if not replaced:  # first attempt: between our open and our flock, the file is replaced
            os.unlink(path)
            replaced.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_file_was_replaced)
    lock = InstanceLock(instance)
    try:
        monkeypatch.undo()
        assert lock._fd is not None and os.fstat(lock._fd).st_ino == os.stat(path).st_ino
        with pytest.raises(FailedPrecondition, match=f"instance '{instance}' is served by another running process"):
            InstanceLock(instance, wait_seconds=0).release()  # the release runs only if the lock was not held
    finally:
        lock.release()
        os.close(replaced[0])
    assert not os.path.exists(path)


def test_listing_no_segments_says_so(capsys: pytest.CaptureFixture) -> None:
    """An empty listing printed nothing: a user could not tell it from a command that did not run."""
    cli_main(["segments", "--instance", f"{TEST_INSTANCE}none"])
    assert capsys.readouterr().out == f"no replayd segments in /dev/shm for instance {TEST_INSTANCE}none\n"
