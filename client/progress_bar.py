"""The progress bar of a run, the demo's and the learner's: a tqdm bar over the training budget (seconds: every
learner's budget is training time) whose postfix shows the last and the best evaluation score, learner steps/s,
the buffer's insert and sample rates and its replay ratio; at the end one summary line."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from tqdm import tqdm

from replayd.client.learners.common import Progress
from replayd.client.replay_client import ReplayClient

RATE_SECONDS = 5.0  # the insert and sample rates are measured over about this many seconds


def _count(value: float) -> str:
    return tqdm.format_sizeof(value, divisor=1000)  # 1234 -> "1.23k"


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


class ProgressBar:
    """Called with each Progress a learner reports. `counters`: the buffer counters of inserted steps and sampled
    items (rollout buffers count pushed steps and minibatch rows); `check` runs at each report (the demo's raises
    once an actor failed)."""

    def __init__(self, client: ReplayClient, buffer: str, counters: tuple[str, str], score_label: str,
                 budget_seconds: float, check: Callable[[], None] = lambda: None) -> None:
        self.client, self.buffer, self.counters, self.score_label = client, buffer, counters, score_label
        self.budget_seconds, self.check = budget_seconds, check
        self.bar: tqdm | None = None  # drawn at the first report: a learner refused before it shows none
        self.readings: deque[tuple[float, float, float]] = deque()  # (time, inserted, sampled)
        self.first: tuple[float, float] | None = None  # (inserted, sampled) at the first report: this run's ratio
        self._servers: dict[str, tuple[float, float]] = {}  # each server's (inserted, sampled) at the last reading
        self._counted = (0.0, 0.0)  # what the servers inserted and sampled since the first reading, summed
        self.progress = Progress(budget_seconds=budget_seconds)

    def __call__(self, progress: Progress) -> None:
        self.check()
        self.progress = progress
        inserted, sampled = self._read()
        now, (since, inserted_then, sampled_then) = time.monotonic(), self.readings[0]
        elapsed = max(now - since, 1e-9)
        parts = [f"{self.score_label} {_score(progress.score)} (best {_score(progress.best_score)})",
                 f"learner {_count(progress.steps_per_second)} steps/s",
                 f"inserts {_count((inserted - inserted_then) / elapsed)}/s",
                 f"samples {_count((sampled - sampled_then) / elapsed)}/s",
                 f"replay ratio {self._ratio(inserted, sampled)}"]
        if not progress.training:
            parts.insert(0, "waiting for data")
        if self.bar is None:
            self.bar = tqdm(total=self.budget_seconds, desc="training", unit="s",
                            bar_format="{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s{postfix}")
        self.bar.n = min(progress.seconds, self.budget_seconds)
        self.bar.set_postfix_str(", ".join(parts))  # redraws the bar

    def _tally(self, description: dict) -> tuple[float, float]:
        """Inserted steps and sampled items since the first reading: each server's increases, summed. Over shards
        (a description with `shards`), a shard that is down is missing from the sums of a merged description, and
        one restored from a checkpoint counts from the checkpoint's counters again: neither counts backwards."""
        servers = description.get("shards") or [description]
        counted = list(self._counted)
        for server in servers:
            now = tuple(float(server["counters"].get(name, 0.0)) for name in self.counters)
            address = server.get("address", "")
            last = self._servers.get(address, now)
            counted = [total + max(0.0, value - before)
                       for total, value, before in zip(counted, now, last, strict=True)]
            self._servers[address] = now
        self._counted = (counted[0], counted[1])
        return self._counted

    def _read(self) -> tuple[float, float]:
        """The buffer's counts now, kept with those of the last RATE_SECONDS."""
        inserted, sampled = self._tally(self.client.describe(self.buffer))
        now = time.monotonic()
        self.readings.append((now, inserted, sampled))
        while len(self.readings) > 2 and now - self.readings[1][0] >= RATE_SECONDS:
            self.readings.popleft()
        if self.first is None:
            self.first = (inserted, sampled)
        return inserted, sampled

    def _ratio(self, inserted: float, sampled: float) -> str:
        """Sampled items per inserted step since the first report ('-' before an insert)."""
        inserted_first, sampled_first = self.first
        return f"{(sampled - sampled_first) / (inserted - inserted_first):.1f}" if inserted > inserted_first else "-"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def summary_line(self, summary: dict) -> str:
        """One line on the whole run, from a learner's summary (its buffer's final counters included)."""
        seconds, steps = summary["seconds"], summary["learner_steps"]
        inserted, sampled = self._tally(summary["buffer"])
        outcome = f"solved in {seconds:.0f} s" if summary["solved"] else f"budget of {self.budget_seconds:.0f} s spent"
        return (f"{outcome}: {self.score_label} {_score(self.progress.score)} "
                f"(best {_score(self.progress.best_score)}), {summary['env_steps']:,} env steps, {steps:,} learner "
                f"steps ({steps / max(seconds, 1e-9):.0f}/s), replay ratio {self._ratio(inserted, sampled)}")
