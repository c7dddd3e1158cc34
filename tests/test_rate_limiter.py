"""Rate limiter: min size, the samples-per-insert band under concurrent inserters and samplers, deadlines."""

from __future__ import annotations

import os
import threading
import time

import grpc
import numpy as np
import pytest

from replayd.client import ReplayClient
from replayd.client.replay_client import episode_span, spans_requests
from replayd.client.retries import server_retry_after
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.limiters import SampleToInsertRatioLimiter
from replayd.server.modes.states import StatesMode
from replayd.server.removers import MaxTimesSampledRemover
from replayd.server.server import ReplayServer
from replayd.server.worker_seats import WorkerSeats
from replayd.wire.components import SampleToInsertRatio
from replayd.wire.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from tests.conftest import TEST_INSTANCE
from tests.test_episodic_buffer import FIELDS, make_rows


def new_buffer(limiter: SampleToInsertRatioLimiter, capacity: int = 10_000) -> EpisodicBuffer:
    return EpisodicBuffer("rl", f"test{os.getpid()}", FIELDS, capacity, limiter=limiter)


def insert_episode(buffer: EpisodicBuffer, steps: int, episode_id: int, timeout: float | None = None) -> None:
    buffer.insert(make_rows(np.random.default_rng(episode_id), 0, steps + 1),
                  Spans.whole_episodes(np.array([steps]), np.array([episode_id]), np.ones(1, bool)), timeout=timeout)


def test_min_size_blocks_sampling_until_reached() -> None:
    buffer = new_buffer(SampleToInsertRatioLimiter(min_size_to_sample=10))
    try:
        insert_episode(buffer, 5, 0)
        with pytest.raises(FailedPrecondition, match="min_size_to_sample=10"):
            buffer.sample(1, StatesMode())
        with pytest.raises(DeadlineExceeded):
            buffer.sample(1, StatesMode(), wait_seconds=0.05)
        insert_episode(buffer, 5, 1)
        assert len(buffer.sample(4, StatesMode())["obs"]) == 4
    finally:
        buffer.close()


def test_ratio_band_blocks_each_side_and_deadlines_end_blocked_calls() -> None:
    limiter = SampleToInsertRatioLimiter(min_size_to_sample=4, samples_per_insert=2.0, error_buffer=8.0)
    buffer = new_buffer(limiter)
    try:
        insert_episode(buffer, 4, 0)  # 4 items: diff = 8 = the band's center
        with pytest.raises(DeadlineExceeded, match="insert"):  # diff + 2 > max_diff = 16 after 4 more
            insert_episode(buffer, 4, 1)
            insert_episode(buffer, 4, 2, timeout=0.05)
        assert limiter.inserts == 8 and limiter.insert_waits == 1
        assert limiter.insert_wait_seconds >= 0.05  # the held insert's wait, to its deadline
        buffer.sample(8, StatesMode())
        buffer.sample(8, StatesMode())  # diff 16 -> 0 = min_diff
        with pytest.raises(FailedPrecondition, match="inserts are behind"):
            buffer.sample(1, StatesMode())
        with pytest.raises(DeadlineExceeded):
            buffer.sample(1, StatesMode(), wait_seconds=0.05)
        with pytest.raises(InvalidArgument, match="batch_size=15"):
            buffer.sample(15, StatesMode(), wait_seconds=1.0)
        assert limiter.sample_waits == 1
        assert limiter.sample_wait_seconds >= 0.05
    finally:
        buffer.close()


def test_inserts_evicting_below_min_size_never_block() -> None:
    """While evictions keep the buffer under min_size_to_sample nothing can sample, so inserts must not wait
    on the ratio: they would wait for samples that can never come."""
    limiter = SampleToInsertRatioLimiter(min_size_to_sample=15, samples_per_insert=1.0, error_buffer=1.0)
    buffer = new_buffer(limiter, capacity=16)
    try:
        for episode_id in range(6):  # diff reaches max_diff = 16 by the 4th; capacity keeps 2 episodes
            insert_episode(buffer, 5, episode_id, timeout=1.0)
        assert limiter.inserts == 30 and limiter.insert_waits == 0
        assert buffer.sampleable_steps < limiter.min_size_to_sample
    finally:
        buffer.close()


