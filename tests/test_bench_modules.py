"""`make bench` runs every module bench.run lists; each must import (and expose `run`) on a fresh clone."""

import importlib

import pytest

from bench.run import MODULES


@pytest.mark.parametrize("module", [*MODULES, "bench.allo_paper_check", "bench.gpu_check"])
def test_bench_module_imports(module: str) -> None:
    loaded = importlib.import_module(module)
    assert callable(getattr(loaded, "run", None) or getattr(loaded, "main", None)), module


def test_peak_rss_of_a_child_is_its_own() -> None:
    """bench_gae's memory children report their own peak RSS, not that of the process that started them
    (getrusage's ru_maxrss survives execve on Linux: both children reported bench.run's 2157 MiB)."""
    import subprocess
    import sys

    import numpy as np

    from bench.subprocesses import peak_rss_bytes

    held = np.ones(2**25)  # 256 MiB touched: this process's peak is at least that
    child = subprocess.run([sys.executable, "-c", "from bench.subprocesses import peak_rss_bytes; "
                            "print(peak_rss_bytes())"], capture_output=True, text=True, check=True)
    assert peak_rss_bytes() >= held.nbytes
    assert int(child.stdout) < held.nbytes
