"""`make bench` runs every module bench.run lists; each must import (and expose `run`) on a fresh clone."""

import importlib

import pytest

from bench.run import MODULES


@pytest.mark.parametrize("module", [*MODULES, "bench.allo_paper_check", "bench.gpu_check", "bench.shards_scaling"])
def test_bench_module_imports(module: str) -> None:
    loaded = importlib.import_module(module)
    assert callable(getattr(loaded, "run", None) or getattr(loaded, "main", None)), module


def test_peak_rss_of_a_child_is_its_own() -> None:
    """bench_gae's memory children report their own peak RSS, not that of the process that started them
    (getrusage's ru_maxrss survives execve on Linux, so it would report bench.run's peak)."""
    import subprocess
    import sys

    import numpy as np

    from bench.subprocesses import peak_rss_bytes

    held = np.ones(2**25)  # 256 MiB touched: this process's peak is at least that
    child = subprocess.run([sys.executable, "-c", "from bench.subprocesses import peak_rss_bytes; "
                            "print(peak_rss_bytes())"], capture_output=True, text=True, check=True)
    assert peak_rss_bytes() >= held.nbytes
    assert int(child.stdout) < held.nbytes


def test_timed_functions_take_their_turns_in_a_new_order_each_round() -> None:
    """No function always runs right after the same one (and finds the caches as that one leaves them)."""
    from bench.timing import time_calls

    log: list[str] = []
    fns = {name: (lambda name=name: log.append(name)) for name in "abcd"}
    timed = time_calls(fns, calls=40, warmup=1, rounds=10)  # each round: 4 calls of each function in turn
    assert set(timed) == set(fns) and len(log) == 4 + 10 * 16
    rounds = [log[4 + 16 * r:4 + 16 * (r + 1)] for r in range(10)]
    assert all(turns == [turns[0]] * 4 + [turns[4]] * 4 + [turns[8]] * 4 + [turns[12]] * 4 for turns in rounds)
    orders = [tuple(turns[::4]) for turns in rounds]
    assert all(sorted(order) == list("abcd") for order in orders)
    before_a = {order[order.index("a") - 1] for order in orders if order[0] != "a"}
    assert len(before_a) >= 2, orders
