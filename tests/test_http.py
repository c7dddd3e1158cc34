import sys
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import save

from replayd.client import ReplayClient
from replayd.client.polling import wait_until
from replayd.client.replay_client import episode_span, spans_requests
from replayd.server.grpc_server.metrics import RpcMetrics
from replayd.server.http.app import loopback_hosts
from replayd.server.server import ReplayServer
from replayd.wire import codec
from replayd.wire import replay_pb2 as pb
from replayd.wire import replay_pb2_grpc as pb_grpc
from replayd.wire.components import MinSize, Prioritized, SampleToInsertRatio
from tests.conftest import TEST_INSTANCE

SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}


def _episode(steps: int = 10) -> dict[str, np.ndarray]:
    return {"obs": np.zeros((steps + 1, 4), np.float32), "action": np.zeros(steps, np.int64),
            "reward": np.ones(steps, np.float32)}


def _metrics(base: str) -> tuple[dict[tuple[str, frozenset], float], dict[str, str]]:
    """Samples by (name, labels) and the type of each metric family."""
    samples, types = {}, {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples, types


def _value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _poll_metrics(base: str, ready, what: str, seconds: float = 10.0) -> tuple[dict, dict[str, str]]:
    """Scrapes until `ready(samples)` (calls are observed as they end, a moment after the client returns)."""
    deadline = time.monotonic() + seconds
    while not ready((scraped := _metrics(base))[0]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {seconds}s")
        time.sleep(0.005)
    return scraped


@pytest.fixture
def http_server():
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}http", http_address="127.0.0.1:0").start()
    try:
        yield server
    finally:
        server.stop(grace=0)


def test_health_metrics_buffers_and_status_page(http_server: ReplayServer) -> None:
    base = f"http://127.0.0.1:{http_server.http.port}"
    with ReplayClient(http_server.address) as client:
        client.create_buffer("cp", 1000, SCHEMA)
        client.insert_episode("cp", True, **_episode())
        client.sample("cp", 8)
    assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{base}/readyz").json()["buffers"] == 1
    buffers = httpx.get(f"{base}/api/buffers").json()["buffers"]
    assert buffers[0]["name"] == "cp" and buffers[0]["stored_steps"] == 11 and buffers[0]["sampled_items"] == 8
    assert buffers[0]["fill"] == 11 / 1000 and buffers[0]["capacity_steps"] == 1000
    metrics = httpx.get(f"{base}/metrics").text
    assert 'replayd_buffer_stored_steps{buffer="cp"} 11.0' in metrics
    assert 'replayd_buffer_counter{buffer="cp",counter="sampled_items"} 8.0' in metrics
    page = httpx.get(base).text
    assert "<title>replayd</title>" in page and "static/status.js" in page


def test_metrics_rpc_latency_bytes_and_buffer_counters(http_server: ReplayServer) -> None:
    base = f"http://127.0.0.1:{http_server.http.port}"
    with ReplayClient(http_server.address) as client:
        client.create_buffer("cp", 1000, SCHEMA)
        client.insert_episode("cp", True, **_episode())
        # in 3 chunks (requests of 2 rows of 28 bytes), one stream: 3 spans, one episode
        chunked = episode_span(_episode(5), False, ("obs",))
        assert len(spans_requests("cp", [chunked], max_request_bytes=56)) == 3
        client.insert(spans_requests("cp", [chunked], max_request_bytes=56))
        for _ in range(3):
            client.sample("cp", 8)
        assert len(list(client.sample_stream("cp", 4, num_batches=2))) == 2
        with pytest.raises(grpc.RpcError):
            client.update_priorities("no-such-buffer", [0], [1.0])
    stream = {"method": "SampleStream", "buffer": "cp"}
    samples, types = _poll_metrics(base, lambda m: _value(m, "replayd_rpc_latency_seconds_count", **stream),
                                   "SampleStream latency")
    value = lambda name, **labels: _value(samples, name, **labels)  # noqa: E731

    assert types["replayd_rpc_latency_seconds"] == "histogram"
    for method, calls in (("Insert", 2), ("Sample", 3), ("CreateBuffer", 1)):
        labels = {"method": method, "buffer": "cp"}
        assert value("replayd_rpc_latency_seconds_count", **labels) == calls
        assert value("replayd_rpc_latency_seconds_bucket", **labels, le="+Inf") == calls
        assert value("replayd_rpc_latency_seconds_bucket", **labels, le="1e-05") is not None  # 10 µs .. 10 s
        assert value("replayd_rpc_latency_seconds_bucket", **labels, le="10.0") is not None
        assert value("replayd_rpc_latency_seconds_sum", **labels) > 0
    assert value("replayd_rpc_latency_seconds_count", **stream) == 1
    assert value("replayd_rpc_stream_message_seconds_count", **stream) == 2
    # A name no buffer has is not a label value: clients cannot create series at will.
    assert value("replayd_rpc_latency_seconds_count", method="UpdatePriorities", buffer="") == 1
    assert not any(dict(labels).get("buffer") == "no-such-buffer" for _, labels in samples)

    assert types["replayd_rpc_received_bytes"] == "counter"
    assert value("replayd_rpc_received_bytes_total", method="Insert", buffer="cp") > 0
    assert value("replayd_rpc_sent_bytes_total", method="Sample", buffer="cp") > 0
    assert value("replayd_rpc_sent_bytes_total", **stream) > 0

    assert types["replayd_buffer_inserted_steps"] == "counter"
    assert types["replayd_buffer_stored_steps"] == "gauge"
    assert value("replayd_buffer_stored_steps", buffer="cp") == 17
    assert value("replayd_buffer_capacity_steps", buffer="cp") == 1000
    assert value("replayd_buffer_sampleable_steps", buffer="cp") == 15
    assert value("replayd_buffer_episodes", buffer="cp") == 2
    assert value("replayd_buffer_inserted_steps_total", buffer="cp") == 17
    assert value("replayd_buffer_inserted_episodes_total", buffer="cp") == 2  # terminated or truncated
    assert value("replayd_buffer_counter", buffer="cp", counter="inserted_spans") == 4
    assert value("replayd_buffer_sampled_items_total", buffer="cp") == 3 * 8 + 2 * 4
    assert value("replayd_buffer_sampled_batches_total", buffer="cp") == 5
    assert value("replayd_rejected_calls_total", rpc="UpdatePriorities") == 1
    assert types["replayd_rejected_calls"] == "counter"


def test_metrics_rate_limiter_waits(http_server: ReplayServer) -> None:
    base = f"http://127.0.0.1:{http_server.http.port}"
    with ReplayClient(http_server.address) as client:
        client.create_buffer("rl", 1000, SCHEMA, rate_limiter=MinSize(5))
        client.create_buffer("free", 1000, SCHEMA)
        # Below min_size_to_sample: a sample waits out its short deadline. The server waits the time left when
        # the call reaches it (after the first sample's describe) less a 0.2 s reply margin: 0.8 s keeps the
        # 0.1 s floor clear of a stall there.
        with pytest.raises(grpc.RpcError) as failed:
            client.sample("rl", 4, wait=True, timeout=0.8)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # A stalled server can answer after the client's own deadline, so the wait may end after the call did.
        scraped, _ = _poll_metrics(base, lambda m: _value(m, "replayd_rate_limiter_waits_total", buffer="rl",
                                                          side="sample") == 1, "the first sample wait")
        first = _value(scraped, "replayd_rate_limiter_wait_seconds_total", buffer="rl", side="sample")
        assert first >= 0.1
        # The seconds series carries the limiter's seconds, not its count of waits.
        assert first == pytest.approx(client.describe("rl")["counters"]["rate_limiter.sample_wait_seconds"])
        # A waiting sample, released by an insert from another thread.
        result = {}
        sampler = threading.Thread(target=lambda: result.update(client.sample("rl", 4, wait=True, timeout=10)))
        sampler.start()
        _poll_metrics(base, lambda m: _value(m, "replayd_rate_limiter_waiting", buffer="rl", side="sample") == 1,
                      "waiting sample")
        inserter = threading.Thread(target=lambda: client.insert_episode("rl", True, **_episode()))
        inserter.start()
        inserter.join(timeout=10)
        sampler.join(timeout=10)
        assert not sampler.is_alive() and result["obs"].shape == (4, 4)

    samples, _ = _poll_metrics(base, lambda m: _value(m, "replayd_rate_limiter_waits_total", buffer="rl",
                                                      side="sample") == 2, "two sample waits")
    seconds = _value(samples, "replayd_rate_limiter_wait_seconds_total", buffer="rl", side="sample")
    assert seconds > first
    with ReplayClient(http_server.address) as client:
        assert seconds == pytest.approx(client.describe("rl")["counters"]["rate_limiter.sample_wait_seconds"])
    assert _value(samples, "replayd_rate_limiter_waiting", buffer="rl", side="sample") == 0
    assert _value(samples, "replayd_rate_limiter_waits_total", buffer="rl", side="insert") == 0
    assert _value(samples, "replayd_rpc_latency_seconds_count", method="Sample", buffer="rl") == 2
    # Every buffer has a rate limiter (MinSize(1) unless chosen): its series are there, and nothing waited on it.
    assert _value(samples, "replayd_rate_limiter_waits_total", buffer="free", side="sample") == 0


def test_an_ipv6_http_address_reaches_uvicorn_without_brackets() -> None:
    """gRPC needs "[::1]:port"; uvicorn fails to resolve "[::1]" (not started here: CI may lack IPv6)."""
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}six", http_address="[::1]:0")
    try:
        assert server.http.host == "::1"
    finally:
        server.stop(grace=0)


