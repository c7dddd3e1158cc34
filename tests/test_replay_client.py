"""The client API on its own: split_spans and episode_span, options sent with create_buffer, what the client
caches about a buffer, BatchStream's reopening, wait_until and the safetensors helpers."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch

from replayd.client import EpisodeWriter, ReplayClient
from replayd.client.batch_stream import BatchStream
from replayd.client.params import load_module_bytes, module_to_bytes
from replayd.client.polling import wait_until
from replayd.client.replay_client import Span, _SamplingCalls, episode_span, split_spans
from replayd.server.server import ReplayServer
from replayd.wire import codec
from replayd.wire import replay_pb2 as pb
from replayd.wire.components import (
    Geometric,
    MaxTimesSampled,
    Prioritized,
    SampleToInsertRatio,
    States,
    Transitions,
    Uniform,
)
from replayd.wire.errors import RETRY_AFTER_METADATA
from replayd.wire.frames import SampledMessage
from tests.conftest import rpc_status

SCHEMA = {"obs": ("float32", (2,)), "action": ("int64", ())}


def steps(length: int) -> dict[str, np.ndarray]:
    """An episode of `length` steps of SCHEMA's fields (16 bytes a row)."""
    return {"obs": np.zeros((length + 1, 2), np.float32), "action": np.zeros(length, np.int64)}
ROW_BYTES = 8 + 8  # obs float32[2] + action int64


def span(rows: int, begins: bool = True, ends: bool = True, terminated: bool = False, offset: int = 0,
         episode_id: int = 1) -> Span:
    return Span({"obs": np.arange(rows * 2, dtype=np.float32).reshape(rows, 2),
                 "action": np.arange(rows, dtype=np.int64) + offset}, episode_id, begins, ends, terminated, offset)


def layout(requests: list[list[Span]]) -> list[list[tuple[int, int, int, bool, bool, bool]]]:
    """(episode_id, offset, rows, begins, ends, terminated) of each span of each request."""
    return [[(s.episode_id, s.offset, s.rows, s.begins, s.ends, s.terminated) for s in group] for group in requests]


# ---------------------------------------------------------------- split_spans / episode_span
def test_only_the_last_chunk_of_a_split_terminated_episode_is_terminated() -> None:
    requests = split_spans([span(10, terminated=True)], max_request_bytes=4 * ROW_BYTES)
    chunks = [s for group in requests for s in group]
    assert len(chunks) > 1
    assert [s.terminated for s in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [s.ends for s in chunks] == [False] * (len(chunks) - 1) + [True]


def test_chunks_of_a_later_span_are_offset_from_the_spans_own_offset() -> None:
    """A span that continues its episode at row 100: its chunks are named 100, 100 + rows before, ..."""
    whole = span(10, begins=False, ends=False, offset=100)
    requests = split_spans([whole], max_request_bytes=4 * ROW_BYTES)
    chunks = [s for group in requests for s in group]
    assert [s.offset for s in chunks] == [100, 103, 106]  # no first-chunk reservation: the span does not begin
    for chunk in chunks:  # each chunk's rows are the span's rows at its offset
        rows = slice(chunk.offset - 100, chunk.offset - 100 + chunk.rows)
        np.testing.assert_array_equal(chunk.columns["action"], whole.columns["action"][rows])


def test_the_first_chunk_of_an_odd_episode_keeps_at_least_half_its_rows() -> None:
    requests = split_spans([span(7)], max_request_bytes=4 * ROW_BYTES)  # 4 rows a request
    chunks = [s for group in requests for s in group]
    assert chunks[0].rows == 4  # ceil(7 / 2): the server reserves twice the first chunk for the episode
    assert sum(s.rows for s in chunks) == 7


def test_spans_that_exactly_fill_a_request_go_in_one_request() -> None:
    requests = split_spans([span(2, episode_id=1), span(2, episode_id=2)], max_request_bytes=4 * ROW_BYTES)
    assert layout(requests) == [[(1, 0, 2, True, True, False), (2, 0, 2, True, True, False)]]


def test_spans_before_and_after_a_split_episode_are_sent_once_each_in_order() -> None:
    spans = [span(1, episode_id=1), span(10, episode_id=2), span(1, episode_id=3)]
    requests = split_spans(spans, max_request_bytes=4 * ROW_BYTES)
    assert layout(requests) == [
        [(1, 0, 1, True, True, False)],
        [(2, 0, 5, True, False, False)],
        [(2, 5, 2, False, False, False)],
        [(2, 7, 3, False, True, False), (3, 0, 1, True, True, False)],
    ]


def test_an_episode_whose_observation_fields_disagree_on_rows_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"observation fields need L \+ 1 rows.*obs=3.*frame=4"):
        episode_span({"obs": np.zeros((3, 2)), "frame": np.zeros((4, 2))}, True, ("obs", "frame"))


