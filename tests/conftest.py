"""Shared fixtures: an in-process server on a free port, and a check that no shared memory leaks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from client import ReplayClient
from service.grpc_server.server import ReplayServer


def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("rpd_")}


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
    replay_server = ReplayServer("127.0.0.1:0", max_message_bytes=64 * 2**20).start()
    yield replay_server
    replay_server.stop(grace=0)


@pytest.fixture
def client(server: ReplayServer) -> Iterator[ReplayClient]:
    with ReplayClient(server.address, timeout=20) as replay_client:
        yield replay_client
