"""The recent past of every buffer, for the status page's charts: one sample a second, the last ten minutes kept
in a fixed-size ring per buffer, taken by one thread per server. The thread reads what a /metrics scrape reads
(the buffers' counters and the per-RPC latency histograms), once a second: the calls themselves do no extra work.

A sample holds, per buffer: inserts/s and samples/s (inserted steps and sampled items over the last second), the
replay ratio (sampled items per inserted step over the last RATIO_SAMPLES samples: a ratio over one second swings
between 0 and infinity when inserts and samples come in bursts), the 50th and 99th percentile latency of its
insert calls and of its sample calls over the last second, and the bytes it stores. A buffer deleted and created
again under its name starts a ring of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client.registry import Collector

from replayd.server.http.stats import buffer_stat
from replayd.server.registry import Buffer, BufferRegistry

log = logging.getLogger("replayd")

SAMPLE_SECONDS = 1.0
KEPT_SAMPLES = 600  # ten minutes
RATIO_SAMPLES = 10
COLUMNS = ("t", "inserts_per_s", "samples_per_s", "replay_ratio", "insert_p50", "insert_p99", "sample_p50",
           "sample_p99", "stored_bytes")
# (histogram, method) -> the latency group it counts in. Streams count per message: a sample stream's whole
# call lasts as long as the learner runs, each of its batches is what a sample costs.
LATENCY_GROUPS = {
    ("replayd_rpc_latency_seconds", "Insert"): "insert",
    ("replayd_rpc_latency_seconds", "PushRollout"): "insert",
    ("replayd_rpc_latency_seconds", "Sample"): "sample",
    ("replayd_rpc_stream_message_seconds", "SampleStream"): "sample",
    ("replayd_rpc_stream_message_seconds", "RolloutMinibatches"): "sample",
}

Buckets = tuple[np.ndarray, np.ndarray]  # upper bounds (the last +inf), cumulative counts


def bucket_quantile(q: float, bounds: np.ndarray, cumulative: np.ndarray) -> float | None:
    """The q-quantile (0 < q <= 1) of the observations counted in cumulative histogram buckets, interpolated
    linearly within its bucket as Prometheus's histogram_quantile does (the first bucket starts at 0); None
    without observations. A quantile in the +inf bucket is reported as the largest finite bound."""
    total = cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    i = int(np.searchsorted(cumulative, rank, side="left"))
    if i >= len(bounds) - 1:
        return float(bounds[-2])
    lower, below = (float(bounds[i - 1]), float(cumulative[i - 1])) if i > 0 else (0.0, 0.0)
    return lower + (float(bounds[i]) - lower) * (rank - below) / (float(cumulative[i]) - below)


def latency_buckets(histograms: Iterable[Collector]) -> dict[tuple[str, str], Buckets]:
    """Cumulative bucket counts by (buffer, latency group), summed over the methods of each group."""
    counts: dict[tuple[str, str], dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for collector in histograms:
        for metric in collector.collect():
            for sample in metric.samples:
                group = LATENCY_GROUPS.get((metric.name, sample.labels.get("method")))
                if group is None or sample.name != f"{metric.name}_bucket" or not sample.labels["buffer"]:
                    continue
                counts[sample.labels["buffer"], group][float(sample.labels["le"])] += sample.value
    return {key: (np.array(sorted(by_bound)), np.array([by_bound[b] for b in sorted(by_bound)]))
            for key, by_bound in counts.items()}


def latency_quantiles(before: dict[str, np.ndarray], groups: dict[str, Buckets]) -> list[float | None]:
    """p50 and p99 of the insert and of the sample calls observed since the cumulative counts `before`: None
    without any, or when the counts went down (the buffer's series were dropped and started again)."""
    figures: list[float | None] = []
    for group in ("insert", "sample"):
        if group not in groups:
            figures += [None, None]
            continue
        bounds, counts = groups[group]
        delta = counts - before.get(group, 0.0)
        restarted = bool((delta < 0).any())
        figures += [None if restarted else bucket_quantile(q, bounds, delta) for q in (0.5, 0.99)]
    return figures


@dataclass
class Series:
    """One buffer's ring of samples and what its next sample is measured against."""

    buffer: Buffer  # a buffer created again under the name is another object: it gets a Series of its own
    inserted: int
    sampled: int
    clock: float  # time.monotonic() of the last sample
    latency: dict[str, np.ndarray]  # latency group -> cumulative bucket counts at the last sample
    rows: deque[tuple] = field(default_factory=lambda: deque(maxlen=KEPT_SAMPLES))
    counts: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=RATIO_SAMPLES + 1))

    def replay_ratio(self) -> float | None:
        (inserted_then, sampled_then), (inserted, sampled) = self.counts[0], self.counts[-1]
        return (sampled - sampled_then) / (inserted - inserted_then) if inserted > inserted_then else None


class History:
    """Samples every buffer of `registry` each SAMPLE_SECONDS on a thread of its own (`start`, `stop`); the
    latency quantiles come from `histograms`' buckets (the per-RPC Prometheus histograms)."""

    def __init__(self, registry: BufferRegistry, histograms: Iterable[Collector],
                 interval: float = SAMPLE_SECONDS) -> None:
        self.registry, self.histograms, self.interval = registry, tuple(histograms), interval
        self._series: dict[str, Series] = {}
        self._lock = threading.Lock()  # the thread replaces and appends to series while requests read them
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replayd-history", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # a status page without charts must not take the server down: say why, go on
                log.exception("the status page's history could not sample the buffers")
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        """Appends one sample to every buffer's ring; drops the rings of buffers that are gone."""
        wall, clock = time.time(), time.monotonic()
        latency = latency_buckets(self.histograms)
        series = {}
        for name, buffer in self.registry.all():
            stat = buffer_stat(name, buffer)
            if stat is None:
                continue
            groups = {group: buckets for (label, group), buckets in latency.items() if label == name}
            series[name] = self._advance(self._series.get(name), buffer, stat, groups, wall, clock)
        with self._lock:
            self._series = series

    def _advance(self, previous: Series | None, buffer: Buffer, stat: dict[str, Any], groups: dict[str, Buckets],
                 wall: float, clock: float) -> Series:
        inserted, sampled = stat["inserted_steps"], stat["sampled_items"]
        cumulative = {group: counts for group, (_, counts) in groups.items()}
        if previous is None or previous.buffer is not buffer or inserted < previous.inserted \
                or sampled < previous.sampled:
            series = Series(buffer, inserted, sampled, clock, cumulative)
            series.counts.append((inserted, sampled))
            return series  # the first sample is the baseline of the next one's rates
        seconds = clock - previous.clock
        previous.counts.append((inserted, sampled))
        row = (round(wall, 6), (inserted - previous.inserted) / seconds, (sampled - previous.sampled) / seconds,
               previous.replay_ratio(), *latency_quantiles(previous.latency, groups), stat["stored_bytes"])
        with self._lock:
            previous.rows.append(row)
        previous.inserted, previous.sampled, previous.clock, previous.latency = inserted, sampled, clock, cumulative
        return previous

    def snapshot(self) -> dict[str, Any]:
        """Every buffer's samples, column by column (as the charts take them): {buffer: {column: [values]}}."""
        with self._lock:
            rows = {name: list(series.rows) for name, series in self._series.items()}
        return {"interval_seconds": self.interval, "columns": list(COLUMNS),
                "buffers": {name: {column: [row[i] for row in samples] for i, column in enumerate(COLUMNS)}
                            for name, samples in rows.items()}}