def test_metrics_count_rollout_minibatch_rows(http_server: ReplayServer) -> None:
    """A rollout buffer's served minibatch rows are its sampled items on /metrics, as on /api/buffers."""
    base = f"http://127.0.0.1:{http_server.http.port}"
    steps, envs = 4, 2
    with ReplayClient(http_server.address) as client:
        client.create_rollout_buffer("ppo", steps, envs, {"obs": ("float32", (3,))})
        cells = {name: np.zeros((steps, envs), dtype) for name, dtype in
                 (("reward", np.float32), ("value", np.float32), ("final_value", np.float32),
                  ("terminated", np.bool_), ("truncated", np.bool_))}
        client.push_rollout("ppo", 0, 0, 0, bootstrap_value=np.zeros(envs, np.float32),
                            obs=np.zeros((steps, envs, 3), np.float32), **cells)
        assert sum(len(batch["obs"]) for batch in client.rollout_minibatches("ppo", 4, epochs=2)) == 16
    samples, types = _metrics(base)
    assert types["replayd_buffer_sampled_items"] == "counter"
    assert _value(samples, "replayd_buffer_sampled_items_total", buffer="ppo") == 16
    assert _value(samples, "replayd_buffer_inserted_steps_total", buffer="ppo") == steps * envs  # pushed steps
    stats = httpx.get(f"{base}/api/buffers").json()["buffers"][0]
    assert stats["sampled_items"] == 16 and stats["inserted_steps"] == steps * envs


