"""`make bench` runs every module bench.run lists; each must import (and expose `run`) on a fresh clone."""

import importlib

import pytest

from bench.run import MODULES


@pytest.mark.parametrize("module", [*MODULES, "bench.allo_paper_check", "bench.gpu_check"])
def test_bench_module_imports(module: str) -> None:
    loaded = importlib.import_module(module)
    assert callable(getattr(loaded, "run", None) or getattr(loaded, "main", None)), module
