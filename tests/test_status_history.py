"""The status page's history: quantiles from histogram buckets, and the samples the sampler keeps per buffer
(sampled by hand here, one `History.sample()` at a time; the HTTP tests run its thread)."""

from __future__ import annotations

import numpy as np
import pytest

from replayd.client import ReplayClient
from replayd.server.http.history import KEPT_SAMPLES, History, bucket_quantile, latency_quantiles
from replayd.server.server import ReplayServer

SCHEMA = {"obs": ("float32", (4,)), "reward": ("float32", ())}
INF = float("inf")


def _episode(client: ReplayClient, buffer: str, steps: int) -> None:
    client.insert_episode(buffer, True, obs=np.zeros((steps + 1, 4), np.float32), reward=np.ones(steps, np.float32))


def _history(server: ReplayServer) -> History:
    rpc = server.servicer.rpc_metrics
    return History(server.registry, (rpc.latency, rpc.message_latency))


def test_bucket_quantile_interpolates_within_the_bucket_as_prometheus_does() -> None:
    bounds = np.array([1.0, 2.0, 4.0, INF])
    # 10 observations in (0, 1], 10 in (1, 2], none above: the median is the first bucket's top, p75 halfway
    # through the second bucket.
    cumulative = np.array([10.0, 20.0, 20.0, 20.0])
    assert bucket_quantile(0.5, bounds, cumulative) == 1.0
    assert bucket_quantile(0.75, bounds, cumulative) == 1.5
    assert bucket_quantile(0.25, bounds, cumulative) == 0.5  # the first bucket starts at 0
    assert bucket_quantile(0.99, bounds, np.array([0.0, 0.0, 1.0, 3.0])) == 4.0  # in +inf: the last finite bound
    assert bucket_quantile(0.5, bounds, np.zeros(4)) is None  # no observation


def test_latency_quantiles_count_only_the_calls_since_the_last_sample() -> None:
    bounds = np.array([1.0, 2.0, INF])
    before = {"insert": np.array([100.0, 100.0, 100.0])}  # 100 fast calls, earlier
    now = {"insert": (bounds, np.array([100.0, 110.0, 110.0])), "sample": (bounds, np.array([4.0, 4.0, 4.0]))}
    insert_p50, insert_p99, sample_p50, sample_p99 = latency_quantiles(before, now)
    assert (insert_p50, insert_p99) == (1.5, pytest.approx(1.99))  # the 10 new calls, all in (1, 2]
    assert (sample_p50, sample_p99) == (0.5, pytest.approx(0.99))  # a group without an earlier count
    assert latency_quantiles(before, {}) == [None] * 4  # no calls of either kind
    restarted = {"insert": (bounds, np.array([1.0, 1.0, 1.0]))}  # lower than before: the series started again
    assert latency_quantiles(before, restarted)[:2] == [None, None]


def test_each_sample_holds_rates_ratio_latency_and_bytes(server: ReplayServer, client: ReplayClient) -> None:
    history = _history(server)
    client.create_buffer("cp", 1000, SCHEMA)
    history.sample()  # the baseline: no sample is kept before a second one can measure a rate
    assert history.snapshot()["buffers"] == {"cp": {column: [] for column in history.snapshot()["columns"]}}

    _episode(client, "cp", 10)  # 11 rows
    client.sample("cp", 8)
    client.sample("cp", 8)
    history.sample()
    cp = history.snapshot()["buffers"]["cp"]
    assert len(cp["t"]) == 1
    assert cp["inserts_per_s"][0] > 0 and cp["samples_per_s"][0] > 0
    assert cp["samples_per_s"][0] / cp["inserts_per_s"][0] == pytest.approx(16 / 11)  # one interval for both
    assert cp["replay_ratio"] == [16 / 11]
    assert cp["stored_bytes"] == [11 * (4 * 4 + 4)]
    assert cp["insert_p50"][0] > 0 and cp["insert_p99"][0] >= cp["insert_p50"][0]
    assert cp["sample_p50"][0] > 0 and cp["sample_p99"][0] >= cp["sample_p50"][0]

    history.sample()  # a second without calls: no rate, no latency; the ratio spans the last samples
    cp = history.snapshot()["buffers"]["cp"]
    assert cp["inserts_per_s"][1] == 0 and cp["samples_per_s"][1] == 0
    assert cp["insert_p50"][1] is None and cp["sample_p99"][1] is None
    assert cp["replay_ratio"][1] == 16 / 11
    assert cp["t"][1] >= cp["t"][0]  # wall time, which two samples within its resolution share


def test_the_ring_keeps_ten_minutes_and_the_ratio_ten_seconds(server: ReplayServer, client: ReplayClient) -> None:
    history = _history(server)
    client.create_buffer("cp", 100_000, SCHEMA)
    history.sample()
    _episode(client, "cp", 9)  # 10 rows, then only samples: the ratio over the last 10 samples still sees them
    for _ in range(10):
        client.sample("cp", 5)
        history.sample()
    ratios = history.snapshot()["buffers"]["cp"]["replay_ratio"]
    assert ratios == [5 / 10 * (i + 1) for i in range(10)]
    client.sample("cp", 5)
    history.sample()  # the insert falls out of the window
    assert history.snapshot()["buffers"]["cp"]["replay_ratio"][-1] is None
    for _ in range(KEPT_SAMPLES):
        history.sample()
    assert len(history.snapshot()["buffers"]["cp"]["t"]) == KEPT_SAMPLES


def test_a_buffer_created_again_starts_a_ring_of_its_own(server: ReplayServer, client: ReplayClient) -> None:
    history = _history(server)
    client.create_buffer("cp", 1000, SCHEMA)
    history.sample()
    _episode(client, "cp", 30)
    history.sample()
    client.delete_buffer("cp")
    client.create_buffer("cp", 1000, SCHEMA)
    _episode(client, "cp", 40)  # more rows than before: only the buffer's identity tells the rings apart
    history.sample()
    assert history.snapshot()["buffers"]["cp"]["t"] == []  # a new baseline, no rate against the old counters
    _episode(client, "cp", 4)
    history.sample()
    assert history.snapshot()["buffers"]["cp"]["replay_ratio"] == [0.0]
    client.delete_buffer("cp")
    history.sample()
    assert history.snapshot()["buffers"] == {}  # gone: its ring is dropped
