from __future__ import annotations

import contextlib
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from replayd.client import ReplayClient
from replayd.client.loader import Loader, to_tensors
from replayd.client.polling import wait_until


def _drain(loader: Loader, seconds: float = 10) -> list[dict[str, torch.Tensor]]:
    """Every batch `loader` yields, failing (not hanging the suite) if its iteration does not end in time."""
    got: list[dict[str, torch.Tensor]] = []
    raised: list[BaseException] = []
    ended = threading.Event()

    def consume() -> None:
        try:
            got.extend(loader)
        except BaseException as exc:  # raised in the test's thread below
            raised.append(exc)
        finally:
            ended.set()

    threading.Thread(target=consume, daemon=True).start()
    if not ended.wait(seconds):
        loader.close()  # ends the consumer waiting for a batch
        raise AssertionError(f"the loader's iteration did not end within {seconds} s")
    if raised:
        raise raised[0]
    return got


def test_loader_delivers_every_batch_in_order_once() -> None:
    batches = [{"obs": np.full((4, 3), i, np.float32), "i": np.array([i])} for i in range(50)]
    loader = Loader(iter(batches), device="cpu", prefetch=3)
    got = [int(batch["i"][0]) for batch in _drain(loader)]
    assert got == list(range(50))


def test_loader_tensors_on_the_cpu_are_views_of_the_batches_not_copies() -> None:
    batches = [{"obs": np.full((4, 3), i, np.float32), "i": np.array([i])} for i in range(3)]
    for batches_in, tensors in zip(batches, _drain(Loader(iter(batches), device="cpu")), strict=True):
        for name, array in batches_in.items():
            assert np.shares_memory(tensors[name].numpy(), array), name
    read_only = np.arange(6, dtype=np.float32)
    read_only.flags.writeable = False  # as decoded arrays are
    assert np.shares_memory(to_tensors({"x": read_only}, "cpu")["x"].numpy(), read_only)


def test_a_loader_refuses_a_prefetch_below_one() -> None:
    for prefetch in (0, -1):
        with pytest.raises(ValueError, match=f"prefetch must be >= 1, got {prefetch}"):
            Loader(iter([]), prefetch=prefetch)
    assert _drain(Loader(iter([{"i": np.zeros(1)}]), prefetch=1))[0]["i"].shape == (1,)


def test_loader_over_a_server_stream_is_zero_copy(client: ReplayClient) -> None:
    client.create_buffer("b", 1000, {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())})
    rng = np.random.default_rng(0)
    client.insert_episode("b", terminated=True, obs=rng.normal(size=(11, 4)).astype(np.float32),
                          action=rng.integers(0, 2, 10), reward=np.ones(10, np.float32))
    loader = Loader(client.sample_stream("b", 32, num_batches=10, seed=1), device="cpu")
    batches = list(loader)
    assert len(batches) == 10
    assert all(b["obs"].shape == (32, 4) and b["obs"].dtype == torch.float32 for b in batches)
    expected = list(client.sample_stream("b", 32, num_batches=10, seed=1))
    for got, want in zip(batches, expected, strict=True):
        np.testing.assert_array_equal(got["obs"].numpy(), want["obs"])
        assert got["bootstrap_obs"] is got["next_obs"]  # sent once for 1-step samples, and kept one tensor


def test_an_aliased_field_is_moved_to_the_device_once() -> None:
    next_obs = np.ones((4, 3), np.float32)
    batch = {"obs": np.zeros((4, 3), np.float32), "next_obs": next_obs, "bootstrap_obs": next_obs}
    for device in ("cpu", "meta", torch.device("cpu")):  # meta: a device other than the CPU, without one
        tensors = to_tensors(batch, device)
        assert tensors["bootstrap_obs"] is tensors["next_obs"]
        assert tensors["obs"] is not tensors["next_obs"]
        assert {t.device for t in tensors.values()} == {torch.device(device)}