def test_a_partly_pushed_rollout_shows_the_steps_it_holds(http_server: ReplayServer) -> None:
    """A rollout buffer's stored steps are the cells pushed so far (capacity less the missing ones), on
    /api/buffers (with its fill) and /metrics."""
    base = f"http://127.0.0.1:{http_server.http.port}"
    steps, envs = 4, 2
    with ReplayClient(http_server.address) as client:
        client.create_rollout_buffer("ppo", steps, envs, {"obs": ("float32", (3,))})
        part = {name: np.zeros((2, 1), dtype) for name, dtype in
                (("reward", np.float32), ("value", np.float32), ("final_value", np.float32),
                 ("terminated", np.bool_), ("truncated", np.bool_))}
        pushed = client.push_rollout("ppo", 0, 0, 0, obs=np.zeros((2, 1, 3), np.float32), **part)
        assert pushed == {"missing_steps": 6, "rollout_complete": False}  # 2 of the 8 cells
    stats = httpx.get(f"{base}/api/buffers").json()["buffers"][0]
    assert stats["kind"] == "rollout" and stats["capacity_steps"] == 8
    assert stats["stored_steps"] == 2 and stats["fill"] == 0.25 and stats["inserted_steps"] == 2
    samples, _ = _metrics(base)
    assert _value(samples, "replayd_buffer_stored_steps", buffer="ppo") == 2
    assert _value(samples, "replayd_buffer_capacity_steps", buffer="ppo") == 8


