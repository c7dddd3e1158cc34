"""An EpisodeWriter over shards, step by step against fake shard clients: a shard failing mid-episode, spans in doubt
held for their shard until it is back, new episodes on the shards up, old failures of a shard that came back, and
the shards a name resolves to as its records change."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from replayd.client import EpisodeWriter
from replayd.client.polling import wait_until
from replayd.client.shard_set import Shard, ShardError, ShardSet
from replayd.client.shard_sink import ShardedSink


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


class Comeback:
    """What ready_future() returns: resolved by the test when the shard is "back"."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[Any], None]] = []
        self._cancelled = False

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._callbacks.append(callback)

    def cancel(self) -> bool:
        self._cancelled = True
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def resolve(self) -> None:
        for callback in self._callbacks:
            callback(self)


class FakeShardClient:
    """Records the spans of each insert as (episode_id, offset, rows, begins, ends); fails while `fail` is set."""

    max_request_bytes = 2**20

    def __init__(self) -> None:
        self.stored: list[tuple[int, int, int, bool, bool]] = []
        self.fail = False
        self.comeback = Comeback()

    def insert(self, frames: list) -> None:
        if self.fail:
            raise Unavailable()
        for frame in frames:
            request = frame.request
            self.stored += zip(request.episode_ids, request.span_offsets, request.span_rows, request.begins,
                               request.ends, strict=True)

    def ready_future(self) -> Comeback:
        self.comeback = Comeback()
        return self.comeback

    def close(self) -> None:
        return None


class FakeShardedClient:
    """What EpisodeWriter asks a client for: the buffer's fields and a span sink."""

    def __init__(self, sink: ShardedSink) -> None:
        self.sink = sink

    def describe(self, buffer: str) -> dict[str, Any]:
        return {"fields": {"obs": ("float32", (2,), True), "reward": ("float32", (), False)}, "frames": {}}

    def span_sink(self, buffer: str) -> ShardedSink:
        return self.sink


def run_all(calls: list[Callable[[], Any]]) -> list[Any]:
    results = []
    for call in calls:
        try:
            results.append(call())
        except Exception as exc:
            results.append(exc)
    return results


