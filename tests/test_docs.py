"""The documentation site: `mkdocs build --strict` passes (what `make docs` runs: a broken link, a missing page
or an unresolved docstring reference fails it), headless Chromium finds `ReplayClient.sample` on the built API
page, the command-line page holds every command's --help, the performance page shows every committed figure
beside its baseline, and the code examples of the guides run against a live server."""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench import report
from replayd.server.server import ReplayServer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as `make docs` builds it, into a folder of this test run."""
    folder = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}\n{built.stderr}"
    return folder


def page_text(site: Path, page: str) -> str:
    """A built page's text: tags removed, entities decoded, white space collapsed."""
    import html

    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", (site / page / "index.html").read_text())).split())


def test_the_site_builds_with_every_page_of_the_nav(site: Path) -> None:
    import yaml

    def pages(nav: list) -> Iterator[str]:
        for entry in nav:
            for value in (entry.values() if isinstance(entry, dict) else [entry]):
                yield from pages(value) if isinstance(value, list) else [value]

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = list(pages(config["nav"]))
    assert "batch-modes.md" in nav and "adding-a-batch-mode.md" in nav
    for source in nav:
        built = site / ("index.html" if source == "index.md" else source.removesuffix(".md") + "/index.html")
        assert built.is_file(), f"{source} was not built"
    markdown = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert markdown == set(nav), f"pages outside the nav, or nav entries without a page: {markdown ^ set(nav)}"


@pytest.fixture
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on a free loopback port."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)")
def test_the_api_page_lists_replay_client_sample_in_chromium(served: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})  # a desktop: the search bar shows
            page.goto(f"{served}/reference/client/")
            heading = page.locator('h2[id="replayd.client.ReplayClient"]'
                                   ' ~ * h3[id="replayd.client.ReplayClient.sample"]')
            assert heading.is_visible() and heading.locator(".doc-object-name").inner_text() == "sample"
            # its signature and docstring follow the heading; the page's table of contents links to it
            method = page.locator(".doc-object:has(> h3[id='replayd.client.ReplayClient.sample'])")
            assert "batch_size" in method.inner_text() and "One batch as read-only numpy arrays" in method.inner_text()
            assert page.locator('nav a[href="#replayd.client.ReplayClient.sample"]').count() >= 1
            page.click("input.md-search__input")  # the search index covers the API too
            page.keyboard.type("sample_stream")
            page.wait_for_selector(".md-search-result__item")
            assert "sample_stream" in page.inner_text(".md-search-result")
        finally:
            browser.close()


def test_the_command_line_page_holds_every_commands_help(site: Path) -> None:
    text = page_text(site, "reference/cli")
    for command in ("replayd", "replayd serve", "replayd actor", "replayd learn", "replayd segments", "replayd ray up",
                    "replayd ray status", "replayd ray run", "replayd ray down"):
        assert f"usage: {command} " in text, command
    assert "--checkpoint-every SECONDS" in text and "--sample-workers" in text and "--algo" in text
    assert "<!-- help:" not in (site / "reference/cli/index.html").read_text()


def test_the_performance_page_shows_each_figure_beside_its_baseline(site: Path) -> None:
    machine, records = report.load()
    assert machine is not None and records, "bench/results.jsonl holds a machine record and figures"
    text, tables = page_text(site, "performance"), report.render_tables(records)
    assert report.hardware_line(machine).replace("`", "") in text  # code spans lose their backticks
    for record in records:
        ours = report.figure(record["value"], record["unit"])
        if record.get("baseline"):
            beside = f"{ours} | {report.figure(record['baseline_value'], record['unit'])} | {record['baseline']} |"
            assert beside in tables, beside
            assert record["baseline"] in text
        assert ours in text, (record["case"], ours)