def test_loader_raises_source_errors_in_the_consumer() -> None:
    def broken():
        yield {"x": np.zeros(2)}
        raise RuntimeError("stream broke")

    loader = Loader(broken())
    iterator = iter(loader)
    next(iterator)
    try:
        next(iterator)
    except RuntimeError as exc:
        assert "stream broke" in str(exc)
    else:
        raise AssertionError("the source's error was swallowed")


def test_close_while_the_thread_runs_a_generator_source() -> None:
    """The loader's thread is inside the generator when close() is called: the generator must be closed by
    that thread after its batch ("generator already executing" otherwise), and close() must not raise."""
    loader_ref: list[Loader] = []
    entered, registered, finalized = threading.Event(), threading.Event(), threading.Event()

    def source():
        try:
            yield {"i": np.zeros(1)}
            entered.set()
            assert registered.wait(timeout=10)  # the thread may get here before the loader is in loader_ref
            assert loader_ref[0]._stop.wait(timeout=10)  # still executing when close() sets the flag
            yield {"i": np.ones(1)}
        finally:
            finalized.set()

    loader = Loader(source(), prefetch=1)
    loader_ref.append(loader)
    registered.set()
    batches = iter(loader)  # held: dropping a started iterator closes the loader itself
    next(batches)
    assert entered.wait(timeout=10)
    loader.close()
    assert finalized.is_set() and not loader._thread.is_alive()


def test_close_cancels_a_server_stream_the_thread_waits_on(client: ReplayClient) -> None:
    """An empty buffer and wait=True: the thread blocks in the stream until close() cancels the call."""
    client.create_buffer("empty", 100, {"obs": ("float32", (2,)), "action": ("int64", ())})
    stream = client.sample_stream("empty", 8, wait=True, timeout=60)
    loader = Loader(stream)
    loader.close()
    assert not loader._thread.is_alive()
    assert list(stream) == []  # a closed stream ends instead of raising CANCELLED
    assert list(loader) == []  # the cancellation is not raised to the consumer: the loader just ends


def test_close_ends_a_local_reader_stream_the_thread_waits_on(client: ReplayClient) -> None:
    """The same with a LocalReader's stream: close() returns at once and ends the thread, rather than wait out
    the join's timeout and leave the thread polling the empty buffer until it is deleted."""
    from replayd.client.local_reader import LocalReader

    client.create_buffer("empty", 100, {"obs": ("float32", (2,)), "action": ("int64", ())})
    with LocalReader(client, "empty") as reader:
        stream = reader.sample_stream(8, wait=True)
        loader = Loader(stream)
        wait_until(lambda: loader._thread.is_alive(), time.monotonic() + 10, "the loader's thread")
        started = time.monotonic()
        loader.close()
        assert time.monotonic() - started < 2 and not loader._thread.is_alive()
        assert list(stream) == [] and list(loader) == []


def test_close_with_a_full_queue_and_an_ended_source_returns_at_once() -> None:
    """The thread waits to queue the end marker (or the source's error) behind unread batches: close() must
    stop it there, not wait out its join timeout."""

    def ends_with_error():
        yield from ({"i": np.array([i])} for i in range(2))
        raise RuntimeError("source failed")

    for source in (iter([{"i": np.array([i])} for i in range(2)]), ends_with_error()):
        loader = Loader(source, prefetch=2)
        deadline = time.monotonic() + 10
        while not loader._queue.full():  # both batches queued; the thread now waits to queue the end
            assert time.monotonic() < deadline, "the loader never filled its queue"
            time.sleep(0.001)
        started = time.monotonic()
        loader.close()
        assert time.monotonic() - started < 2 and not loader._thread.is_alive()
        assert list(loader) == []  # a closed loader yields nothing more (and does not block)


def test_an_exhausted_loader_iterates_empty_instead_of_blocking() -> None:
    loader = Loader(iter([{"i": np.array([0])}]))
    assert len(_drain(loader)) == 1
    assert _drain(loader) == []


