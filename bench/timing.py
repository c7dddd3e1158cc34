"""Per-call timing shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def time_calls(fns: dict[str, Callable[[], object]], calls: int, warmup: int = 20, rounds: int = 10
               ) -> dict[str, tuple[float, float]]:
    """(median, p90) µs per call of each function over `calls` individually timed calls, taken round-robin
    in `rounds` blocks so that background load on the shared machine hits every function alike.

    The functions take their turns in a new order each round: in a fixed order, a function would always run
    right after the same one, and find the caches as that one leaves them (filled with the rows it reads too,
    or emptied by its own large arrays), which is no condition of its own."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: np.empty(calls) for name in fns}
    clock = time.perf_counter
    orders, names = np.random.default_rng(0), list(fns)
    for block in np.array_split(np.arange(calls), rounds):
        for turn in orders.permutation(len(names)):
            name, fn = names[turn], fns[names[turn]]
            for i in block:
                start = clock()
                fn()
                times[name][i] = clock() - start
    return {name: (float(np.median(t)) * 1e6, float(np.percentile(t, 90)) * 1e6) for name, t in times.items()}