@pytest.fixture(autouse=True)
def no_hold_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake shards come back when a test resolves their comeback (the hold-down has its own test)."""
    monkeypatch.setattr("replayd.client.shard_set._HOLD_DOWN", 0.0)


@pytest.fixture
def shards() -> ShardSet:
    return ShardSet(["a:1", "b:1"], lambda address: FakeShardClient(), 30.0, CollectorRegistry())


def writer_over(shards: ShardSet, registry: CollectorRegistry, **options: Any) -> EpisodeWriter:
    """A writer whose new episodes go to the first shard up."""

    def first_up(episode_id: int) -> Shard:
        return shards.up()[0]

    sink = ShardedSink("b", shards, first_up, run_all, ShardedSink.stranded_counter(registry))
    return EpisodeWriter(FakeShardedClient(sink), "b", **options)


def steps(writer: EpisodeWriter, count: int) -> None:
    for t in range(count):
        writer.append(obs=np.array([0, t], np.float32), reward=1.0)


def test_an_open_episode_whose_shard_fails_goes_on_as_a_new_episode_elsewhere(shards: ShardSet) -> None:
    registry = CollectorRegistry()
    writer = writer_over(shards, registry, chunk_rows=4)
    a, b = shards.members()
    steps(writer, 4)  # a chunk: to shard a
    first = a.client.stored[0][0]
    a.client.fail = True
    steps(writer, 4)  # the next chunk fails there: in doubt, held for a
    assert not a.up and a.client.stored == [(first, 0, 4, True, False)]
    steps(writer, 2)
    writer.end_episode(True, obs=np.zeros(2, np.float32))
    writer.flush()
    (second, offset, rows, begins, ends), = b.client.stored  # the unsent steps and the end, as a new episode
    assert second != first and (offset, rows, begins, ends) == (0, 3, True, True)
    assert registry.get_sample_value("replayd_client_stranded_episodes_total", {"shard": "a:1"}) == 1
    with pytest.raises(ShardError, match=r"rows held for shards that are down .*'a:1': 4"):
        writer.close()
    a.client.fail = False
    a.client.comeback.resolve()
    writer.close()
    assert a.up and a.client.stored == [(first, 0, 4, True, False), (first, 4, 4, False, False)]
    assert len(b.client.stored) == 1


def test_an_open_episode_with_nothing_unsent_but_its_end_ends_on_its_shard(shards: ShardSet) -> None:
    writer = writer_over(shards, CollectorRegistry(), chunk_rows=4)
    a, b = shards.members()
    steps(writer, 4)
    a.client.fail = True
    steps(writer, 4)  # held for a; every step is sent, none is left for a new episode
    writer.end_episode(True, obs=np.zeros(2, np.float32))
    writer.flush()
    assert b.client.stored == []
    a.client.fail = False
    a.client.comeback.resolve()
    writer.close()
    episode = a.client.stored[0][0]
    assert a.client.stored == [(episode, 0, 4, True, False), (episode, 4, 4, False, False),
                               (episode, 8, 1, False, True)]


def test_whole_episodes_in_doubt_wait_for_their_shard_while_new_ones_go_to_the_others(shards: ShardSet) -> None:
    writer = writer_over(shards, CollectorRegistry(), auto_flush=False)
    a, b = shards.members()
    for _ in range(2):
        steps(writer, 3)
        writer.end_episode(True, obs=np.zeros(2, np.float32))
    a.client.fail = True
    writer.flush()  # in doubt on a: held for a, never sent elsewhere
    assert not a.up and writer.pending_rows == 0 and b.client.stored == []
    steps(writer, 3)
    writer.end_episode(False, obs=np.zeros(2, np.float32))
    writer.flush()
    assert [span[1:] for span in b.client.stored] == [(0, 4, True, True)]
    a.client.fail = False
    a.client.comeback.resolve()
    steps(writer, 3)
    writer.end_episode(False, obs=np.zeros(2, np.float32))
    writer.flush()  # the next flush delivers what a shard that is back waits for, before its own spans
    assert [span[1:] for span in a.client.stored] == [(0, 4, True, True)] * 3
    assert {span[0] for span in a.client.stored}.isdisjoint(span[0] for span in b.client.stored)
    writer.close()


def test_a_failure_from_before_a_shard_came_back_leaves_it_up(shards: ShardSet) -> None:
    a = shards.members()[0]
    life = a.life
    shards.failed(a, "connection reset")
    a.client.comeback.resolve()
    assert a.up and a.life == life + 1
    shards.failed(a, "a call of its earlier life", life)
    assert a.up


def test_a_comeback_seen_as_the_shard_fails_is_looked_at_again_after_the_hold_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A call failed on a connection that the server's death had broken while the channel still read READY: its
    ready future resolved at once, the shard "answered again", and the next call found it down a second time."""
    monkeypatch.setattr("replayd.client.shard_set._HOLD_DOWN", 0.3)
    shards = ShardSet(["a:1", "b:1"], lambda address: FakeShardClient(), 30.0, CollectorRegistry())
    a = shards.members()[0]
    shards.failed(a, "connection reset")
    stale = a.client.comeback
    stale.resolve()  # the channel still read READY
    assert not a.up
    wait_until(lambda: a.client.comeback is not stale, time.monotonic() + 30, "the shard watched again")
    assert not a.up
    a.client.comeback.resolve()  # connected again, past the hold-down
    assert a.up and a.life == 1
    shards.close()


def test_a_name_resolved_again_adds_and_drops_shards_and_a_shard_listed_again_keeps_its_index(
        monkeypatch: pytest.MonkeyPatch) -> None:
    records = [["10.0.0.1:5", "10.0.0.2:5"], ["10.0.0.2:5", "10.0.0.3:5"], ["10.0.0.1:5", "10.0.0.3:5"]]
    monkeypatch.setattr("replayd.client.shard_set.resolve", lambda target: records[0])
    shards = ShardSet("replayd:5", lambda address: FakeShardClient(), 1e-9, CollectorRegistry())  # due at every look
    assert [(s.index, s.address) for s in shards.members()] == [(0, "10.0.0.1:5"), (1, "10.0.0.2:5")]
    generation = shards.generation
    records.pop(0)
    assert [(s.index, s.address) for s in shards.members()] == [(1, "10.0.0.2:5"), (2, "10.0.0.3:5")]
    assert shards.generation > generation and shards.by_index(0).address == "10.0.0.1:5"  # its keys still route
    records.pop(0)
    assert [(s.index, s.address) for s in shards.members()] == [(0, "10.0.0.1:5"), (2, "10.0.0.3:5")]