def test_a_sample_short_of_draws_left_lets_the_inserts_it_needs_past_the_ratio() -> None:
    """max_times_sampled=1: 6 steps with draws left, diff at max_diff. A sample of 8 passes the ratio but finds
    too few draws and waits for inserts; the insert it needs goes past the ratio, which would otherwise hold
    it back waiting for a sample, and both would wait to their deadlines."""
    limiter = SampleToInsertRatioLimiter(min_size_to_sample=1, samples_per_insert=1.0, error_buffer=5.0)
    buffer = EpisodicBuffer("rl", f"test{os.getpid()}", FIELDS, 1000, limiter=limiter,
                            remover=MaxTimesSampledRemover(1))
    try:
        insert_episode(buffer, 5, 0)
        insert_episode(buffer, 1, 1)
        assert buffer.sampleable_steps == 6 and limiter.diff == limiter.max_diff == 6
        sampled: list[int] = []
        sampler = threading.Thread(target=lambda: sampled.append(len(buffer.sample(8, StatesMode(),
                                                                                    wait_seconds=20)["obs"])))
        sampler.start()
        insert_episode(buffer, 20, 2, timeout=20)
        sampler.join(timeout=30)
        assert not sampler.is_alive() and sampled == [8]
        assert buffer.samples_short_of_draws == 0
    finally:
        buffer.close()


def test_recovery_restarts_the_limiter_at_the_centre_of_its_band() -> None:
    limiter = SampleToInsertRatioLimiter(min_size_to_sample=4, samples_per_insert=2.0, error_buffer=8.0)
    limiter.recover(20)
    assert limiter.inserts == 20 and limiter.samples == 32
    assert limiter.diff == 8 == (limiter.min_diff + limiter.max_diff) / 2
    small = SampleToInsertRatioLimiter(min_size_to_sample=10, samples_per_insert=2.0, error_buffer=8.0)
    small.recover(4)  # fewer steps than min size: no negative sample count
    assert small.samples == 0 and small.diff == 8


def test_an_insert_that_could_never_land_fails_at_once_while_inserts_are_held() -> None:
    """A continuation of an episode that is not open is refused at once, not held until its deadline (which
    clients retry) with the limiter's wait counters changed for a request that stores nothing."""
    limiter = SampleToInsertRatioLimiter(min_size_to_sample=4, samples_per_insert=2.0, error_buffer=8.0)
    buffer = new_buffer(limiter)
    try:
        insert_episode(buffer, 4, 1)
        insert_episode(buffer, 4, 2)  # diff = 16 = max_diff: inserts are held back
        assert not limiter.insert_allowed(buffer.sampleable_steps, short_of_draws=False)
        before = limiter.snapshot()
        start = time.monotonic()
        with pytest.raises(FailedPrecondition, match="continues episode 99, which is not open"):
            buffer.insert(make_rows(np.random.default_rng(0), 5, 3),
                          Spans(np.array([99], np.uint64), np.array([3]), np.zeros(1, bool), np.zeros(1, bool),
                                np.zeros(1, bool)), timeout=30)
        assert time.monotonic() - start < 10
        assert limiter.snapshot() == before
    finally:
        buffer.close()