def _endless_stream(client: ReplayClient):
    """A server stream that never ends by itself (num_batches=0): only closing it ends the call."""
    client.create_buffer("b", 100, {"obs": ("float32", (2,)), "action": ("int64", ())})
    client.insert_episode("b", True, obs=np.zeros((11, 2), np.float32), action=np.zeros(10, np.int64))
    return client.sample_stream("b", 8, timeout=60)


@pytest.mark.parametrize("leave", ["break", "raise", "drop the iterator"])
def test_leaving_the_iteration_early_closes_the_loader_and_its_stream(client: ReplayClient, leave: str) -> None:
    """A learner that stops consuming without close() must not leave the thread and the server stream open
    (enough of them and the server refuses new streams)."""
    stream = _endless_stream(client)
    loader = Loader(stream, prefetch=2)
    if leave == "drop the iterator":
        next(iter(loader))
    else:
        with contextlib.suppress(RuntimeError):
            for step, _ in enumerate(loader):
                if step == 3:
                    if leave == "break":
                        break
                    raise RuntimeError("the learner failed")
    assert not loader._thread.is_alive()
    assert list(stream) == []  # closed (a stream still open would never end)


def test_a_with_block_closes_the_loader(client: ReplayClient) -> None:
    stream = _endless_stream(client)
    with Loader(stream) as loader:
        pass
    assert not loader._thread.is_alive()
    assert list(stream) == []


def test_a_loader_dropped_unclosed_is_collected_and_closes_its_stream(client: ReplayClient) -> None:
    """Its thread holds the source and the queue, not the Loader."""
    stream = _endless_stream(client)
    loader = Loader(stream)
    thread, collected = loader._thread, weakref.ref(loader)
    del loader
    assert collected() is None
    assert not thread.is_alive()
    assert list(stream) == []


class _OneBatchThenWaits:
    """One batch, then none until closed, from any thread (as a server stream waiting for data)."""

    def __init__(self) -> None:
        self.batches = iter([{"i": np.zeros(1)}])
        self.closed = threading.Event()

    def __iter__(self) -> _OneBatchThenWaits:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self.batches, None)
        if batch is None:
            self.closed.wait(timeout=30)
            raise StopIteration
        return batch

    def close(self) -> None:
        self.closed.set()


def test_close_from_another_thread_ends_a_consumer_waiting_for_a_batch() -> None:
    """The consumer waits in next() for a batch the source has not produced: close() must end its iteration
    (StopIteration) instead of leaving it blocked."""
    loader = Loader(_OneBatchThenWaits())
    got: list[object] = []

    def consume() -> None:
        for batch in loader:
            got.append(batch)
        got.append("ended")

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    wait_until(lambda: got, time.monotonic() + 10, "the first batch")  # the consumer then waits for the second
    loader.close()
    consumer.join(timeout=10)
    assert not consumer.is_alive(), "the consumer stayed blocked after close()"
    assert len(got) == 2 and got[1] == "ended"


def test_prepare_rewrites_each_batch_in_the_loaders_thread_before_its_tensors_are_made() -> None:
    threads = []

    def prepare(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        threads.append(threading.current_thread().name)
        return {**batch, "double": batch["i"] * 2}

    batches = [{"i": np.array([i])} for i in range(5)]
    got = _drain(Loader(iter(batches), prepare=prepare))
    assert [int(b["double"][0]) for b in got] == [0, 2, 4, 6, 8]
    assert all(isinstance(b["double"], torch.Tensor) for b in got)
    assert threads == ["replayd-loader"] * 5


def test_an_error_in_prepare_reaches_the_consumer() -> None:
    def prepare(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise ValueError("compute_reward: bad shape")

    with pytest.raises(ValueError, match="compute_reward: bad shape"):
        _drain(Loader(iter([{"i": np.zeros(1)}]), prepare=prepare))
