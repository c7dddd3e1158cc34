"""The heartbeat file that liveness probes of actors and learners read (deploy/kubernetes): touched as the process
makes progress, at most every few seconds, and judged by its age."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from replayd.client import heartbeat as heartbeat_module
from replayd.client.actor import main as actor_main
from replayd.client.actors.common import ActorReport
from replayd.client.algos import ALGOS
from replayd.client.heartbeat import BeatingStop, Heartbeat, age
from replayd.client.learner import CARTPOLE_SCHEMA
from replayd.client.learner import main as learner_main
from replayd.client.learners.common import Progress

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_heartbeat_touches_its_file_at_once_then_at_most_every_interval(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(heartbeat_module.time, "monotonic", clock)
    path = tmp_path / "run" / "heartbeat"
    beat = Heartbeat(path, every=5.0)
    assert path.exists()  # created at once: a probe that starts before the first step finds it
    os.utime(path, (1, 1))
    clock.now += 4.0
    beat.beat()
    assert path.stat().st_mtime == 1  # within the interval: no write
    clock.now += 1.5
    beat.beat()
    assert age(path) < 60
    Heartbeat(None).beat()  # without a file: nothing


def test_every_look_at_a_beating_stop_event_is_a_heartbeat(tmp_path: Path) -> None:
    stop = threading.Event()
    path = tmp_path / "heartbeat"
    event = BeatingStop(stop, Heartbeat(path, every=0.0))
    os.utime(path, (1, 1))
    assert not event.is_set() and age(path) < 60
    stop.set()
    assert event.is_set()


def test_the_probe_fails_on_a_missing_or_stale_file_and_passes_on_a_fresh_one(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"

    def probe() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "replayd.client.heartbeat", str(path), "--max-age", "300"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)

    missing = probe()
    assert missing.returncode == 1 and "missing" in missing.stderr
    path.touch()
    assert probe().returncode == 0
    old = time.time() - 400
    os.utime(path, (old, old))
    stale = probe()
    assert stale.returncode == 1 and re.search(r"heartbeat: 4\d\d s old \(at most 300 s\)", stale.stderr)


def test_an_actor_beats_at_every_look_at_its_stop_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "heartbeat"
    looked: list[float | None] = []

    def actor(config: object, stop: BeatingStop) -> ActorReport:
        os.utime(path, (1, 1))  # made at the start; the actor's own looks touch it again
        stop.heartbeat.every = 0.0
        stop.is_set()
        looked.append(age(path))
        return ActorReport()

    monkeypatch.setitem(ALGOS, "dqn", dataclasses.replace(ALGOS["dqn"], actor=actor))
    actor_main(["--address", "127.0.0.1:1", "--heartbeat", str(path)])
    assert looked and looked[0] < 60


def test_a_learner_beats_at_every_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client) -> None:
    client.create_buffer("cartpole", 1000, CARTPOLE_SCHEMA)  # what the progress bar reads at each report
    path = tmp_path / "heartbeat"
    ages: list[float | None] = []

    def learn(config: object, report, finished) -> dict:
        os.utime(path, (1, 1))
        report(Progress(budget_seconds=1.0))  # the first report of a learner waiting for data
        ages.append(age(path))
        raise SystemExit(0)

    monkeypatch.setitem(ALGOS, "dqn", dataclasses.replace(ALGOS["dqn"], learn=learn))
    monkeypatch.setattr("replayd.client.learner.Heartbeat", functools.partial(Heartbeat, every=0.0))
    with pytest.raises(SystemExit):
        learner_main(["--address", client.address, "--heartbeat", str(path), "--run-dir", str(tmp_path / "run")])
    assert ages and ages[0] < 60
