"""The status page rendered by headless Chromium: its script fetches /api/buffers and fills the table, draws a
row of charts per buffer from /api/history and a buffer's detail view from /api/buffers/<name>. The table is
read from the DOM Chromium dumps; the charts' data is read from the page's uPlot instances through Playwright,
driving the same Chromium."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from replayd.client import ReplayClient
from replayd.client.polling import wait_until
from replayd.server.server import ReplayServer
from replayd.wire.components import Prioritized, SampleToInsertRatio
from tests.conftest import TEST_INSTANCE

CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if (path := shutil.which(name))), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)")

TOKEN = "page-token"


def _chromium(url: str, profile: Path, *extra: str) -> str:
    # No sandbox: CI runs as root in a container. Virtual time lets the page's fetch and timers run
    # without waiting on the wall clock.
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
         f"--user-data-dir={profile}", "--virtual-time-budget=3000", *extra, url],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return result.stdout


def _row(dom: str, buffer: str) -> list[str]:
    match = re.search(rf'<tr data-buffer="{buffer}">(.*?)</tr>', dom, re.S)
    assert match, f"no row for {buffer!r} in the DOM:\n{dom[-2000:]}"
    return [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", match.group(1), re.S)]


@pytest.fixture
def page_server() -> Iterator[ReplayServer]:
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}page", http_address="127.0.0.1:0",
                          token=TOKEN).start()
    yield server
    server.stop(grace=0)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    yield page
    page.close()


def _episode(client: ReplayClient, steps: int) -> None:
    client.insert_episode("atari", True, obs=np.zeros((steps + 1, 4), np.float32),
                          reward=np.ones(steps, np.float32))


def _until(check: Callable[[], Any], what: str) -> Any:
    return wait_until(check, time.monotonic() + 30, what, delay=0.05)


def test_status_page_shows_buffers_and_updates(page_server: ReplayServer, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{page_server.http.port}/#token={TOKEN}"
    with ReplayClient(page_server.address, timeout=10, token=TOKEN) as client:
        client.create_buffer("atari", 1000, {"obs": ("float32", (4,)), "reward": ("float32", ())})
        _episode(client, 10)
        cells = _row(_chromium(url, tmp_path / "profile", "--dump-dom"), "atari")
        assert cells[:2] == ["atari", "episodic"]
        assert cells[2] == "1.1%" and cells[3:6] == ["11", "1,000", "1"]

        _episode(client, 20)
        cells = _row(_chromium(url, tmp_path / "profile", "--dump-dom"), "atari")
        assert cells[3:6] == ["32", "1,000", "2"]

        screenshot = tmp_path / "status.png"
        _chromium(url, tmp_path / "profile", f"--screenshot={screenshot}", "--window-size=1200,400")
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 5000


def test_status_page_shows_no_negative_rate_when_counters_restart(page_server: ReplayServer, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer deleted and created again under its name starts its counters at 0: the page shows no rate for
    the drop rather than a negative inserts/s and samples/s (e.g. "-990") until its next refresh."""
    with ReplayClient(page_server.address, timeout=10, token=TOKEN) as client:
        client.create_rollout_buffer("ppo", 4, 2, {"obs": ("float32", (3,))})
    buffer = page_server.registry.rollout("ppo")
    info, calls = buffer.info, iter(range(1000))

    def restarting_info() -> dict:  # each read of the counters sees them lower, as after a re-creation
        result = info()
        lower = 1000 - 100 * next(calls)
        result["counters"] = {**result["counters"], "pushed_steps": lower, "served_samples": lower}
        return result

    monkeypatch.setattr(buffer, "info", restarting_info)
    cells = _row(_chromium(f"http://127.0.0.1:{page_server.http.port}/#token={TOKEN}", tmp_path / "profile",
                           "--dump-dom"), "ppo")
    assert cells[:2] == ["ppo", "rollout"]
    assert next(calls) >= 2  # the page refreshed at least once after its first read
    assert cells[6:8] == ["-", "-"]


CHART = "name => { const c = window.replaydCharts[name]; return c && Object.fromEntries(" \
        "['throughput', 'ratio', 'latency', 'bytes'].map(k => [k, c[k].data])); }"