# ---------------------------------------------------------------- create / delete options
def test_observation_fields_outside_the_schema_are_refused_before_any_call(client: ReplayClient) -> None:
    with pytest.raises(ValueError, match=r"observation_fields \['pixels'\] are not in the schema"):
        client.create_buffer("b", 64, SCHEMA, observation_fields=("pixels",))
    assert client.list_buffers() == []


def test_the_reward_field_given_reaches_the_server(client: ReplayClient) -> None:
    code, details = rpc_status(client.create_buffer, "b", 64, SCHEMA, reward_field="score")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "reward_field 'score'" in details


def test_a_buffer_created_again_elsewhere_is_inserted_with_its_new_observation_fields(
        client: ReplayClient, server) -> None:
    client.create_buffer("b", 64, SCHEMA)
    client.insert_episode("b", True, obs=np.zeros((3, 2), np.float32), action=np.zeros(2, np.int64))
    client.delete_buffer("b")
    with ReplayClient(server.address, timeout=20) as other:
        other.create_buffer("b", 64, {"frame": ("float32", (2,)), "action": ("int64", ())},
                            observation_fields=("frame",))
    client.insert_episode("b", True, frame=np.zeros((3, 2), np.float32), action=np.zeros(2, np.int64))
    assert client.describe("b")["stored_steps"] == 3


def test_fractional_priorities_are_sent_as_they_are(client: ReplayClient) -> None:
    client.create_buffer("b", 64, SCHEMA, sampler=Prioritized(alpha=1.0))
    client.insert_episode("b", True, obs=np.zeros((5, 2), np.float32), action=np.arange(4))
    keys = client.sample("b", 64, mode=States(), include_keys=True, seed=0)["key"]
    keys = np.unique(keys)
    assert keys.size == 4  # every step (5 observations, 4 steps), so that all but one get priority 0
    priorities = np.zeros(keys.size)
    priorities[0] = 0.5  # only this key can be drawn
    assert client.update_priorities("b", keys, priorities) == (keys.size, 0)
    batch = client.sample("b", 16, mode=States(), include_keys=True, seed=1)
    assert set(batch["key"].tolist()) == {int(keys[0])}


# ---------------------------------------------------------------- sample workers
def test_sample_workers_are_reached_at_the_host_the_client_connected_to(monkeypatch: pytest.MonkeyPatch) -> None:
    with ReplayClient("127.0.0.1:1", timeout=1) as replay_client:
        monkeypatch.setattr(replay_client, "describe", lambda name, timeout=None: {
            "sample_endpoints": ["0.0.0.0:4242"], "sampling_changes_state": False})
        opened = []
        open_channel = replay_client._open_channel
        monkeypatch.setattr(replay_client, "_open_channel",
                            lambda address: opened.append(address) or open_channel(address))
        replay_client._sampling("b", 1.0)
        assert opened == ["127.0.0.1:4242"]


def test_the_sample_call_gets_what_is_left_of_the_timeout_after_describing(monkeypatch: pytest.MonkeyPatch) -> None:
    given = []

    def slow_describe(name, timeout=None):
        time.sleep(0.2)  # a slow server answering the describe
        return {"sample_endpoints": [], "sampling_changes_state": False}

    def sample(request, timeout=None):
        given.append(timeout)
        return SampledMessage(memoryview(codec.encode({"x": np.zeros(1, np.float32)})))

    with ReplayClient("127.0.0.1:1", timeout=1) as replay_client:
        monkeypatch.setattr(replay_client, "describe", slow_describe)
        monkeypatch.setattr(replay_client, "_server_sampling", _SamplingCalls(sample, None))
        replay_client.sample("b", 1, timeout=1.0)
    # 1 s in all: the first describe (whether sampling changes state), then the workers' describe, 0.2 s each.
    assert len(given) == 1 and given[0] < 0.7