def test_a_shard_whose_record_left_the_name_while_down_is_listed_again_as_soon_as_it_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped container's record leaves the service name, and the failure's resolution dropped the shard; it
    came back with its record, but only the next resolution (30 s later by default) listed it again."""
    records = ["10.0.0.1:5", "10.0.0.2:5"]
    monkeypatch.setattr("replayd.client.shard_set.resolve", lambda target: list(records))
    monkeypatch.setattr("replayd.client.shard_set._RESOLVE_AFTER_FAILURE", 0.0)
    shards = ShardSet("replayd:5", lambda address: FakeShardClient(), 3600.0, CollectorRegistry())
    victim = shards.members()[1]
    records.remove("10.0.0.2:5")
    shards.failed(victim, "connection reset")
    assert [s.address for s in shards.members()] == ["10.0.0.1:5"]
    records.append("10.0.0.2:5")
    victim.client.comeback.resolve()
    assert [(s.index, s.address, s.up) for s in shards.up()] == [(0, "10.0.0.1:5", True), (1, "10.0.0.2:5", True)]


def test_a_name_that_stops_resolving_keeps_the_shards_known(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("replayd.client.shard_set.resolve", lambda target: ["10.0.0.1:5"])
    shards = ShardSet("replayd:5", lambda address: FakeShardClient(), 1e-9, CollectorRegistry())

    def fails(target: str) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr("replayd.client.shard_set.resolve", fails)
    assert [s.address for s in shards.members()] == ["10.0.0.1:5"]


def test_a_resolver_function_lists_the_shards_asked_again_at_its_interval_and_after_a_failure() -> None:
    """What the Ray launcher's clients use (client/ray/resolver.py): a function that returns the addresses now."""
    listed = [["127.0.0.1:5", "127.0.0.1:6"]]
    asked = []

    def resolver() -> list[str]:
        asked.append(1)
        if isinstance(listed[0], OSError):
            raise listed[0]
        return listed[0]

    shards = ShardSet(resolver, lambda address: FakeShardClient(), 3600.0, CollectorRegistry())
    assert [(s.index, s.address) for s in shards.members()] == [(0, "127.0.0.1:5"), (1, "127.0.0.1:6")]
    assert len(asked) == 1  # not due again for an hour
    listed[0] = ["127.0.0.1:5", "127.0.0.1:7"]  # shard 1 restarted elsewhere
    shards._resolved_at -= 2  # the last answer is older than a failure's wait for the next (1 s)
    shards.failed(shards.members()[1], "connection refused")
    assert [(s.index, s.address) for s in shards.members()] == [(0, "127.0.0.1:5"), (2, "127.0.0.1:7")]
    assert shards.by_index(1).address == "127.0.0.1:6" and not shards.by_index(1).up
    listed[0] = OSError("the launcher cannot tell now")
    shards._resolved_at -= 2
    shards.failed(shards.members()[0], "connection refused")
    assert [s.address for s in shards.members()] == ["127.0.0.1:5", "127.0.0.1:7"]  # the shards known stay


def test_a_shard_that_moves_keeps_its_index_and_gets_the_spans_held_for_it_at_its_new_address() -> None:
    """A resolver that names its shards (the Ray launcher's, by shard index): a shard restarted at another address
    is the same shard; what a writer holds for it in doubt goes to its new life (which acknowledges what its
    checkpoint holds, and stores the rest)."""
    listed = [{"0": "127.0.0.1:5", "1": "127.0.0.1:6"}]
    clients: dict[str, FakeShardClient] = {}

    def connect(address: str) -> FakeShardClient:
        clients[address] = FakeShardClient()
        return clients[address]

    shards = ShardSet(lambda: listed[0], connect, 3600.0, CollectorRegistry())
    writer = writer_over(shards, CollectorRegistry(), auto_flush=False)
    a, b = shards.members()
    steps(writer, 3)
    writer.end_episode(True, obs=np.zeros(2, np.float32))
    a.client.fail = True
    writer.flush()  # in doubt on shard 0, whose node goes away
    assert not a.up and clients["127.0.0.1:5"].stored == []
    listed[0] = {"0": "127.0.0.1:7", "1": "127.0.0.1:6"}  # Ray restarted shard 0 elsewhere
    shards._resolved_at -= 3600
    assert shards.members() == [a, b] and (a.index, a.address) == (0, "127.0.0.1:7") and not a.up
    generation = shards.generation
    clients["127.0.0.1:7"].comeback.resolve()  # it answers at its new address
    assert a.up and shards.generation > generation
    writer.close()
    assert [span[1:] for span in clients["127.0.0.1:7"].stored] == [(0, 4, True, True)]
    assert clients["127.0.0.1:5"].stored == [] and b.client.stored == []