def test_each_buffer_gets_charts_whose_data_grows_with_inserts_and_samples(page_server: ReplayServer,
                                                                          page: Page) -> None:
    with ReplayClient(page_server.address, timeout=10, token=TOKEN) as client:
        client.create_buffer("atari", 1000, {"obs": ("float32", (4,)), "reward": ("float32", ())})
        client.create_rollout_buffer("ppo", 4, 2, {"obs": ("float32", (3,))})
        page.goto(f"http://127.0.0.1:{page_server.http.port}/#token={TOKEN}")
        # A first point before any insert: the rates of the points after it cover every insert and sample.
        _until(lambda: (page.evaluate(CHART, "atari") or {}).get("throughput", [[]])[0], "a first chart point")
        assert page.evaluate(CHART, "ppo") is not None  # a row of charts per buffer
        _episode(client, 10)
        for _ in range(3):
            client.sample("atari", 8)

        def grown() -> dict | None:
            charts = page.evaluate(CHART, "atari")
            _, inserts, samples = charts["throughput"]
            return charts if any(inserts[1:]) and any(samples[1:]) else None

        charts = _until(grown, "the atari charts showing the inserts and samples")
    times, inserts, samples = charts["throughput"]
    # The rates over each second add up to what was inserted and sampled (a point's rate covers the time since
    # the point before it).
    seconds = [b - a for a, b in itertools.pairwise(times)]
    assert sum(r * s for r, s in zip(inserts[1:], seconds, strict=True)) == pytest.approx(11, rel=0.05)
    assert sum(r * s for r, s in zip(samples[1:], seconds, strict=True)) == pytest.approx(24, rel=0.05)
    assert charts["ratio"][1][-1] == pytest.approx(24 / 11)
    assert charts["bytes"][1][-1] == 11 * (4 * 4 + 4)
    for quantiles in charts["latency"][1:]:  # insert p50, p99, sample p50, p99, in milliseconds
        assert any(v is not None and v > 0 for v in quantiles)


def test_the_detail_view_shows_a_buffers_configuration_and_state(page_server: ReplayServer, page: Page) -> None:
    with ReplayClient(page_server.address, timeout=10, token=TOKEN) as client:
        client.create_buffer("atari", 1000, {"obs": ("float32", (4,)), "reward": ("float32", ())},
                             sampler=Prioritized(alpha=0.6), rate_limiter=SampleToInsertRatio(2.0, 5, 50.0))
        client.create_rollout_buffer("ppo", 4, 2, {"obs": ("float32", (3,))})
        _episode(client, 10)
    page.goto(f"http://127.0.0.1:{page_server.http.port}/#token={TOKEN}")
    page.click('tr[data-buffer="atari"] a')  # the buffer's name in the table opens its detail view
    page.wait_for_selector("#detail:not([hidden]) #config tr")
    rows = lambda selector: [[cell.inner_text() for cell in tr.query_selector_all("td")]  # noqa: E731
                             for tr in page.query_selector_all(selector)]
    assert rows("#config tr") == [["capacity", "1,000 steps"], ["sampler", "prioritized (alpha 0.6)"],
                                  ["remover", "fifo"],
                                  ["rate limiter", "sample_to_insert_ratio (samples_per_insert 2, "
                                                   "min_size_to_sample 5, error_buffer 50)"],
                                  ["reward field", "reward"]]
    assert rows("#fields tbody tr") == [["obs", "float32", "(4)", "observation"], ["reward", "float32", "()", ""]]
    assert rows("#limiter tbody tr") == [["insert", "0", "0", "0.00 s"], ["sample", "0", "0", "0.00 s"]]
    histogram = _until(lambda: page.evaluate("() => window.replaydPriorities()?.data"), "the priority histogram")
    assert sum(histogram[1]) == 10  # every sampleable step, at the first priority (1)
    assert page.is_hidden("#rollout-box")

    page.goto(f"http://127.0.0.1:{page_server.http.port}/#token={TOKEN}&buffer=ppo")
    _until(lambda: page.inner_text("#detail-name") == "ppo" and page.query_selector("#rollout tr"), "ppo's view")
    assert rows("#rollout tr") == [["policy version", "0"], ["filled cells", "0 / 8"], ["complete", "no"],
                                   ["stale pushes refused", "0"]]
    assert page.is_hidden("#limiter-box") and page.is_hidden("#priorities-box")


def test_a_page_opened_without_the_token_asks_for_it_and_shows_no_data(page_server: ReplayServer,
                                                                       page: Page) -> None:
    with ReplayClient(page_server.address, timeout=10, token=TOKEN) as client:
        client.create_buffer("atari", 1000, {"obs": ("float32", (4,)), "reward": ("float32", ())})
    page.goto(f"http://127.0.0.1:{page_server.http.port}/")
    page.wait_for_selector("#signin:not([hidden])")
    assert page.is_hidden("#dashboard") and page.is_hidden("#refused")
    assert page.query_selector_all("tr[data-buffer]") == [] and page.evaluate("Object.keys(window.replaydCharts)") == []
    page.fill("#token", "wrong")
    page.click("#signin button")
    page.wait_for_selector("#refused:not([hidden])")
    assert page.is_hidden("#dashboard")
    page.fill("#token", TOKEN)
    page.click("#signin button")
    page.wait_for_selector('tr[data-buffer="atari"]')
    assert page.is_hidden("#signin")
