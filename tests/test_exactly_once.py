"""Exactly-once inserts: spans named by (episode_id, offset) are stored once however often they are sent."""

from __future__ import annotations

import os
import threading

import grpc
import numpy as np
import pytest

from replayd.client import EpisodeWriter, ReplayClient
from replayd.client.replay_client import Span, _SamplingCalls, episode_span, spans_request
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.dedup import SpanDedup, span_offsets
from replayd.server.schema import Field
from replayd.wire import replay_pb2 as pb
from replayd.wire import replay_pb2_grpc as pb_grpc
from replayd.wire.components import (
    Fifo,
    MaxTimesSampled,
    MinSize,
    RateLimiterOptions,
    RemoverOptions,
    SampleToInsertRatio,
    States,
)
from replayd.wire.errors import FailedPrecondition
from replayd.wire.frames import serialize_insert

SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}


def episode(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
    return {"obs": rng.normal(size=(length + 1, 4)).astype(np.float32), "action": rng.integers(0, 2, length),
            "reward": np.ones(length, np.float32)}


def whole(rng: np.random.Generator, length: int, episode_id: int) -> Span:
    return episode_span(episode(rng, length), True, ("obs",), episode_id)


def rows(rng: np.random.Generator, count: int) -> dict[str, np.ndarray]:
    return {"obs": rng.normal(size=(count, 4)).astype(np.float32), "action": rng.integers(0, 2, count),
            "reward": np.ones(count, np.float32)}


def counters(client: ReplayClient, buffer: str) -> dict[str, float]:
    return client.describe(buffer)["counters"]


def test_same_request_twice_stores_once(client: ReplayClient) -> None:
    client.create_buffer("b", 1000, SCHEMA)
    request = spans_request("b", [whole(np.random.default_rng(0), 5, 11)])
    first = client.insert([request])
    second = client.insert([request])
    assert (first.duplicate_spans, second.duplicate_spans) == (0, 1)
    assert first.episodes_completed == second.episodes_completed == 1  # both acknowledged
    info = client.describe("b")
    assert info["episodes"] == 1 and info["stored_steps"] == 6
    assert info["counters"]["inserted_episodes"] == 1
    assert info["counters"]["duplicate_spans"] == 1 and info["counters"]["duplicate_requests"] == 1


def test_retried_stream_stores_each_request_once(client: ReplayClient) -> None:
    rng = np.random.default_rng(1)
    client.create_buffer("b", 1000, SCHEMA)
    requests = [spans_request("b", [whole(rng, 4, 100 + 2 * i), whole(rng, 6, 101 + 2 * i)]) for i in range(3)]
    # The first attempt got two requests through before the connection dropped.
    client.insert(requests[:2], retry=False)
    response = client.insert(requests)
    assert (response.requests, response.spans, response.duplicate_spans) == (3, 6, 4)
    assert response.episodes_completed == 6
    info = client.describe("b")
    assert info["episodes"] == 6 and info["counters"]["inserted_episodes"] == 6
    assert info["stored_steps"] == 3 * (5 + 7)


def test_request_mixing_new_and_stored_spans_stores_only_the_new(client: ReplayClient) -> None:
    rng = np.random.default_rng(2)
    client.create_buffer("b", 1000, SCHEMA)
    old = whole(rng, 4, 1)
    client.insert([spans_request("b", [old])])
    new = whole(rng, 7, 2)
    response = client.insert([spans_request("b", [new, old])])
    assert response.duplicate_spans == 1
    info = client.describe("b")
    assert info["episodes"] == 2 and info["stored_steps"] == 5 + 8
    batch = client.sample("b", 256, mode=States(), include_keys=True, seed=0)
    by_episode = {int(e): o for e, o in zip(batch["episode_id"], batch["obs"], strict=True)}
    assert set(by_episode) == {1, 2}
    # The new episode's rows were taken from the right part of the request.
    assert any(np.array_equal(by_episode[2], row) for row in new.columns["obs"])


def test_retried_chunks_store_once(client: ReplayClient) -> None:
    rng = np.random.default_rng(3)
    client.create_buffer("b", 1000, SCHEMA)
    first = Span(rows(rng, 5), 7, begins=True, ends=False, offset=0)
    second = Span(rows(rng, 4), 7, begins=False, ends=False, offset=5)
    last = Span(rows(rng, 3), 7, begins=False, ends=True, terminated=True, offset=9)
    client.insert([spans_request("b", [first])])
    client.insert([spans_request("b", [first])])  # lies inside the landed rows
    client.insert([spans_request("b", [second])])
    client.insert([spans_request("b", [first, second])])
    assert counters(client, "b")["open_episodes"] == 1 and client.describe("b")["stored_steps"] == 9
    client.insert([spans_request("b", [last])])
    response = client.insert([spans_request("b", [first, second, last])])  # the whole episode again, after it closed
    assert response.duplicate_spans == 3
    info = client.describe("b")
    assert info["episodes"] == 1 and info["stored_steps"] == 12 and info["counters"]["open_episodes"] == 0
    assert info["counters"]["inserted_spans"] == 3 and info["counters"]["duplicate_spans"] == 6


def test_overlapping_chunk_is_rejected(client: ReplayClient) -> None:
    rng = np.random.default_rng(4)
    client.create_buffer("b", 1000, SCHEMA)
    client.insert([spans_request("b", [Span(rows(rng, 5), 7, begins=True, ends=False)])])
    cases = [
        (Span(rows(rng, 4), 7, begins=False, ends=False, offset=3), "overlaps"),  # rows 3..6, 5 landed
        (Span(rows(rng, 6), 7, begins=True, ends=False, offset=0), "overlaps"),  # the first chunk, longer
        (Span(rows(rng, 2), 7, begins=False, ends=False, offset=8), "a chunk is missing"),
        (Span(rows(rng, 2), 7, begins=True, ends=False, offset=2), "must be 0"),
        # -1 is the server's own "no offset" marker: accepted, it would store the chunk with dedup off
        (Span(rows(rng, 2), 7, begins=False, ends=False, offset=-1), "span_offsets[0] = -1, expected >= 0"),
    ]
    for span, message in cases:
        with pytest.raises(grpc.RpcError) as caught:
            client.insert([spans_request("b", [span])])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert message in caught.value.details()
    assert client.describe("b")["stored_steps"] == 5
    # The right continuation still lands.
    client.insert([spans_request("b", [Span(rows(rng, 2), 7, begins=False, ends=True, offset=5)])])
    assert client.describe("b")["episodes"] == 1


def test_concurrent_duplicate_inserts_store_once(client: ReplayClient) -> None:
    rng = np.random.default_rng(5)
    client.create_buffer("b", 100_000, SCHEMA)
    requests = [spans_request("b", [whole(rng, 20, 1000 + 4 * i + k) for k in range(4)]) for i in range(25)]
    threads_count = 4
    barrier = threading.Barrier(threads_count)
    failures: list[BaseException] = []

    def send() -> None:
        try:
            barrier.wait()
            for request in requests:
                client.insert([request])
        except BaseException as exc:  # surfaced below
            failures.append(exc)

    threads = [threading.Thread(target=send) for _ in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    info = client.describe("b")
    assert info["episodes"] == 100 and info["counters"]["inserted_episodes"] == 100
    assert info["counters"]["duplicate_spans"] == 100 * (threads_count - 1)
    assert info["stored_steps"] == 100 * 21


def test_concurrent_duplicate_chunks_in_process_store_once() -> None:
    """Many threads racing the same chunks of one open episode straight into the buffer."""
    buffer = EpisodicBuffer("race", f"test{os.getpid()}race", (Field("obs", "float32", (4,), True),
                                                               Field("reward", "float32", (), False)), 10_000)
    try:
        rng = np.random.default_rng(6)
        chunks = [({"obs": rng.normal(size=(10, 4)).astype(np.float32), "reward": np.ones(10, np.float32)},
                   Spans(np.array([3], np.uint64), np.array([10]), np.array([i == 0]), np.array([i == 19]),
                         np.array([False]), offsets=np.array([10 * i]))) for i in range(20)]
        barrier = threading.Barrier(4)
        failures: list[BaseException] = []

        def send() -> None:
            try:
                barrier.wait()
                for columns, spans in chunks:
                    buffer.insert(columns, spans)
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=send) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures
        assert buffer.stored_steps == 200 and buffer.episodes == 1
        assert buffer.counters["inserted_spans"] == 20 and buffer.counters["duplicate_spans"] == 60
    finally:
        buffer.close()


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "injected: the response was lost"


class _LoseFirstResponses(grpc.StreamUnaryClientInterceptor, grpc.UnaryUnaryClientInterceptor):
    """Lets the first `count` calls (inserts or samples) reach the server and complete, then reports
    UNAVAILABLE."""

    def __init__(self, count: int) -> None:
        self.remaining = count
        self.calls = 0

    def _lose(self, outcome):
        self.calls += 1
        outcome.result()  # the server applied the call
        if self.remaining:
            self.remaining -= 1
            raise _Unavailable()
        return outcome

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return self._lose(continuation(client_call_details, request_iterator))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return self._lose(continuation(client_call_details, request))


def _with_interceptor(client: ReplayClient, interceptor: grpc.StreamUnaryClientInterceptor) -> None:
    channel = grpc.intercept_channel(client._channel, interceptor)
    client._insert = channel.stream_unary("/replayd.v1.Replay/Insert", request_serializer=serialize_insert,
                                          response_deserializer=pb.InsertResponse.FromString)


def test_lost_response_is_retried_and_stored_exactly_once(client: ReplayClient) -> None:
    rng = np.random.default_rng(7)
    client.create_buffer("b", 1000, SCHEMA)
    faults = _LoseFirstResponses(2)
    _with_interceptor(client, faults)
    requests = [spans_request("b", [whole(rng, 5, 50 + i)]) for i in range(3)]
    response = client.insert(requests)
    assert faults.calls == 3  # two lost responses, then the acknowledged retry
    assert response.requests == 3 and response.duplicate_spans == 3
    info = client.describe("b")
    assert info["episodes"] == 3 and info["counters"]["inserted_episodes"] == 3
    assert info["counters"]["duplicate_spans"] == 6

    with pytest.raises(grpc.RpcError) as caught:  # retry=False surfaces the fault
        _with_interceptor(client, _LoseFirstResponses(1))
        client.insert([spans_request("b", [whole(rng, 5, 60)])], retry=False)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_stream_holding_a_request_that_does_not_name_its_spans_is_sent_once(client: ReplayClient) -> None:
    """The server stores a request without span_offsets as sent: a retry of its stream would store it twice."""
    rng = np.random.default_rng(8)
    client.create_buffer("b", 1000, SCHEMA)
    faults = _LoseFirstResponses(1)
    _with_interceptor(client, faults)
    named = spans_request("b", [whole(rng, 5, 70)])
    unnamed = spans_request("b", [whole(rng, 5, 71)])
    del unnamed.request.span_offsets[:]
    with pytest.raises(grpc.RpcError) as caught:
        client.insert([named, unnamed])
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and faults.calls == 1
    assert client.describe("b")["episodes"] == 2  # each stored once


def test_episode_writer_flush_retried_after_lost_response(client: ReplayClient) -> None:
    rng = np.random.default_rng(8)
    client.create_buffer("b", 10_000, SCHEMA)
    writer = EpisodeWriter(client, "b", chunk_rows=4, batch_rows=10_000, auto_flush=False)
    _with_interceptor(client, _LoseFirstResponses(1))
    for length in (10, 3):
        for _ in range(length):
            writer.append(obs=rng.normal(size=4), action=1, reward=1.0)
        writer.end_episode(terminated=True, obs=rng.normal(size=4))
    for _ in range(6):  # an open episode with one chunk sent, two rows pending
        writer.append(obs=rng.normal(size=4), action=1, reward=1.0)
    writer.flush()
    for _ in range(5):
        writer.append(obs=rng.normal(size=4), action=1, reward=1.0)
    writer.end_episode(terminated=False, obs=rng.normal(size=4))
    writer.flush()
    info = client.describe("b")
    assert info["episodes"] == 3 and info["stored_steps"] == 11 + 4 + 12
    assert info["counters"]["open_episodes"] == 0 and info["counters"]["duplicate_spans"] > 0


def test_idempotent_calls_are_retried_after_a_lost_response(client: ReplayClient) -> None:
    client.create_buffer("d", 100, SCHEMA)
    faults = _LoseFirstResponses(1)
    client._stub = pb_grpc.ReplayStub(grpc.intercept_channel(client._channel, faults))
    assert client.describe("d")["capacity_steps"] == 100
    assert faults.calls == 2


def test_a_retried_chunk_the_window_forgot_is_acknowledged_from_the_open_episode() -> None:
    """With the span forgotten (window 0), the open episode's landed rows tell that the chunk is stored."""
    buffer = EpisodicBuffer("forgot", f"test{os.getpid()}forgot", (Field("obs", "float32", (4,), True),
                                                                   Field("reward", "float32", (), False)), 100,
                            dedup_window=0)
    try:
        chunk = {"obs": np.ones((3, 4), np.float32), "reward": np.ones(3, np.float32)}
        spans = Spans(np.array([5], np.uint64), np.array([3]), np.array([True]), np.array([False]),
                      np.array([False]), offsets=np.array([0]))
        assert buffer.insert_result(chunk, spans).duplicate_spans == 0
        assert buffer.insert_result(chunk, spans).duplicate_spans == 1
        assert buffer.stored_steps == 3
    finally:
        buffer.close()


def test_dedup_window_forgets_the_oldest() -> None:
    dedup = SpanDedup(window=2)
    spans = Spans.whole_episodes(np.array([3, 3, 3]), np.array([1, 2, 3]), np.ones(3, bool))
    spans = Spans(spans.episode_ids, spans.rows, spans.begins, spans.ends, spans.terminated, np.zeros(3, np.int64))
    offsets = span_offsets(spans)
    dedup.remember(spans, offsets)
    assert len(dedup) == 2
    assert dedup.screen(spans, offsets, lambda _: None).tolist() == [True, False, False]


def test_an_episode_id_reused_right_after_its_closing_chunk_in_one_request_is_stored() -> None:
    """[the closing chunk of open episode 7, a new episode 7 from offset 0]: the second span starts a new
    episode; it must not be taken for rows of the episode the first span closed."""
    dedup = SpanDedup()
    spans = Spans(np.array([7, 7], np.uint64), np.array([3, 4]), np.array([False, True]), np.array([True, False]),
                  np.array([True, False]), offsets=np.array([5, 0]))
    landed = {7: 5}  # episode 7 is open with 5 rows stored
    assert dedup.screen(spans, span_offsets(spans), landed.get).tolist() == [True, True]


def test_refused_request_with_a_retried_span_counts_nothing_and_names_the_span_as_sent() -> None:
    buffer = EpisodicBuffer("refuse", f"test{os.getpid()}refuse", (Field("obs", "float32", (4,), True),
                                                                   Field("reward", "float32", (), False)), 1000)
    try:
        rng = np.random.default_rng(7)
        stored = {"obs": rng.normal(size=(11, 4)).astype(np.float32), "reward": np.ones(11, np.float32)}
        buffer.insert(stored, Spans(np.array([1], np.uint64), np.array([11]), np.array([True]), np.array([True]),
                                    np.array([True]), offsets=np.array([0])))
        before = dict(buffer.counters)
        orphan = {"obs": np.zeros((2, 4), np.float32), "reward": np.ones(2, np.float32)}
        # span 0 retries the stored episode 1 (a duplicate); span 1 continues episode 99, which is not open
        request = ({k: np.concatenate([stored[k], orphan[k]]) for k in stored},
                   Spans(np.array([1, 99], np.uint64), np.array([11, 2]), np.array([True, False]),
                         np.array([True, False]), np.array([True, False]), offsets=np.array([0, 4])))
        with pytest.raises(FailedPrecondition, match="span 1 continues episode 99"):
            buffer.insert(*request)
        assert dict(buffer.counters) == before  # the refused request's duplicate is not counted
    finally:
        buffer.close()


@pytest.mark.parametrize("remover, rate_limiter, retried", [
    (Fifo(), MinSize(), True), (MaxTimesSampled(1), MinSize(), False),
    (Fifo(), SampleToInsertRatio(0.0, min_size_to_sample=5), False)])
def test_sample_is_retried_only_when_drawing_changes_nothing(client: ReplayClient, remover: RemoverOptions,
                                                             rate_limiter: RateLimiterOptions, retried: bool) -> None:
    """A lost Sample response after the server drew: a retry would count (and retire) the draws twice, or
    count them twice against the rate limiter's samples per insert."""
    rng = np.random.default_rng(9)
    client.create_buffer("s", 1000, SCHEMA, remover=remover, rate_limiter=rate_limiter)
    client.insert_episodes("s", [episode(rng, 100)], [True])
    faults = _LoseFirstResponses(1)
    client.use_sample_workers = False
    client._server_sampling = _SamplingCalls.on(grpc.intercept_channel(client._channel, faults))
    if retried:
        assert client.sample("s", 10)["obs"].shape == (10, 4)
    else:
        with pytest.raises(grpc.RpcError) as caught:
            client.sample("s", 10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert faults.calls == (2 if retried else 1)
    assert client.describe("s")["sampling_changes_state"] is not retried


def test_a_sample_is_not_sent_again_once_its_buffer_was_created_again_with_a_remover(client: ReplayClient) -> None:
    """The client has learned that sampling "s" changes nothing; another client then creates "s" again with a
    max_times_sampled remover. A lost response is not retried from the stale answer, which would retire one
    batch twice."""
    rng = np.random.default_rng(9)
    client.create_buffer("s", 1000, SCHEMA)
    client.insert_episodes("s", [episode(rng, 100)], [True])
    client.use_sample_workers = False
    client.sample("s", 4)  # learns: no side effects
    with ReplayClient(client.address) as other:
        other.delete_buffer("s")
        other.create_buffer("s", 1000, SCHEMA, remover=MaxTimesSampled(1))
        other.insert_episodes("s", [episode(rng, 100)], [True])
    faults = _LoseFirstResponses(1)
    client._server_sampling = _SamplingCalls.on(grpc.intercept_channel(client._channel, faults))
    with pytest.raises(grpc.RpcError) as caught:
        client.sample("s", 10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert faults.calls == 1
    assert client.describe("s")["counters"]["remover.retired_steps"] == 10
