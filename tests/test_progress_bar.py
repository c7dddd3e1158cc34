"""The run's progress: the learner's reports (every curve point, and once a second between them), the progress bar
over the training budget with its postfix and summary line, and the demo's mid-run screenshot of the status page."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from replayd.client import status_screenshot
from replayd.client.learners.common import Progress, Tracker
from replayd.client.progress_bar import ProgressBar
from replayd.client.status_screenshot import MidRunScreenshot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """time.monotonic as the test sets it (the tracker and the bar read it; tqdm reads time.time)."""
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


def test_the_tracker_reports_each_curve_point_and_once_a_second_between(clock: Clock) -> None:
    reports: list[tuple[bool, float, int, float | None, float | None]] = []

    def report(progress: Progress) -> None:
        reports.append((progress.training, progress.seconds, progress.learner_steps, progress.score,
                        progress.best_score))

    tracker = Tracker(300.0, "eval_return", report, waiting=lambda: None)
    clock.now += 1.5
    tracker.still_waiting()  # waiting for data: reported, with no training time yet
    assert reports == [(False, 0.0, 0, None, None)]
    tracker.start_clock()
    for _ in range(10):  # 10 steps, 0.3 s apart: a report at 1.2 s and at 2.4 s
        clock.now += 0.3
        tracker.stepped()
    assert [(seconds, steps) for _, seconds, steps, _, _ in reports[1:]] == [(pytest.approx(1.2), 4),
                                                                               (pytest.approx(2.4), 8)]
    assert tracker.progress.steps_per_second == pytest.approx(4 / 1.2)
    tracker.record(300.0, 5000)
    tracker.record(200.0, 6000)  # a dip: the last score falls, the best stays
    assert reports[-2:] == [(True, pytest.approx(3.0), 10, 300.0, 300.0), (True, pytest.approx(3.0), 10, 200.0, 300.0)]
    assert tracker.progress.budget_seconds == 300.0 and len(tracker.progress.curve) == 2


class FakeClient:
    def __init__(self) -> None:
        self.counters = {"inserted_rows": 0.0, "sampled_items": 0.0}

    def describe(self, buffer: str) -> dict:
        assert buffer == "cartpole"
        return {"counters": dict(self.counters)}


def test_the_bar_runs_over_the_budget_and_shows_scores_rates_and_the_replay_ratio(clock: Clock) -> None:
    client = FakeClient()
    checks = []
    bar = ProgressBar(client, "cartpole", ("inserted_rows", "sampled_items"), "greedy return", 300.0,
                      check=lambda: checks.append(1))
    assert bar.bar is None  # nothing drawn before the first report
    bar(Progress(budget_seconds=300.0))
    assert bar.bar.n == 0 and bar.bar.postfix.startswith("waiting for data, greedy return - (best -)")
    client.counters = {"inserted_rows": 2000.0, "sampled_items": 20000.0}
    clock.now += 2.0
    bar(Progress(training=True, seconds=42.4, steps_per_second=250.0, score=212.0, best_score=480.5,
                 budget_seconds=300.0))
    assert bar.bar.n == pytest.approx(42.4) and bar.bar.total == 300.0
    assert bar.bar.postfix == ("greedy return 212 (best 480.5), learner 250 steps/s, inserts 1.00k/s, "
                               "samples 10.0k/s, replay ratio 10.0")
    assert "42/300 s" in str(bar.bar)
    assert len(checks) == 2
    summary = {"solved": True, "seconds": 47.0, "learner_steps": 11750, "env_steps": 28311,
               "buffer": {"counters": {"inserted_rows": 3000.0, "sampled_items": 36000.0}}}
    bar.close()
    assert bar.summary_line(summary) == ("solved in 47 s: greedy return 212 (best 480.5), 28,311 env steps, "
                                         "11,750 learner steps (250/s), replay ratio 12.0")
    assert bar.summary_line({**summary, "solved": False}).startswith("budget of 300 s spent: greedy return 212")


def test_the_rates_cover_the_last_seconds_only(clock: Clock) -> None:
    client = FakeClient()
    bar = ProgressBar(client, "cartpole", ("inserted_rows", "sampled_items"), "greedy return", 300.0)
    for second in range(20):  # 100 inserts/s for 10 s, then 1,000/s
        client.counters["inserted_rows"] += 100.0 if second < 10 else 1000.0
        clock.now += 1.0
        bar(Progress(training=True, seconds=float(second)))
    assert "inserts 1.00k/s" in bar.bar.postfix
    bar.close()


class FakeShardedClient:
    """A merged description over shards: the sums over the shards up, and each shard's own."""

    def __init__(self) -> None:
        self.shards = {"a:1": [0.0, 0.0], "b:1": [0.0, 0.0]}
        self.down: set[str] = set()

    def describe(self, buffer: str) -> dict:
        up = {address: counts for address, counts in self.shards.items() if address not in self.down}
        shards = [{"address": address, "counters": {"inserted_rows": i, "sampled_items": s}}
                  for address, (i, s) in up.items()]
        return {"counters": {"inserted_rows": sum(i for i, _ in up.values()),
                             "sampled_items": sum(s for _, s in up.values())}, "shards": shards}