def test_byte_metrics_count_rollout_bootstraps_and_fetched_weights(http_server: ReplayServer) -> None:
    """Payload bytes: a push's steps and bootstrap values received, a fetch's weights sent."""
    base = f"http://127.0.0.1:{http_server.http.port}"
    steps, envs = 4, 2
    cells = {"obs": np.zeros((steps * envs, 3), np.float32)} | {
        name: np.zeros(steps * envs, dtype) for name, dtype in (("reward", np.float32), ("value", np.float32),
                                                                 ("final_value", np.float32), ("terminated", np.bool_),
                                                                 ("truncated", np.bool_))}
    push = pb.PushRolloutRequest(buffer="ppo", num_envs=envs, steps=codec.encode(cells),
                                 bootstrap=codec.encode({"value": np.zeros(envs, np.float32)}))
    blob = save({"weight": np.arange(300, dtype=np.float32)})
    with ReplayClient(http_server.address) as client, grpc.insecure_channel(http_server.address) as channel:
        client.create_rollout_buffer("ppo", steps, envs, {"obs": ("float32", (3,))})
        assert pb_grpc.ReplayStub(channel).PushRollout(push, timeout=20).rollout_complete
        assert client.publish_weights("policy", 1, blob)
        assert client.fetch_weights("policy").safetensors == blob
    samples, _ = _metrics(base)
    assert _value(samples, "replayd_rpc_received_bytes_total", method="PushRollout", buffer="ppo") == (
        len(push.steps) + len(push.bootstrap))
    assert _value(samples, "replayd_rpc_received_bytes_total", method="PublishWeights", buffer="") == len(blob)
    assert _value(samples, "replayd_rpc_sent_bytes_total", method="FetchWeights", buffer="") == len(blob)


def test_a_deleted_buffer_leaves_no_series_behind(http_server: ReplayServer) -> None:
    """Each deleted name kept 46 lines of /metrics: creating and deleting buffers grew it without end."""
    base = f"http://127.0.0.1:{http_server.http.port}"
    with ReplayClient(http_server.address) as client:
        for name in ("gone1", "gone2"):
            client.create_buffer(name, 1000, SCHEMA)
            client.insert_episode(name, True, **_episode())
            client.sample(name, 8)
            list(client.sample_stream(name, 8, num_batches=2))
        assert 'buffer="gone1"' in httpx.get(f"{base}/metrics").text
        client.delete_buffer("gone1")
        client.delete_buffer("gone2")
    metrics = httpx.get(f"{base}/metrics").text
    assert 'buffer="gone1"' not in metrics and 'buffer="gone2"' not in metrics
    assert 'replayd_rpc_latency_seconds_count{buffer="",method="DeleteBuffer"} 2.0' in metrics


def test_a_loopback_server_answers_only_loopback_host_headers(http_server: ReplayServer) -> None:
    """A page whose name DNS rebinding points at 127.0.0.1 sends its own name as Host: it could read
    /metrics and /api/buffers of a loopback server without a token."""
    base = f"http://127.0.0.1:{http_server.http.port}"
    assert httpx.get(f"{base}/api/buffers", headers={"host": "attacker.example"}).status_code == 400
    for host in ("127.0.0.1", "localhost", f"localhost:{http_server.http.port}"):
        assert httpx.get(f"{base}/api/buffers", headers={"host": host}).status_code == 200
    assert loopback_hosts("0.0.0.0") is None and loopback_hosts("server") is None  # compose: any name
    assert loopback_hosts("::1") == ["127.0.0.1", "[::1]", "localhost"]