def test_benchmark_baselines_are_named_for_what_they_are() -> None:
    _, records = report.load()
    names = {record["baseline"] for record in records if record.get("baseline")}
    assert names, "the results compare figures with baselines"
    for name in names:
        assert not re.search(r"seed ?\d", name, re.I), f"baseline named by a nickname: {name!r}"
        assert not re.fullmatch(r"[\w.]+", name), f"baseline named by an identifier: {name!r}"
    assert any(name.startswith("ALLO episodic buffer") for name in names)
    assert any(name.startswith("esper-lite GAE") for name in names)


def test_a_section_puts_each_figure_beside_its_baseline_with_unit_and_ratio() -> None:
    records = [
        {"bench": "gae", "case": "T=2048,N=64 (target >= 10x)", "metric": "gae_ms", "value": 0.97, "unit": "ms",
         "baseline": "esper-lite GAE: vectorized over envs", "baseline_value": 32.0, "speedup": 33.0},
        {"bench": "gae", "case": "T=25,N=4", "metric": "gae_max_rel_error", "value": 1.5e-7, "unit": "ratio",
         "baseline": "", "baseline_value": 0.0, "speedup": 0.0},
        {"bench": "custom", "case": "a | b", "metric": "rate", "value": 1_270_000, "unit": "items/s",
         "baseline": "other", "baseline_value": 54_000, "speedup": 23.5},
    ]
    tables = report.render_tables(records, level=3)
    assert "### GAE and rollout memory" in tables and "### custom" in tables
    assert ("| T=2048,N=64 | `gae_ms` | 0.97 ms | 32 ms | esper-lite GAE: vectorized over envs | 33x | target >= 10x |"
            in tables)
    assert "| T=25,N=4 | `gae_max_rel_error` | 1.5e-07 ratio |  |  |  |  |" in tables
    assert "| a \\| b | `rate` | 1.27M items/s | 54,000 items/s | other | 24x |" in tables
    assert report.figure(17.2, "us") == "17.2 µs" and report.ratio({"baseline": "x", "speedup": 3138.2}) == "3,138x"


def test_the_hardware_line_names_cores_cpu_and_system() -> None:
    line = report.hardware_line({"bench": "machine", "cores": 2, "cpu": "Intel(R) Xeon(R) Processor", "arch": "x86_64",
                                 "system": "Linux", "memory_bytes": 24 * 2**30, "gpu": None, "quick": False})
    assert line == ("Measured on 2 cores of an x86-64 CPU (Intel(R) Xeon(R) Processor), 24 GiB of memory, no GPU, "
                    "Linux; full sizes (`make bench`).")


def test_the_readme_headline_table_is_the_one_rendered_from_the_committed_results() -> None:
    readme = (ROOT / "README.md").read_text()
    assert report.readme_with_summary(readme, report.summary()) == readme, (
        "the README's headline table differs from bench/results.jsonl: `python -m bench.report --readme` rewrites it")
    assert "](docs/performance.md)" in readme or "performance/" in readme


def python_blocks(page: str, title: str | None = None) -> list[str]:
    """The ```python code blocks of a docs page (those with the given title, when one is given)."""
    head = rf'```python title="{re.escape(title)}"' if title else r"```python"
    return re.findall(head + r"\n(.*?)```", (DOCS / page).read_text(), re.S)


def edited(snippet: str, old: str, new: str) -> str:
    assert snippet.count(old) == 1, f"the example no longer has exactly one {old!r}"
    return snippet.replace(old, new)


def run(snippet: str, name: str, namespace: dict) -> dict:
    exec(compile(snippet, name, "exec"), namespace)
    return namespace


def test_the_home_pages_example_runs(server: ReplayServer) -> None:
    (example,) = python_blocks("index.md")
    namespace = {}
    try:
        run(edited(example, '"127.0.0.1:50051"', repr(server.address)), "docs/index.md", namespace)
        assert namespace["batch"]["weight"].shape == (32,)
        assert namespace["rc"].describe("cartpole")["episodes"] == 1
    finally:
        if "rc" in namespace:
            namespace["rc"].close()