def test_over_shards_the_rates_never_count_backwards_when_a_shard_leaves_or_comes_back_restored(
        clock: Clock) -> None:
    """The merged sums drop while a shard is down, and a shard restored from a checkpoint counts from the
    checkpoint's counters: the bar showed negative insert and sample rates. Each shard's increases are summed."""
    client = FakeShardedClient()
    bar = ProgressBar(client, "cartpole", ("inserted_rows", "sampled_items"), "greedy return", 300.0)

    def second(inserts: dict[str, float]) -> str:
        for address, rows in inserts.items():
            client.shards[address][0] += rows
            client.shards[address][1] += 10 * rows
        clock.now += 1.0
        bar(Progress(training=True, seconds=clock.now - 1000.0))
        return bar.bar.postfix

    second({"a:1": 0.0, "b:1": 0.0})
    for _ in range(6):
        assert "inserts 1.00k/s, samples 10.0k/s" in second({"a:1": 500.0, "b:1": 500.0})
    client.down.add("b:1")  # b's 3,000 rows leave the sums
    assert "inserts 1.00k/s, samples 10.0k/s, replay ratio 10.0" in second({"a:1": 1000.0})
    client.shards["b:1"] = [1000.0, 10000.0]  # back from an older checkpoint
    client.down.clear()
    postfixes = [second({"a:1": 500.0, "b:1": 500.0}) for _ in range(7)]
    assert all("-" not in postfix.split("learner")[1] for postfix in postfixes)  # no negative rate
    # Its first second back is not counted (its counters fell below the last reading); then every row is.
    assert "inserts 1.00k/s, samples 10.0k/s, replay ratio 10.0" in postfixes[-1]
    summary = {"solved": True, "seconds": 13.0, "learner_steps": 100, "env_steps": 13000,
               "buffer": client.describe("cartpole")}
    bar.close()
    assert bar.summary_line(summary).endswith("replay ratio 10.0")


def test_the_screenshot_is_taken_once_mid_run_on_its_own_thread(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    taken = []
    monkeypatch.setattr(status_screenshot, "find_chromium", lambda: "/usr/bin/chromium")
    monkeypatch.setattr(status_screenshot, "screenshot", lambda chromium, url, path: taken.append((url, path)))
    shot = MidRunScreenshot("http://127.0.0.1:1/", tmp_path / "run" / "status.png", after=30.0)
    shot(Progress(training=False, seconds=0.0))
    shot(Progress(training=True, seconds=29.0))
    assert shot.thread is None
    shot(Progress(training=True, seconds=31.0))
    shot(Progress(training=True, seconds=32.0))
    shot.finish()
    assert taken == [("http://127.0.0.1:1/", tmp_path / "run" / "status.png")] and shot.saved
    assert (tmp_path / "run").is_dir()


def test_a_short_run_takes_its_screenshot_when_it_ends(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    taken = []
    monkeypatch.setattr(status_screenshot, "find_chromium", lambda: "/usr/bin/chromium")
    monkeypatch.setattr(status_screenshot, "screenshot", lambda chromium, url, path: taken.append(path))
    shot = MidRunScreenshot("http://127.0.0.1:1/", tmp_path / "status.png", after=30.0)
    shot(Progress(training=True, seconds=5.0))
    shot.finish()
    assert taken == [tmp_path / "status.png"]


def test_without_chromium_the_demo_says_so_in_one_line_and_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(status_screenshot, "find_chromium", lambda: None)
    shot = MidRunScreenshot("http://127.0.0.1:1/", tmp_path / "status.png")
    shot(Progress(training=True, seconds=100.0))
    shot.finish()
    assert not shot.saved and not (tmp_path / "status.png").exists()
    assert capsys.readouterr().err == ("no Chromium on this machine (apt-get install chromium): no status.png of the "
                                       "status page\n")


def test_a_failed_screenshot_is_said_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    fake = tmp_path / "chromium"
    fake.write_text("#!/bin/sh\necho 'cannot open display' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(status_screenshot, "find_chromium", lambda: str(fake))
    shot = MidRunScreenshot("http://127.0.0.1:1/", tmp_path / "status.png")
    shot.finish()
    assert not shot.saved
    err = capsys.readouterr().err
    assert err.startswith("the status page screenshot failed: Command ") and err.endswith(
        "returned non-zero exit status 3. cannot open display\n")