def test_forgetting_a_deleted_buffer_while_other_calls_add_series() -> None:
    """DeleteBuffer's forget() walks the series cache while calls on other threads add to it, without 'dictionary
    changed size during iteration' (which would fail the delete with INTERNAL and keep its series)."""
    metrics = RpcMetrics(CollectorRegistry(), lambda name: True)
    for index in range(200):
        metrics.observe_latency("Sample", f"old{index}", 0.001)
    stop = threading.Event()

    def add_series() -> None:
        index = 0
        while not stop.is_set():
            metrics.observe_latency("Sample", f"new{index}", 0.001)
            index += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the race shows within a few forgets
    adder = threading.Thread(target=add_series)
    adder.start()
    try:
        for index in range(200):
            metrics.forget(f"old{index}")
    finally:
        stop.set()
        adder.join()
        sys.setswitchinterval(interval)
    assert not any(buffer.startswith("old") for _, _, buffer in metrics._children)


def test_readyz_says_not_ready_once_grpc_stops_serving() -> None:
    """/readyz answers 503 once stop() has stopped gRPC, for as long as the rest of stop() runs (the grace
    period, a checkpoint in progress, the sample workers): only the HTTP side is still up then."""
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}ready", http_address="127.0.0.1:0").start()
    base = f"http://127.0.0.1:{server.http.port}"
    stopping, release = threading.Event(), threading.Event()
    stop_workers = server.sample_workers.stop

    def held_stop() -> None:  # stop() calls it after gRPC has stopped, before the HTTP side stops
        stopping.set()
        release.wait(timeout=30)
        stop_workers()

    server.sample_workers.stop = held_stop
    stopper = threading.Thread(target=server.stop, kwargs={"grace": 0})
    try:
        assert httpx.get(f"{base}/readyz").status_code == 200
        stopper.start()
        assert stopping.wait(timeout=30)
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError):
            pb_grpc.ReplayStub(channel).ListBuffers(pb.ListBuffersRequest(), timeout=1)
        response = httpx.get(f"{base}/readyz")
        assert response.status_code == 503 and response.json() == {"status": "not serving"}
        assert httpx.get(f"{base}/healthz").status_code == 200  # alive: stopping is not a failure
    finally:
        release.set()
        if stopper.ident is None:  # failed before stopping it
            server.stop(grace=0)
        else:
            stopper.join(timeout=30)


def test_buffer_detail_shows_configuration_rate_limiter_and_priorities(http_server: ReplayServer) -> None:
    base = f"http://127.0.0.1:{http_server.http.port}"
    with ReplayClient(http_server.address) as client:
        client.create_buffer("per", 1000, SCHEMA, sampler=Prioritized(alpha=0.5),
                             rate_limiter=SampleToInsertRatio(4.0, 5, 100.0))
        client.insert_episode("per", True, **_episode(20))
        batch = client.sample("per", 20, include_keys=True, seed=0)
        keys = np.unique(batch["key"])
        client.update_priorities("per", keys, np.geomspace(0.01, 100.0, len(keys)))
    detail = httpx.get(f"{base}/api/buffers/per").json()
    assert detail["name"] == "per" and detail["kind"] == "episodic" and detail["rollout"] is None
    config = detail["config"]
    assert config["capacity_steps"] == 1000 and config["reward_field"] == "reward"
    assert config["sampler"] == {"kind": "prioritized", "alpha": 0.5}
    assert config["remover"] == {"kind": "fifo"}
    assert config["rate_limiter"] == {"kind": "sample_to_insert_ratio", "samples_per_insert": 4.0,
                                      "min_size_to_sample": 5, "error_buffer": 100.0}
    plain = {"stack": 1, "stack_axis": -1, "compression": None, "compression_level": None}
    assert config["fields"] == [{"name": "obs", "dtype": "float32", "shape": [4], "observation": True, **plain},
                                {"name": "action", "dtype": "int64", "shape": [], "observation": False, **plain},
                                {"name": "reward", "dtype": "float32", "shape": [], "observation": False, **plain}]
    assert detail["rate_limiter"] == {side: {"waiting": 0.0, "waits": 0.0, "wait_seconds": 0.0}
                                      for side in ("insert", "sample")}
    priorities = detail["priorities"]
    assert priorities["of"] == "priority" and priorities["steps"] == 20  # every sampleable step
    assert sum(priorities["counts"]) == 20 and len(priorities["edges"]) == len(priorities["counts"]) + 1
    # The updated ones span 0.01 .. 100 (log-spaced bins); the steps never drawn keep the first priority, 1.
    assert priorities["edges"][0] == pytest.approx(0.01) and priorities["edges"][-1] == pytest.approx(100.0)


