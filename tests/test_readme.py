"""The README's quickstart runs as written against a live server, and the README stays the short entry point
that links into the documentation.

The test changes only what a reader supplies: the server's address, and a `break` that ends the endless
training loop after its first batch. A README edit that breaks the example, or moves what these edits
expect, fails here. The guides' longer examples run in tests/test_docs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from replayd.server.server import ReplayServer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def quickstart() -> str:
    text = README.read_text()
    section = text[text.index("\n## Quickstart\n"):text.index("\n## Architecture\n")]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return snippet


def edited(snippet: str, old: str, new: str) -> str:
    assert snippet.count(old) == 1, f"the README example no longer has exactly one {old!r}"
    return snippet.replace(old, new)


def test_the_quickstart_runs(server: ReplayServer) -> None:
    snippet = edited(quickstart(), '"127.0.0.1:50051"', repr(server.address))
    snippet = edited(snippet, "+ 1e-3)\n", "+ 1e-3)\n    break\n")
    namespace: dict = {}
    try:
        exec(compile(snippet, "README: Quickstart", "exec"), namespace)
        assert namespace["out"]["td_error"].shape == (256,)
        assert namespace["rc"].describe("cartpole")["episodes"] == 1
        assert set(namespace["batch"]) >= {"obs", "action", "reward", "n_step_return", "key", "weight"}
    finally:
        if "rc" in namespace:
            namespace["rc"].close()


def test_the_readme_is_short_and_its_links_reach_the_documentation() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert text.index("make demo") < text.index("## Quickstart") and "make test" in text
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert links and not missing, missing
    assert "docs/performance.md" in links