# ---------------------------------------------------------------- BatchStream
class FakeError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, retry_after_ms: int | None = None) -> None:
        self._code, self._retry_after_ms = code, retry_after_ms

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "busy" if self._retry_after_ms is not None else "failed"

    def trailing_metadata(self):
        return () if self._retry_after_ms is None else ((RETRY_AFTER_METADATA, str(self._retry_after_ms)),)


class FakeCall:
    """A call that yields `payloads`, then raises `error` (or ends)."""

    def __init__(self, payloads: list[bytes], error: Exception | None = None) -> None:
        self._payloads, self._error = list(payloads), error

    def __next__(self) -> bytes:
        if self._payloads:
            return self._payloads.pop(0)
        if self._error is not None:
            raise self._error
        raise StopIteration

    def cancel(self) -> None:
        pass


def opener(calls: list[FakeCall]):
    """open_call(seconds) handing out `calls` in turn, noting when and with what deadline each was opened."""
    opened: list[tuple[float, float | None]] = []

    def open_call(seconds: float | None) -> FakeCall:
        opened.append((time.monotonic(), seconds))
        return calls[len(opened) - 1]

    return open_call, opened


PAYLOAD = codec.encode({"x": np.arange(3, dtype=np.float32)})
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_stream_refused_as_busy_after_a_batch_is_not_opened_again() -> None:
    """Batches were sampled: opening it again would sample on in a new call, so the error reaches the caller."""
    open_call, opened = opener([FakeCall([PAYLOAD], FakeError(BUSY, 1)), FakeCall([PAYLOAD])])
    stream = BatchStream(open_call, 10.0)
    np.testing.assert_array_equal(next(stream)["x"], [0, 1, 2])
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert info.value.code() == BUSY
    assert len(opened) == 1


def test_a_reopened_stream_gets_what_is_left_of_its_timeout() -> None:
    open_call, opened = opener([FakeCall([], FakeError(BUSY, 50)), FakeCall([PAYLOAD])])
    created_at = time.monotonic()
    stream = BatchStream(open_call, 10.0)
    next(stream)
    assert len(opened) == 2
    (_, first), (second_at, second) = opened
    assert first == 10.0
    # The reopen came after at least the 50 ms pause the server asked for, and no later than it was noted.
    assert 10.0 - (second_at - created_at) <= second <= 10.0 - 0.05


