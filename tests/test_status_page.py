"""The status page rendered by headless Chromium: its script fetches /api/buffers and fills the table."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client import ReplayClient
from service.server import ReplayServer
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


def _episode(client: ReplayClient, steps: int) -> None:
    client.insert_episode("atari", True, obs=np.zeros((steps + 1, 4), np.float32),
                          reward=np.ones(steps, np.float32))


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


def test_status_page_without_token_says_unauthorized(page_server: ReplayServer, tmp_path: Path) -> None:
    dom = _chromium(f"http://127.0.0.1:{page_server.http.port}/", tmp_path / "profile", "--dump-dom")
    assert "unauthorized" in dom and "data-buffer" not in dom


def test_status_page_shows_no_negative_rate_when_counters_restart(page_server: ReplayServer, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer deleted and created again under its name starts its counters at 0: the page showed the
    drop as a negative inserts/s and samples/s (e.g. "-990") until its next refresh."""
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
