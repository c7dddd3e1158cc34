"""A heartbeat file for liveness probes of actors and learners, which serve nothing a probe could ask.

`replayd actor|learn --heartbeat FILE` touches FILE as the process makes progress: an actor at every step and at
every poll while it waits (for the learner, a buffer, a shard), a learner at every report (at least once a second,
training or waiting for data). A process stuck anywhere stops touching it, and

    python -m replayd.client.heartbeat FILE --max-age SECONDS

exits 1 once FILE is older than SECONDS (or missing), 0 otherwise: a Kubernetes exec liveness probe.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Protocol


class StopEvent(Protocol):  # replayd.client.actors.common's (not imported: the probe stays light, without torch)
    def is_set(self) -> bool: ...


class Heartbeat:
    """Touches `path` (None: nothing) at the first beat and then at most every `every` seconds."""

    def __init__(self, path: str | os.PathLike | None, every: float = 5.0) -> None:
        self.path = None if path is None else Path(path)
        self.every = every
        self._last = -float("inf")
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.beat()

    def beat(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._last < self.every:
            return
        self._last = now
        self.path.touch()
        os.utime(self.path)  # touch() leaves the time of an existing file on some file systems


class BeatingStop:
    """A stop event whose every look (an actor's, at each step and each poll while it waits) is a heartbeat."""

    def __init__(self, stop: StopEvent, heartbeat: Heartbeat) -> None:
        self.stop, self.heartbeat = stop, heartbeat

    def is_set(self) -> bool:
        self.heartbeat.beat()
        return self.stop.is_set()


def age(path: str | os.PathLike) -> float | None:
    """Seconds since `path` was last touched (None: it does not exist)."""
    try:
        return time.time() - Path(path).stat().st_mtime
    except FileNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replayd.client.heartbeat",
                                     description="exit 1 when a heartbeat file is missing or older than --max-age")
    parser.add_argument("file")
    parser.add_argument("--max-age", type=float, required=True, help="seconds")
    args = parser.parse_args(argv)
    seconds = age(args.file)
    if seconds is None or seconds > args.max_age:
        state = "missing" if seconds is None else f"{seconds:.0f} s old"
        print(f"heartbeat {args.file}: {state} (at most {args.max_age:g} s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
