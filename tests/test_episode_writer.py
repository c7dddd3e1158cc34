"""EpisodeWriter's bookkeeping: what is pending, when it goes out, and what survives a failed flush."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest

from replayd.client import EpisodeWriter, ReplayClient

SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}


class Unavailable(grpc.RpcError):
    """What an insert raises once the client's own retries gave up on a restarting server."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "injected: the server is restarting"


def unreachable_for_first_inserts(client: ReplayClient, monkeypatch: pytest.MonkeyPatch, count: int = 1) -> list[int]:
    """Makes the client's next `count` inserts fail with UNAVAILABLE without reaching the server; the
    returned list counts every insert attempted."""
    insert, calls = client.insert, []

    def flaky(requests, *args, **kwargs):
        calls.append(1)
        if len(calls) <= count:
            raise Unavailable()
        return insert(requests, *args, **kwargs)

    monkeypatch.setattr(client, "insert", flaky)
    return calls


def append_steps(writer: EpisodeWriter, count: int, first: float = 0.0) -> None:
    for t in range(count):
        writer.append(obs=np.full(4, first + t, np.float32), action=1, reward=1.0)


def test_a_flush_the_unreachable_server_fails_keeps_every_episode_for_the_next_flush(
        client: ReplayClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The case flush_with_retry exists for: episodes pending across a server restart are not dropped."""
    client.create_buffer("b", 1000, SCHEMA)
    writer = EpisodeWriter(client, "b", chunk_rows=4, batch_rows=10_000, auto_flush=False)
    calls = unreachable_for_first_inserts(client, monkeypatch)
    append_steps(writer, 3)
    writer.end_episode(terminated=True, obs=np.full(4, 3, np.float32))
    append_steps(writer, 5, first=100)  # an open episode: one chunk of 4 pending, one step unsent
    assert writer.pending_rows == 4 + 4
    with pytest.raises(grpc.RpcError) as failed:
        writer.flush()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "restarting" in failed.value.details()
    assert writer.pending_rows == 8 and client.describe("b")["stored_steps"] == 0
    writer.flush()
    assert len(calls) == 2 and writer.pending_rows == 0
    info = client.describe("b")
    assert info["episodes"] == 1 and info["counters"]["open_episodes"] == 1
    assert info["sampleable_steps"] == 3 + 3  # the open chunk's last step waits for its successor
    assert set(client.sample("b", 256, seed=0)["obs"][:, 0].tolist()) == {0, 1, 2, 100, 101, 102}


def test_a_chunk_of_an_open_episode_counts_as_pending_until_flushed(client: ReplayClient) -> None:
    client.create_buffer("b", 1000, SCHEMA)
    writer = EpisodeWriter(client, "b", chunk_rows=4, batch_rows=10_000, auto_flush=False)
    append_steps(writer, 3)
    assert writer.pending_rows == 0  # steps of the open episode are not a chunk yet
    append_steps(writer, 1, first=3)
    assert writer.pending_rows == 4
    append_steps(writer, 2, first=4)
    writer.end_episode(terminated=True, obs=np.full(4, 6, np.float32))
    assert writer.pending_rows == 4 + 3  # the episode's last two steps and its final observation
    assert client.describe("b")["stored_steps"] == 0
    writer.flush()
    assert writer.pending_rows == 0 and client.describe("b")["stored_steps"] == 7


def test_episodes_filling_exactly_batch_rows_are_sent_at_once(client: ReplayClient) -> None:
    client.create_buffer("b", 1000, SCHEMA)
    writer = EpisodeWriter(client, "b", batch_rows=8)
    append_steps(writer, 2)
    writer.end_episode(terminated=True, obs=np.full(4, 2, np.float32))
    assert writer.pending_rows == 3 and client.describe("b")["stored_steps"] == 0  # under batch_rows: waits
    append_steps(writer, 4, first=10)
    writer.end_episode(terminated=True, obs=np.full(4, 14, np.float32))  # 3 + 5 rows: exactly batch_rows
    assert writer.pending_rows == 0
    info = client.describe("b")
    assert info["episodes"] == 2 and info["sampleable_steps"] == 2 + 4


@pytest.mark.parametrize("steps", [2, 3])
def test_closing_with_an_open_episode_of_two_or_more_steps_makes_all_but_the_last_sampleable(
        client: ReplayClient, steps: int) -> None:
    client.create_buffer("b", 1000, SCHEMA)
    writer = EpisodeWriter(client, "b", batch_rows=10_000)
    append_steps(writer, steps)
    writer.close()
    info = client.describe("b")
    assert info["stored_steps"] == steps and info["sampleable_steps"] == steps - 1
    np.testing.assert_array_equal(np.unique(client.sample("b", 64, seed=0)["obs"][:, 0]), np.arange(steps - 1))


def test_closing_with_a_one_step_open_episode_sends_nothing(client: ReplayClient) -> None:
    """One step has no successor yet: nothing of it could be sampled, so it is not sent."""
    client.create_buffer("b", 1000, SCHEMA)
    writer = EpisodeWriter(client, "b", batch_rows=10_000)
    append_steps(writer, 1)
    writer.close()
    assert client.describe("b")["stored_steps"] == 0


def _evict_the_open_episode(client: ReplayClient, buffer: str) -> None:
    rng = np.random.default_rng(0)
    for _ in range(3):
        client.insert_episode(buffer, terminated=True, obs=rng.normal(size=(12, 4)).astype(np.float32),
                              action=rng.integers(0, 2, 11), reward=np.ones(11, np.float32))


@pytest.mark.parametrize("then", [
    pytest.param(lambda writer: writer.end_episode(terminated=True, obs=np.zeros(4, np.float32)), id="end_episode"),
    pytest.param(lambda writer: writer.end_episode(terminated=False, obs=np.zeros(4, np.float32)), id="truncation"),
])
def test_ending_an_episode_right_after_its_chunk_was_refused_stores_nothing_and_goes_on(
        client: ReplayClient, then: Callable[[EpisodeWriter], None]) -> None:
    """The refused chunk took every step of the open episode: the actor's end_episode that follows has
    nothing to store, and must not raise "no steps" (the actor did append steps)."""
    client.create_buffer("r", 40, SCHEMA)
    writer = EpisodeWriter(client, "r", chunk_rows=4, batch_rows=10_000)
    append_steps(writer, 4, first=200)  # its first chunk goes out, then it is evicted while still open
    _evict_the_open_episode(client, "r")
    with pytest.raises(grpc.RpcError) as refused:
        append_steps(writer, 4, first=204)  # its next chunk is refused
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not open" in refused.value.details()
    then(writer)
    assert writer.episodes_written == 0 and writer.pending_rows == 0
    append_steps(writer, 2, first=300)  # the next episode is written as usual
    writer.end_episode(terminated=True, obs=np.full(4, 302, np.float32))
    writer.close()
    stored = client.sample("r", 256, seed=2)["obs"][:, 0]
    assert set(stored[stored >= 200].tolist()) == {300, 301}
    assert writer.episodes_written == 1
    with pytest.raises(ValueError, match="end_episode: the episode has no steps"):  # a real empty episode still is
        EpisodeWriter(client, "r").end_episode(terminated=True, obs=np.zeros(4, np.float32))


def test_a_step_is_stored_as_it_was_when_appended_even_if_the_caller_reuses_its_array(client: ReplayClient) -> None:
    """Environments that write each observation into one array (gymnasium vector envs with copy=False, say):
    the writer kept a reference to a float32 observation instead of its value, so every row of the episode
    held the last observation written into that array."""
    client.create_buffer("b", 1000, SCHEMA)
    writer = EpisodeWriter(client, "b")
    obs = np.zeros(4, np.float32)
    for t in range(3):
        obs[:] = t
        writer.append(obs=obs, action=t, reward=float(t))
    obs[:] = 3
    writer.end_episode(terminated=True, obs=obs)
    obs[:] = -1  # the next episode's first observation, written before the episode above is sent
    writer.close()
    batch = client.sample("b", 64, seed=0)
    transitions = set(zip(batch["obs"][:, 0].tolist(), batch["action"].tolist(), batch["next_obs"][:, 0].tolist(),
                          strict=True))
    assert transitions == {(0.0, 0, 1.0), (1.0, 1, 2.0), (2.0, 2, 3.0)}
