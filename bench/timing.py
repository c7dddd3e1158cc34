"""Per-call timing shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def time_calls(fns: dict[str, Callable[[], object]], calls: int, warmup: int = 20, rounds: int = 10
               ) -> dict[str, tuple[float, float]]:
    """(median, p90) µs per call of each function over `calls` individually timed calls, taken round-robin
    in `rounds` blocks so that background load on the shared machine hits every function alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: np.empty(calls) for name in fns}
    clock = time.perf_counter
    for block in np.array_split(np.arange(calls), rounds):
        for name, fn in fns.items():
            for i in block:
                start = clock()
                fn()
                times[name][i] = clock() - start
    return {name: (float(np.median(t)) * 1e6, float(np.percentile(t, 90)) * 1e6) for name, t in times.items()}
