"""Deleting a buffer while other calls use it: they get NOT_FOUND, the server keeps serving.

Before the buffers guarded their arrays with a closed flag under their lock, a delete unmapped shared
memory under a running gather (or the stream's sample-ahead thread), and the server died of SIGSEGV.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import numpy as np
import pytest

from replayd.client import ReplayClient
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.limiters import SampleToInsertRatioLimiter
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.schema import Field
from replayd.wire.errors import NotFound

SCHEMA = {"obs": ("float32", (8,)), "action": ("int64", ()), "reward": ("float32", ())}


def fill(client: ReplayClient, name: str) -> None:
    client.create_buffer(name, 20_000, SCHEMA)
    rng = np.random.default_rng(0)
    episodes = [{"obs": rng.normal(size=(51, 8)).astype(np.float32), "action": np.zeros(50, np.int64),
                 "reward": np.ones(50, np.float32)} for _ in range(100)]
    client.insert_episodes(name, episodes, [True] * 100)


def delete_under_load(client: ReplayClient, name: str) -> list[grpc.StatusCode | None]:
    """Deletes `name` while a sample stream and an insert loop use it; returns how each call ended."""
    fill(client, name)
    started = threading.Barrier(3)
    codes: list[grpc.StatusCode | None] = []

    def sampler() -> None:
        stream = client.sample_stream(name, 256)
        try:
            next(stream)
            started.wait(timeout=30)
            for _ in stream:
                pass
            codes.append(None)
        except grpc.RpcError as exc:
            codes.append(exc.code())
        finally:
            stream.close()

    def inserter() -> None:
        started.wait(timeout=30)
        obs = np.zeros((51, 8), np.float32)
        try:
            while True:
                client.insert_episode(name, terminated=True, obs=obs, action=np.zeros(50, np.int64),
                                      reward=np.ones(50, np.float32))
        except grpc.RpcError as exc:
            codes.append(exc.code())

    threads = [threading.Thread(target=sampler), threading.Thread(target=inserter)]
    for thread in threads:
        thread.start()
    started.wait(timeout=30)
    client.delete_buffer(name)
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    return codes


def test_delete_during_streams_and_inserts_keeps_the_server_serving(client: ReplayClient) -> None:
    fill(client, "keep")
    for round_ in range(4):
        codes = delete_under_load(client, f"doomed{round_}")
        assert codes and all(code == grpc.StatusCode.NOT_FOUND for code in codes), codes
        assert client.describe("keep")["stored_steps"] > 0  # still serving
    batch = client.sample("keep", 32)
    assert batch["obs"].shape == (32, 8)


def test_close_wakes_a_waiting_sampler_with_not_found() -> None:
    buffer = EpisodicBuffer("waiting", f"test{os.getpid()}", [Field("obs", "float32", (), observation=True)], 64)
    errors: list[BaseException] = []

    def wait_for_data() -> None:
        try:
            buffer.sample(4, TransitionsMode(1, 0.9), wait_seconds=60)
        except BaseException as exc:  # the test inspects it
            errors.append(exc)

    thread = threading.Thread(target=wait_for_data)
    thread.start()
    deadline = time.monotonic() + 30
    while not buffer.inserted._waiters:  # the sampler is waiting on the condition (no sleep: a busy poll)
        assert thread.is_alive() and time.monotonic() < deadline, errors
        thread.join(timeout=0.001)
    buffer.close()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], NotFound)
    with pytest.raises(NotFound, match="was deleted"):
        buffer.insert({"obs": np.zeros(3, np.float32)}, Spans.whole_episodes(np.array([2]), [1], [True]))


@pytest.mark.parametrize("side", ["sample", "insert"])
def test_a_cancelled_wait_woken_after_the_buffer_closed_reads_nothing(side: str) -> None:
    """Stopping a server cancels its calls (their waits wake) and closes the buffers: a waiter that gets
    the lock back only after the close must not read the unmapped arrays (it crashed the server)."""
    fields = [Field("obs", "float32", (), observation=True), Field("reward", "float32", ())]
    limiter = SampleToInsertRatioLimiter(min_size_to_sample=1, samples_per_insert=1.0, error_buffer=2.0)
    buffer = EpisodicBuffer("cancelled", f"test{os.getpid()}", fields, 64, limiter=limiter)
    episode = {"obs": np.zeros(3, np.float32), "reward": np.ones(3, np.float32)}  # rows as the server gets them
    if side == "insert":  # two 2-step episodes: diff 4, and an insert waits while diff + 1 > max_diff = 3
        buffer.insert(episode, Spans.whole_episodes(np.array([2]), [1], [True]))
        buffer.insert(episode, Spans.whole_episodes(np.array([2]), [2], [True]))
    ended = threading.Event()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            if side == "sample":  # empty: the limiter holds the sample back
                buffer.sample(1, TransitionsMode(1, 0.9), wait_seconds=60, ended=ended)
            else:
                buffer.insert_result(episode, Spans.whole_episodes(np.array([2]), [3], [True]), timeout=60, ended=ended)
        except BaseException as exc:  # the test inspects it
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not buffer.inserted._waiters:
            assert thread.is_alive() and time.monotonic() < deadline, errors
            thread.join(timeout=0.001)
        with buffer.lock:  # the call ends and the buffer closes before the waiter gets the lock back
            ended.set()
            buffer.inserted.notify_all()
            buffer.close()
    finally:
        buffer.close()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], NotFound)