def test_rollout_detail_shows_policy_version_filled_cells_and_stale_pushes(http_server: ReplayServer) -> None:
    base = f"http://127.0.0.1:{http_server.http.port}"
    steps, envs = 4, 2
    part = {name: np.zeros((2, 1), dtype) for name, dtype in
            (("reward", np.float32), ("value", np.float32), ("final_value", np.float32),
             ("terminated", np.bool_), ("truncated", np.bool_))}
    with ReplayClient(http_server.address) as client:
        client.create_rollout_buffer("ppo", steps, envs, {"obs": ("float32", (3,))}, gamma=0.9)
        client.finish_rollout("ppo", 2)
        client.push_rollout("ppo", 2, 0, 0, obs=np.zeros((2, 1, 3), np.float32), **part)
        with pytest.raises(grpc.RpcError):
            client.push_rollout("ppo", 1, 1, 0, obs=np.zeros((2, 1, 3), np.float32), **part)  # an older version
    detail = httpx.get(f"{base}/api/buffers/ppo").json()
    assert detail["kind"] == "rollout" and detail["rate_limiter"] is None and detail["priorities"] is None
    assert detail["rollout"] == {"policy_version": 2, "filled_cells": 2, "cells": 8, "rollout_complete": False,
                                 "stale_pushes": 1}
    config = detail["config"]
    assert (config["num_steps"], config["num_envs"], config["gamma"], config["capacity_steps"]) == (4, 2, 0.9, 8)
    assert {"name": "obs", "dtype": "float32", "shape": [3]} in config["fields"]
    assert {"name": "terminated", "dtype": "bool", "shape": []} in config["fields"]
    samples, _ = _metrics(base)
    assert _value(samples, "replayd_rollout_policy_version", buffer="ppo") == 2
    assert _value(samples, "replayd_buffer_stored_bytes", buffer="ppo") == 2 * (3 * 4 + 4 + 4 + 4 + 1 + 1)


def test_buffer_detail_of_a_missing_buffer_is_404_naming_it(http_server: ReplayServer) -> None:
    response = httpx.get(f"http://127.0.0.1:{http_server.http.port}/api/buffers/nope")
    assert response.status_code == 404 and "buffer 'nope' does not exist" in response.json()["detail"]


def test_history_samples_every_second_while_the_server_runs(http_server: ReplayServer) -> None:
    base = f"http://127.0.0.1:{http_server.http.port}"
    with ReplayClient(http_server.address) as client:
        client.create_buffer("cp", 1000, SCHEMA)
        client.insert_episode("cp", True, **_episode())

        def sampled() -> dict | None:
            client.sample("cp", 8)
            cp = httpx.get(f"{base}/api/history").json()["buffers"].get("cp")
            return cp if cp and any(cp["samples_per_s"]) else None

        cp = wait_until(sampled, time.monotonic() + 30, "a history sample with samples/s")
    assert httpx.get(f"{base}/api/history").json()["columns"] == list(cp)
    assert cp["stored_bytes"][-1] == 11 * (4 * 4 + 8 + 4)
    samples, _ = _metrics(base)
    assert _value(samples, "replayd_buffer_stored_bytes", buffer="cp") == 11 * (4 * 4 + 8 + 4)
