"""Shared fixtures: an in-process server on a free port, and a check that no shared memory leaks.

Every segment a test creates is named rpd_test<pid>... (and every instance lock replayd-test<pid>...), so
the leak check ignores other processes
(a benchmark or a second test run) working on the same machine.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator

import grpc
import pytest

from replayd.client import ReplayClient
from replayd.server.server import ReplayServer

TEST_INSTANCE = f"test{os.getpid()}"
_servers = itertools.count()


def _segments() -> set[str]:
    """This run's segments and instance lock files (a stopped server leaves neither)."""
    return {name for name in os.listdir("/dev/shm")
            if name.startswith((f"rpd_{TEST_INSTANCE}", f"replayd-{TEST_INSTANCE}"))}


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = _segments()
    yield
    leaked = _segments() - before
    for name in leaked:  # clean up so one failure does not cascade, then fail
        os.unlink(f"/dev/shm/{name}")
    assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"


@pytest.fixture
def server() -> Iterator[ReplayServer]:
    instance = f"{TEST_INSTANCE}s{next(_servers)}"
    replay_server = ReplayServer("127.0.0.1:0", instance=instance, max_message_bytes=64 * 2**20).start()
    yield replay_server
    replay_server.stop(grace=0)


@pytest.fixture
def client(server: ReplayServer) -> Iterator[ReplayClient]:
    with ReplayClient(server.address, timeout=20) as replay_client:
        replay_client.wait_ready(timeout=60)  # connected before the test's first call, which may not be retried
        yield replay_client


def free_port() -> int:
    """A port nothing on 127.0.0.1 listens on now (for a server the test starts, or a client that finds none)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rpc_status(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    """(code, details) of the gRPC error that `call(*args, **kwargs)` must raise."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()
