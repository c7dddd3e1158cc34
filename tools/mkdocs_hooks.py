"""MkDocs hooks (mkdocs.yml `hooks:`): pages hold markers that the build replaces with generated text.

    <!-- help: replayd serve -->        the command's --help, as argparse prints it, in a code block
    <!-- bench-results -->             the performance tables rendered from bench/results.jsonl (bench/report.py)

The help comes from the parsers themselves, in this process, so the reference cannot drift from the code;
a program the hook does not know, or a command whose --help fails, fails the build.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*(help|bench-results)(?::\s*(.*?))?\s*-->")
HELP_WIDTH = "80"  # argparse wraps its help to $COLUMNS


def _replayd(argv: list[str]) -> None:
    from replayd.server.cli import main

    main(argv)


def _demo(argv: list[str]) -> None:
    from replayd.client.demo import main

    main(argv)


# The commands a page may show the help of: the first words select the entry point, the rest are its arguments.
PROGRAMS: dict[str, Callable[[list[str]], None]] = {"replayd": _replayd, "python -m replayd.client.demo": _demo}


def command_help(command: str) -> str:
    """What `<command> --help` prints."""
    program = next((name for name in PROGRAMS if command == name or command.startswith(name + " ")), None)
    if program is None:
        raise PluginError(f"<!-- help: {command} -->: no such program (known: {', '.join(PROGRAMS)})")
    arguments = command[len(program):].split()
    output = io.StringIO()
    width = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        with contextlib.redirect_stdout(output):
            PROGRAMS[program]([*arguments, "--help"])
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise PluginError(f"`{command} --help` exited with {exc.code}") from None
    finally:
        if width is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = width
    text = output.getvalue().rstrip()
    if not text.startswith("usage:"):
        raise PluginError(f"`{command} --help` printed no usage: {text[:200]!r}")
    return text


def bench_results() -> str:
    from bench.report import RESULTS, render_page

    if not RESULTS.exists():
        raise PluginError(f"{RESULTS.relative_to(ROOT)} is missing: `make bench` writes it")
    return render_page(RESULTS, level=3)  # under the page's own "Results" heading


def _replace(match: re.Match, page: str) -> str:
    kind, argument = match.group(1), (match.group(2) or "").strip()
    if kind == "help":
        return f"```text\n{command_help(argument)}\n```"
    if argument:
        raise PluginError(f"{page}: <!-- bench-results --> takes no argument, got {argument!r}")
    return bench_results()


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda match: _replace(match, page.file.src_uri), markdown)


def on_serve(server, config, builder):
    """`mkdocs serve` rebuilds when the results change too."""
    server.watch(str(ROOT / "bench" / "results.jsonl"))
    return server