def test_concurrent_inserters_and_samplers_stay_in_the_band() -> None:
    spi, error_buffer, min_size = 4.0, 40.0, 20
    limiter = SampleToInsertRatioLimiter(min_size, spi, error_buffer)
    buffer = new_buffer(limiter, capacity=100_000)
    observed: list[float] = []
    errors: list[BaseException] = []

    def actor(first_id: int) -> None:
        try:
            for i in range(60):
                insert_episode(buffer, 5, first_id + i, timeout=10.0)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def learner() -> None:
        try:
            for _ in range(145):  # 2 x 145 x 8 samples: enough to admit the last insert, within the band
                buffer.sample(8, StatesMode(), wait_seconds=10.0)
                observed.append(limiter.diff)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=actor, args=(k * 1000,)) for k in range(2)]
    threads += [threading.Thread(target=learner) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    try:
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert limiter.inserts == 2 * 60 * 5
        assert min(observed) >= limiter.min_diff  # samples never ran ahead of the ratio
        assert limiter.insert_waits > 0 and limiter.sample_waits > 0
    finally:
        buffer.close()


def test_config_is_validated() -> None:
    with pytest.raises(InvalidArgument, match="error_buffer"):
        SampleToInsertRatioLimiter(1, samples_per_insert=4.0, error_buffer=1.0)
    with pytest.raises(InvalidArgument, match="error_buffer must be finite and >= 0"):
        SampleToInsertRatioLimiter(1, samples_per_insert=0.0, error_buffer=-1.0)
    SampleToInsertRatioLimiter(1, samples_per_insert=1.0, error_buffer=1.0)  # the documented boundary: 2 * 1 == 1 + 1
    # 0 is refused, not taken as 1, which would also move the band by samples_per_insert (it is centred on
    # min size * spi)
    with pytest.raises(InvalidArgument, match=r"min_size_to_sample must be an integer >= 1 .*got 0"):
        SampleToInsertRatioLimiter(0, samples_per_insert=2.0, error_buffer=10.0)
    with pytest.raises(InvalidArgument, match="samples_per_insert"):
        SampleToInsertRatioLimiter(1, samples_per_insert=-1.0)
    # A min size the ring can never hold would leave the buffer unsampleable forever.
    with pytest.raises(InvalidArgument, match=r"min_size_to_sample=16 can never be reached.*capacity_steps=16"):
        new_buffer(SampleToInsertRatioLimiter(16), capacity=16)
    new_buffer(SampleToInsertRatioLimiter(15), capacity=16).close()


SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}


def _episode(steps: int = 5) -> dict[str, np.ndarray]:
    return {"obs": np.zeros((steps + 1, 4), np.float32), "action": np.zeros(steps, np.int64),
            "reward": np.ones(steps, np.float32)}


def _poll(condition, what: str, failures: list) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline and not failures, (what, failures)
        time.sleep(0.01)


def _in_thread(call, failures: list) -> threading.Thread:
    def run() -> None:
        try:
            call()
        except BaseException as exc:  # reported by the callers' assertions
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_blocked_calls_never_take_every_server_worker() -> None:
    """More inserts held back by a rate limiter than the server lets wait: one more is refused at once with
    a retry-after hint, while a learner's stream still opens (streams have seats of their own) and unary
    samples are still served; they release the held inserts, and the refused insert, retried by the client
    until its deadline, lands once a seat frees up. Without the cap, the held inserts would take every worker
    and the samples could only queue behind them until their deadlines."""
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}seats", max_workers=8).start()
    threads: list[threading.Thread] = []
    failures: list[BaseException] = []
    try:
        seats = server.registry.worker_seats
        assert seats.caps == {"waits": 3, "streams": 3}  # 8 workers: 2 kept free for short calls
        # No retries of held inserts past their deadline (busy refusals are still retried): a call that
        # hangs fails the test at its own 10 s deadline, not after retries * deadline.
        with ReplayClient(server.address, timeout=10, retries=0) as client:
            # diff = inserted - sampled items; an insert waits while diff + 1 > max_diff = 1 + 5, so after
            # two 5-step episodes (diff 10) every further one waits until samples bring diff down to 5.
            client.create_buffer("rl", 1000, SCHEMA,
                                 rate_limiter=SampleToInsertRatio(1.0, error_buffer=5.0))
            client.insert_episode("rl", True, **_episode())
            client.insert_episode("rl", True, **_episode())
            threads = [_in_thread(lambda: client.insert_episode("rl", True, **_episode()), failures)
                       for _ in range(3)]
            _poll(lambda: client.describe("rl")["counters"]["rate_limiter.insert_waiting"] == 3, "3 held", failures)

            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                client.insert(spans_requests("rl", [episode_span(_episode(), True, ("obs",))], 2**20),
                              timeout=10, retry=False)
            assert time.monotonic() - started < 5  # refused at once, not after waiting
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "server is busy" in refused.value.details() and "'rl'" in refused.value.details()
            assert server_retry_after(refused.value) == 0.1
            threads.append(_in_thread(lambda: client.insert_episode("rl", True, **_episode()), failures))
            _poll(lambda: server.servicer.rejected.get("Insert", 0) >= 2, "the retried insert refused", failures)

            # The learner's stream opens at once and its samples let the held inserts through, and the refused
            # one in (one batch per held insert: sampling further ahead would hold the samples back).
            stream = client.sample_stream("rl", 4, wait=True, timeout=10)
            deadline = time.monotonic() + 20
            while any(thread.is_alive() for thread in threads):
                assert time.monotonic() < deadline and not failures, failures
                if client.describe("rl")["counters"]["rate_limiter.insert_waiting"]:
                    assert next(stream)["obs"].shape == (4, 4)
                else:
                    time.sleep(0.01)
            stream.close()
            assert not failures, failures
            assert client.describe("rl")["counters"]["inserted_episodes"] == 6
            assert server.servicer.rejected.get("SampleStream", 0) == 0
        _poll(lambda: seats.taken == {"waits": 0, "streams": 0}, "every seat back", failures)
    finally:
        for thread in threads:
            thread.join(timeout=30)
        server.stop(grace=0)


