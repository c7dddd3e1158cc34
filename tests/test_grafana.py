"""deploy/grafana/replayd.json: a dashboard Grafana imports as is (its Prometheus data source asked for on import),
one row of panels per buffer, whose every query reads series that /metrics exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from replayd.client import ReplayClient
from replayd.server.server import ReplayServer
from replayd.wire.components import Prioritized, SampleToInsertRatio
from tests.conftest import TEST_INSTANCE

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "replayd.json"
SELECTOR = re.compile(r"\b([a-zA-Z_:][\w:]*)\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
DATA_SOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def _panels(dashboard: dict) -> list[dict]:
    return [panel for top in dashboard["panels"] for panel in (top, *top.get("panels", ()))]


def _queries(dashboard: dict) -> list[str]:
    queries = [target["expr"] for panel in _panels(dashboard) for target in panel.get("targets", ())]
    return queries + [variable["definition"] for variable in dashboard["templating"]["list"]]


@pytest.fixture
def scraped() -> Iterator[list]:
    """/metrics of a server whose buffers saw every call the dashboard charts: inserts and samples (single and
    streamed) of a prioritized buffer with a rate limiter, pushes and minibatches of a rollout buffer."""
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}grafana", http_address="127.0.0.1:0").start()
    steps, envs = 4, 2
    cells = {name: np.zeros((steps, envs), dtype) for name, dtype in
             (("reward", np.float32), ("value", np.float32), ("final_value", np.float32),
              ("terminated", np.bool_), ("truncated", np.bool_))}
    try:
        with ReplayClient(server.address) as client:
            client.create_buffer("per", 1000, {"obs": ("float32", (4,)), "reward": ("float32", ())},
                                 sampler=Prioritized(0.6), rate_limiter=SampleToInsertRatio(100.0, 1, 1000.0))
            client.insert_episode("per", True, obs=np.zeros((11, 4), np.float32), reward=np.ones(10, np.float32))
            client.sample("per", 8)
            list(client.sample_stream("per", 4, num_batches=2))
            client.create_rollout_buffer("ppo", steps, envs, {"obs": ("float32", (3,))})
            client.push_rollout("ppo", 0, 0, 0, bootstrap_value=np.zeros(envs, np.float32),
                                obs=np.zeros((steps, envs, 3), np.float32), **cells)
            list(client.rollout_minibatches("ppo", 4))
            with pytest.raises(grpc.RpcError):  # a stale push: the counter the rollout panel reads
                client.push_rollout("ppo", -1, 0, 0, obs=np.zeros((steps, envs, 3), np.float32), **cells)
        yield [sample for family in text_string_to_metric_families(
            httpx.get(f"http://127.0.0.1:{server.http.port}/metrics").text) for sample in family.samples]
    finally:
        server.stop(grace=0)


def test_the_dashboard_imports_as_is_with_a_row_per_buffer() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert [(i["name"], i["type"], i["pluginId"]) for i in dashboard["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")]
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert set(variables) == {"instance", "buffer"} and variables["buffer"]["multi"]
    rows = [panel for panel in dashboard["panels"] if panel["type"] == "row"]
    assert [row["repeat"] for row in rows] == ["buffer"]
    panels = _panels(dashboard)
    assert len({panel["id"] for panel in panels}) == len(panels)
    charts = [panel for panel in panels if panel["type"] != "row"]
    assert {panel["title"] for panel in charts} >= {"Inserts and samples per second", "Replay ratio",
                                                    "Latency p50 / p99", "Stored bytes"}
    for panel in charts:
        assert panel["datasource"] == DATA_SOURCE and panel["gridPos"]["w"] > 0, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATA_SOURCE and 'buffer="$buffer"' in target["expr"], panel["title"]


def test_every_metric_the_dashboard_queries_is_exported(scraped: list) -> None:
    exported = {sample.name for sample in scraped}
    queries = _queries(json.loads(DASHBOARD.read_text()))
    used = {name for query in queries for name, _ in SELECTOR.findall(query)}
    used |= {name for query in queries for name in re.findall(r"\breplayd_\w+", query)}
    assert used and used <= exported, sorted(used - exported)


def test_every_selector_of_the_dashboard_matches_a_series(scraped: list) -> None:
    """Label values count as much as names: a method the servicer does not name would chart nothing. `instance`
    is Prometheus's own label (added when it scrapes), not one of /metrics."""
    buffers = {"per", "ppo"}
    for query in _queries(json.loads(DASHBOARD.read_text())):
        for name, matchers in SELECTOR.findall(query):
            conditions = [(label, op, value) for label, op, value in MATCHER.findall(matchers) if label != "instance"]

            def matches(sample, buffer: str, conditions=conditions) -> bool:
                for label, op, value in conditions:
                    pattern = value.replace("$buffer", buffer)
                    found = sample.labels.get(label, "")
                    hit = re.fullmatch(pattern, found) if "~" in op else found == pattern
                    if bool(hit) == op.startswith("!"):
                        return False
                return True

            assert any(sample.name == name and matches(sample, buffer) for sample in scraped
                       for buffer in buffers), f"{name}{{{matchers}}}"