def test_a_stream_refused_again_and_again_backs_off_exponentially(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("replayd.client.batch_stream.random.random", lambda: 0.0)  # pauses without jitter
    open_call, opened = opener([FakeCall([], FakeError(BUSY, 1)) for _ in range(3)] + [FakeCall([PAYLOAD])])
    stream = BatchStream(open_call, 10.0)
    next(stream)
    gaps = np.diff([at for at, _ in opened])
    assert len(gaps) == 3
    assert gaps[2] >= 0.19  # 0.05, 0.1, 0.2


class DeadlineCall(FakeCall):
    """A call the server does not answer within its `seconds`: it ends as gRPC's own deadline ends it."""

    def __init__(self, seconds: float) -> None:
        super().__init__([], FakeError(grpc.StatusCode.DEADLINE_EXCEEDED))
        self._deadline = time.monotonic() + seconds

    def __next__(self) -> bytes:
        threading.Event().wait(max(self._deadline - time.monotonic(), 0.0))  # the deadline passing
        return super().__next__()


# (timeout, second call): cut short by the call's own deadline, or the server's own DEADLINE_EXCEEDED at once
# (a server gives up before the deadline; long before it here, so that no stall of this thread blurs the two).
CUT_SHORT = (0.3, DeadlineCall)
SERVER_DEADLINE_FIRST = (30.0, lambda seconds: DeadlineCall(0.0))
REFUSED_THEN = pytest.mark.parametrize(
    ("case", "code"), [(CUT_SHORT, BUSY), (SERVER_DEADLINE_FIRST, grpc.StatusCode.DEADLINE_EXCEEDED)],
    ids=["cut short", "server deadline first"])


def refused_then(second_call):
    """attempt(seconds): refused as busy, then `second_call(seconds)`."""
    opened: list[float | None] = []

    def attempt(seconds: float | None) -> FakeCall:
        opened.append(seconds)
        if len(opened) == 1:
            return FakeCall([], FakeError(BUSY, 1))
        return second_call(seconds)

    return attempt, opened


@REFUSED_THEN
def test_a_stream_refused_until_its_deadline_fails_with_the_refusal(case, code: grpc.StatusCode) -> None:
    """The reopen the deadline cut short before the server answered fails with the refusal, which says why;
    a DEADLINE_EXCEEDED the server sent before the deadline reaches the caller as it is."""
    timeout, second_call = case
    attempt, opened = refused_then(second_call)
    stream = BatchStream(attempt, timeout)
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert len(opened) == 2 and info.value.code() == code


def test_a_stream_whose_reopen_asks_the_server_past_its_deadline_fails_with_the_refusal() -> None:
    """Reopening asks the server where to sample first; that describe running into the stream's deadline
    came out as a bare DEADLINE_EXCEEDED, where the refusal says why (as a unary sample's does)."""
    opened: list[float | None] = []

    def open_call(seconds: float | None) -> FakeCall:
        opened.append(seconds)
        if len(opened) == 1:
            return FakeCall([], FakeError(BUSY, 1))
        next(DeadlineCall(seconds))  # the describe before the call, cut short by the deadline
        raise AssertionError("unreachable: the describe raises")

    stream = BatchStream(open_call, 0.3)
    with pytest.raises(grpc.RpcError) as info:
        next(stream)
    assert len(opened) == 2 and info.value.code() == BUSY


def test_closing_a_stream_while_it_reopens_does_not_wait_for_the_reopen() -> None:
    """close() returns at once while the reopen asks the server where to sample (a describe of up to the
    client's timeout), instead of waiting on the stream's lock, and the call opened meanwhile is cancelled."""
    describing, answer = threading.Event(), threading.Event()
    cancelled: list[bool] = []
    opened: list[float | None] = []

    class CancelledCall(FakeCall):
        def cancel(self) -> None:
            cancelled.append(True)

    def open_call(seconds: float | None) -> FakeCall:
        opened.append(seconds)
        if len(opened) == 1:
            return FakeCall([], FakeError(BUSY, 1))
        describing.set()
        answer.wait(timeout=30)  # the server's answer to the describe comes when the test says
        return CancelledCall([PAYLOAD])

    stream = BatchStream(open_call, 30.0)
    ended: list[str] = []
    reader = threading.Thread(target=lambda: ended.append(str(list(stream))))
    reader.start()
    assert describing.wait(timeout=10)  # the reader is reopening: in the describe
    started = time.monotonic()
    stream.close()
    closed_in = time.monotonic() - started
    answer.set()
    reader.join(timeout=30)
    assert closed_in < 1.0 and ended == ["[]"] and cancelled == [True]


@REFUSED_THEN
def test_a_unary_call_refused_until_its_deadline_fails_with_the_refusal(case, code: grpc.StatusCode) -> None:
    timeout, second_call = case
    attempt, opened = refused_then(second_call)
    with ReplayClient("127.0.0.1:1", timeout=1) as replay_client, pytest.raises(grpc.RpcError) as info:
        replay_client._with_retries(lambda seconds: next(attempt(seconds)), ReplayClient.RETRYABLE, timeout)
    assert len(opened) == 2 and info.value.code() == code


# ---------------------------------------------------------------- wait_until
def test_wait_until_backs_off_no_longer_than_max_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr("replayd.client.polling.time.sleep", pauses.append)
    results = iter([None] * 12 + [7])
    assert wait_until(lambda: next(results), time.monotonic() + 60, "x", delay=0.01, max_delay=0.05) == 7
    assert pauses[:3] == [0.01, 0.02, 0.04]
    assert max(pauses) == 0.05


def test_wait_until_raises_a_grpc_error_it_was_not_told_to_retry() -> None:
    def check():
        raise FakeError(grpc.StatusCode.PERMISSION_DENIED)

    with pytest.raises(grpc.RpcError) as info:
        wait_until(check, time.monotonic() + 5, "x")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_wait_until_returns_a_result_that_came_as_it_was_stopped() -> None:
    assert wait_until(lambda: "done", time.monotonic() + 5, "x", stopped=lambda: True) == "done"


# ---------------------------------------------------------------- params
def test_loading_weights_that_lack_a_parameter_fails_naming_it() -> None:
    source, target = torch.nn.Linear(3, 2), torch.nn.Sequential(torch.nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*0\.weight"):
        load_module_bytes(target, module_to_bytes(source))


# ---------------------------------------------------------------- arguments refused, not altered
@pytest.mark.parametrize("retries", [-1, 1.5, True, None])
def test_retries_that_are_not_an_integer_of_at_least_0_are_refused(retries) -> None:
    """retries=-1 never equalled the count of retries done: the client retried until the deadline (forever
    without one)."""
    with pytest.raises(ValueError, match=rf"retries: expected an integer >= 0, got {retries!r}"):
        ReplayClient("127.0.0.1:1", retries=retries)


@pytest.mark.parametrize("max_request_bytes", [0, -8])
def test_max_request_bytes_below_1_is_refused(max_request_bytes: int) -> None:
    with pytest.raises(ValueError, match=rf"max_request_bytes: expected an integer >= 1, got {max_request_bytes}"):
        ReplayClient("127.0.0.1:1", max_request_bytes=max_request_bytes)


@pytest.mark.parametrize(("keys", "message"), [
    (np.array([3.7, 10.2]), r"expected integers, got dtype float64 \(first key 3.7\)"),  # not steps 3 and 10
    ([3, 10.0], r"expected integers, got 10.0 at index 1"),
    ([1, True], r"expected integers, got True at index 1"),
    (np.array([True]), r"expected integers, got dtype bool"),
    (np.array([5, 2**64 - 1], np.uint64), rf"expected integers in 0\.\.{2**63 - 1} .*got {2**64 - 1} at index 1"),
    ([2**70], rf"expected integers in .* got {2**70} at index 0"),
    ([0, -1], r"expected integers in .* got -1 at index 1"),
    (np.array([[1, 2]]), r"expected a 1-D sequence, got shape \(1, 2\)"),
])
def test_keys_a_cast_would_change_are_refused_before_any_call(client: ReplayClient, keys, message: str) -> None:
    with pytest.raises(ValueError, match=f"keys: {message}"):
        client.update_priorities("b", keys, np.ones(np.size(keys)))


def test_integer_keys_of_any_integer_type_are_sent(client: ReplayClient) -> None:
    client.create_buffer("b", 64, SCHEMA, sampler=Prioritized())
    client.insert_episode("b", True, obs=np.zeros((3, 2), np.float32), action=np.arange(2))
    keys = np.unique(client.sample("b", 32, mode=States(), include_keys=True, seed=0)["key"])
    for sent in (keys.astype(np.uint64), keys.astype(np.int32), [int(k) for k in keys], list(keys)):
        assert client.update_priorities("b", sent, np.ones(len(keys))) == (len(keys), 0)
    assert client.update_priorities("b", [], []) == (0, 0)


@pytest.mark.parametrize(("call", "args", "option"), [
    ("sample", ("b", 4), "importance_beta"),  # 0
    ("sample", ("b", None), "batch_size"),
    ("sample_stream", ("b", 4), "num_batches"),  # 0: endless
    ("create_buffer", ("b", None, SCHEMA), "capacity_steps"),
    ("create_rollout_buffer", ("b", 4, 2, SCHEMA), "gamma"),
    ("create_rollout_buffer", ("b", 4, 2, SCHEMA), "gae_lambda"),
    ("create_rollout_buffer", ("b", None, 2, SCHEMA), "num_steps"),
    ("push_rollout", ("b", None, 0, 0), "policy_version"),  # 0: a push into the first rollout
    ("push_rollout", ("b", 0, None, 0), "env_start"),
    ("push_rollout", ("b", 0, 0, None), "step_start"),
    ("finish_rollout", ("b", None), "next_version"),
    ("publish_weights", ("w", None, b""), "version"),
    ("fetch_weights", ("w",), "newer_than"),  # 0: the newest weights, however old
])
def test_numeric_options_given_as_none_are_refused_naming_them(client: ReplayClient, call: str, args: tuple,
                                                                option: str) -> None:
    options = {} if None in args else {option: None}
    with pytest.raises(ValueError, match=rf"{re.escape(option)}: expected a value, got None"):
        getattr(client, call)(*args, **options)
    assert client.list_buffers() == []


@pytest.mark.parametrize(("option", "value"), [("chunk_rows", None), ("chunk_rows", 1), ("batch_rows", None),
                                             ("batch_rows", 0), ("batch_rows", 2.5)])
def test_an_episode_writer_size_that_is_not_an_integer_in_range_is_refused(client: ReplayClient, option: str,
                                                                           value: object) -> None:
    with pytest.raises(ValueError, match=rf"{option} must be an integer >= [12], got {value!r}"):
        EpisodeWriter(client, "b", **{option: value})


def test_an_episode_longer_than_the_ring_is_refused_before_any_chunk_of_it_is_sent(server: ReplayServer) -> None:
    """An episode sent as chunks (larger than max_request_bytes) would land chunk by chunk, evicting the
    episodes stored before it, until the server refused the chunk that outgrew the ring."""
    with ReplayClient(server.address, timeout=20, max_request_bytes=16 * 20) as client:  # 20 rows a request
        client.create_buffer("b", 100, SCHEMA)
        client.insert_episodes("b", [steps(10), steps(10)], [True, True])
        before = client.describe("b")
        for call in (lambda: client.insert_episode("b", True, **steps(150)),
                     lambda: client.insert_episodes("b", [steps(5), steps(150)], [True, False])):
            with pytest.raises(ValueError, match=r"has 151 rows, more than capacity_steps=100 of buffer 'b'"):
                call()
            assert client.describe("b") == before
        client.insert_episode("b", True, **steps(98))  # 99 rows, in 5 requests: fits
        assert client.describe("b")["episodes"] == 1


@pytest.mark.parametrize(("mode", "message"), [
    ("transitions", "mode: expected a batch mode's options"),
    ({"n_step": 3}, "mode: expected a batch mode's options"),
    (Uniform(), "mode: expected a batch mode's options"),
])
def test_a_mode_that_is_not_a_modes_options_is_refused(client: ReplayClient, mode: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        client.sample("b", 4, mode)
    with pytest.raises(ValueError, match=re.escape(message)):
        client.sample_stream("b", 4, mode)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Transitions(n_step=0), "transitions.n_step must be an integer in 1..1000, got 0"),
    (lambda: Transitions(gamma=1.5), "transitions.gamma must be in [0, 1], got 1.5"),
    (lambda: Geometric(discount=float("nan")), "geometric.discount must be in [0, 1], got nan"),
    (lambda: Prioritized(alpha=-1.0), "prioritized.alpha must be finite and >= 0, got -1.0"),
    (lambda: MaxTimesSampled(0), "max_times_sampled.max_times_sampled must be an integer >= 1, got 0"),
    (lambda: SampleToInsertRatio(2.0, error_buffer=1.0), "rate_limiter.error_buffer=1.0 is too small"),
    # None is no value (protobuf would take it as "not set" and the server would use the field's default)
    (lambda: Transitions(n_step=None), "transitions.n_step must be an integer in 1..1000, got None"),
    (lambda: Transitions(gamma=None), "transitions.gamma must be in [0, 1], got None"),
    (lambda: Prioritized(alpha=None), "prioritized.alpha must be finite and >= 0, got None"),
    (lambda: MaxTimesSampled(None), "max_times_sampled.max_times_sampled must be an integer >= 1, got None"),
    (lambda: SampleToInsertRatio(None), "rate_limiter.samples_per_insert must be finite and >= 0, got None"),
])
def test_options_are_validated_where_they_are_constructed(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_mode_options_left_out_take_their_defaults() -> None:
    request = ReplayClient.sample_request("b", 4)
    assert (request.mode.transitions.n_step, request.mode.transitions.gamma) == (1, pytest.approx(0.99))
    request = ReplayClient.sample_request("b", 4, mode=Transitions(n_step=3, gamma=0.5))
    assert (request.mode.transitions.n_step, request.mode.transitions.gamma) == (3, 0.5)
    assert ReplayClient.sample_request("b", 4, Geometric(discount=0.5)).mode.geometric.discount == 0.5
    assert ReplayClient.sample_request("b", 4, States()).mode.WhichOneof("kind") == "states"


def test_components_that_are_not_their_roles_options_are_refused(client: ReplayClient) -> None:
    for options, message in (({"sampler": "prioritized"}, "sampler: expected Uniform() or Prioritized"),
                             ({"remover": Prioritized()}, "remover: expected Fifo() or MaxTimesSampled"),
                             ({"rate_limiter": {"min_size_to_sample": 5}}, "rate_limiter: expected MinSize(n)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            client.create_buffer("b", 64, SCHEMA, **options)
    assert client.list_buffers() == []
    client.create_buffer("b", 64, SCHEMA, sampler=Prioritized())
    info = client._stub.DescribeBuffer(pb.DescribeBufferRequest(name="b"))
    assert info.episodic.sampler.prioritized.alpha == pytest.approx(0.6)  # left out: the documented default
    assert client.describe("b")["sampler"] == Prioritized(0.6)