def test_worker_seats_keep_a_quarter_free_and_favour_waits() -> None:
    assert WorkerSeats.for_workers(9).caps == {"waits": 4, "streams": 3}  # 7 long calls: the odd one waits
    assert WorkerSeats.for_workers(3).caps == {"waits": 1, "streams": 1}
    with pytest.raises(ValueError, match="max_workers"):
        WorkerSeats.for_workers(2)


def test_open_streams_take_seats_and_leave_workers_for_short_calls() -> None:
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}streams", max_workers=8).start()
    streams = []
    try:
        seats = server.registry.worker_seats
        with ReplayClient(server.address, timeout=30) as client:
            client.create_buffer("free", 1000, SCHEMA)
            client.insert_episode("free", True, **_episode())
            streams = [client.sample_stream("free", 4) for _ in range(3)]
            for stream in streams:
                next(stream)  # open, each holding a worker
            assert seats.taken == {"waits": 0, "streams": 3}
            started = time.monotonic()
            refused = client.sample_stream("free", 4, timeout=1.0)
            with pytest.raises(grpc.RpcError) as busy:
                next(refused)  # reopened within its 1 s, then given up
            assert busy.value.code() == grpc.StatusCode.UNAVAILABLE and "server is busy" in busy.value.details()
            assert 0.9 < time.monotonic() - started < 1.5  # its deadline, kept
            # Closed while it waits to be reopened: the iteration ends at once, without an error.
            refusals = server.servicer.rejected["SampleStream"]
            waiting = client.sample_stream("free", 4, timeout=30)
            ended: list = []
            reader = _in_thread(lambda: ended.append(list(waiting)), [])
            _poll(lambda: server.servicer.rejected["SampleStream"] > refusals, "refused too", [])
            closed_at = time.monotonic()
            waiting.close()
            reader.join(timeout=10)
            assert ended == [[]] and time.monotonic() - closed_at < 1
            # The workers kept free still serve short calls at once.
            assert client.describe("free")["episodes"] == 1 and len(client.sample("free", 4)["obs"]) == 4
            streams.pop().close()
            _poll(lambda: seats.taken["streams"] == 2, "a closed stream's seat freed", [])
            assert len(next(client.sample_stream("free", 4, timeout=10))["obs"]) == 4
    finally:
        for stream in streams:
            stream.close()
        server.stop(grace=0)