def test_the_client_guides_examples_run(server: ReplayServer) -> None:
    """The guide's examples as written; the test supplies only the server's address, the arrays the snippets
    take as given (obs, action, reward for an episode; o, a, r, final_obs for a step; a safetensors blob),
    episodes in the learner's buffer before it samples (actors would have written them), and a `break` that
    ends each endless loop after its first batch."""
    from safetensors.numpy import save

    actor_side, learner_side, weights = python_blocks("using-the-client.md")
    actor_side = edited(actor_side, '"127.0.0.1:50051"', repr(server.address))
    actor_side = edited(actor_side, "\n    ...\n", "\n    streamed = batch\n    break\n")
    learner_side = edited(learner_side, "\ntrainer = DQNTrainer(",
                          '\nrc.insert_episode("cartpole", terminated=True, **cartpole_episode)\ntrainer = DQNTrainer(')
    learner_side = edited(learner_side, "+ 1e-3)\n", "+ 1e-3)\n    break\n")

    rng = np.random.default_rng(0)
    steps = 10
    namespace = {
        "obs": rng.integers(0, 256, (steps + 1, 84, 84), dtype=np.uint8),  # one frame per state
        "action": rng.integers(0, 4, steps),
        "reward": rng.random(steps, dtype=np.float32),
        "o": rng.integers(0, 256, (4, 84, 84), dtype=np.uint8),  # a frame-stacking wrapper's observation
        "a": 1,
        "r": 0.5,
        "final_obs": rng.integers(0, 256, (84, 84), dtype=np.uint8),
        "cartpole_episode": {"obs": rng.random((21, 4), dtype=np.float32), "action": rng.integers(0, 2, 20),
                             "reward": np.ones(20, dtype=np.float32)},
        "blob": save({"w": np.ones(3, np.float32)}),
    }
    try:
        run(actor_side, "docs/using-the-client.md: actors", namespace)
        batch, pairs, streamed = namespace["batch"], namespace["pairs"], namespace["streamed"]
        assert batch["obs"].shape == (32, 4, 84, 84)  # the frames stacked at sample time
        assert batch["bootstrap_obs"].shape == (32, 4, 84, 84)
        assert pairs["future_obs"].shape == (256, 4, 84, 84)
        assert (pairs["offset"] >= 1).all()
        assert streamed["next_obs"].shape == (32, 4, 84, 84)
        # the writer's one-step episode landed beside the inserted one
        assert namespace["rc"].describe("atari")["episodes"] == 2

        run(learner_side, "docs/using-the-client.md: the learner", namespace)
        assert namespace["out"]["td_error"].shape == (256,)

        run(weights, "docs/using-the-client.md: weights", namespace)
        assert namespace["fetched"].version == 7 and namespace["fetched"].safetensors == namespace["blob"]
    finally:
        if "rc" in namespace:
            namespace["rc"].close()


def test_the_migration_guides_replayd_examples_run(server: ReplayServer) -> None:
    examples = python_blocks("migrating.md", "replayd")
    assert len(examples) == 2  # beside Reverb's and beside TorchRL's
    rng = np.random.default_rng(0)
    for number, example in enumerate(examples):
        namespace = {"obs": rng.random((21, 4), dtype=np.float32), "action": rng.integers(0, 2, 20),
                     "reward": np.ones(20, np.float32), "td_error": rng.standard_normal(32)}
        try:
            run(edited(example, '"127.0.0.1:50051"', repr(server.address)), f"docs/migrating.md #{number}", namespace)
            assert namespace["weight"].shape == (32,) and namespace["target"].shape == (32,)
            applied, _ = namespace["rc"].update_priorities("cartpole", namespace["batch"]["key"], np.ones(32))
            assert applied == 32
            namespace["rc"].delete_buffer("cartpole")
        finally:
            if "rc" in namespace:
                namespace["rc"].close()