def test_samples_waiting_for_data_take_seats_too() -> None:
    buffer = EpisodicBuffer("empty", f"test{os.getpid()}", FIELDS, 1000)
    buffer.worker_seats = WorkerSeats(waits=1)
    result: dict[str, np.ndarray] = {}
    waiting = threading.Thread(target=lambda: result.update(buffer.sample(2, StatesMode(), wait_seconds=20)))
    try:
        waiting.start()
        deadline = time.monotonic() + 20
        while buffer.worker_seats.taken["waits"] < 1:
            assert time.monotonic() < deadline and waiting.is_alive()
            time.sleep(0.01)
        with pytest.raises(Unavailable, match="sample of buffer 'empty' \\(waiting for data\\): the server is busy"):
            buffer.sample(2, StatesMode(), wait_seconds=20)
        insert_episode(buffer, 5, 0)
        waiting.join(timeout=20)
        assert len(result["obs"]) == 2 and buffer.worker_seats.taken["waits"] == 0
        assert len(buffer.sample(2, StatesMode(), wait_seconds=20)["obs"]) == 2  # data there: no seat needed
    finally:
        waiting.join(timeout=20)
        buffer.close()


def test_a_cancelled_call_stops_waiting_and_gives_its_worker_back() -> None:
    """A learner that closes its stream (or an actor that gives up) while the server waits on its behalf:
    the wait ends at once, not at the call's deadline, so its worker and seat are free again."""
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}cancel", max_workers=8).start()
    failures: list[BaseException] = []
    try:
        seats = server.registry.worker_seats
        with ReplayClient(server.address, timeout=60) as client:
            client.create_buffer("empty", 1000, SCHEMA)
            client.create_buffer("rl", 1000, SCHEMA,
                                 rate_limiter=SampleToInsertRatio(1.0, error_buffer=5.0))
            client.insert_episode("rl", True, **_episode())
            client.insert_episode("rl", True, **_episode())
            stream = client.sample_stream("empty", 4, wait=True, timeout=60)  # waits for data
            reader = _in_thread(lambda: list(stream), failures)
            frames = spans_requests("rl", [episode_span(_episode(), True, ("obs",))], 2**20)
            held = client._insert.future(iter(frames), timeout=60)  # held back by the rate limiter
            _poll(lambda: seats.taken == {"waits": 1, "streams": 1}, "both waiting", failures)
            started = time.monotonic()
            stream.close()
            held.cancel()
            _poll(lambda: seats.taken == {"waits": 0, "streams": 0}, "seats given back", failures)
            assert time.monotonic() - started < 10  # not the calls' 60 s deadlines
            reader.join(timeout=10)
            assert not reader.is_alive() and not failures, failures
            assert client.describe("rl")["counters"]["inserted_episodes"] == 2  # the cancelled insert stored nothing
            assert server.servicer.rejected == {}  # cancelled calls are not counted as rejected
    finally:
        server.stop(grace=0)


def test_a_client_without_a_default_deadline_works() -> None:
    """gRPC reports a huge time_remaining() for calls without a deadline: a held insert waits without one
    (it failed with OverflowError, INTERNAL), and a sample asking to wait is told it needs a deadline."""
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}nodeadline").start()
    failures: list[BaseException] = []
    try:
        with ReplayClient(server.address, timeout=None) as client:
            client.create_buffer("b", 1000, SCHEMA)
            client.insert_episode("b", True, **_episode())
            assert client.describe("b")["episodes"] == 1
            assert client.sample("b", 4)["obs"].shape == (4, 4)
            assert len(list(client.sample_stream("b", 4, num_batches=2))) == 2
            client.create_buffer("rl", 1000, SCHEMA,
                                 rate_limiter=SampleToInsertRatio(1.0, error_buffer=5.0))
            client.insert_episode("rl", True, **_episode())
            client.insert_episode("rl", True, **_episode())
            held = _in_thread(lambda: client.insert_episode("rl", True, **_episode()), failures)
            _poll(lambda: client.describe("rl")["counters"]["rate_limiter.insert_waiting"] == 1, "held", failures)
            client.sample("rl", 4)
            client.sample("rl", 4)
            held.join(timeout=20)
            assert not failures and client.describe("rl")["episodes"] == 3, failures
            with pytest.raises(grpc.RpcError) as no_deadline:
                client.sample("b", 4, wait=True)
            assert no_deadline.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "needs a call deadline" in no_deadline.value.details()
    finally:
        server.stop(grace=0)
