"""The machine a benchmark run measured: one record at the head of bench/results.jsonl.

The documentation's performance page states it in one line beside the figures (bench/report.py), so that
figures are read against the hardware they came from.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as the kernel reports it (Linux), else what `platform` knows."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("model name", "Model")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    """Physical memory (MemTotal of /proc/meminfo, Linux); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def gpu_name() -> str | None:
    """The first CUDA device's name when torch is installed and sees one; None otherwise."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine_record(quick: bool) -> dict:
    """`{"bench": "machine", ...}`: the cores this process may run on, the CPU model, the architecture, the
    operating system, the memory, the GPU (or None), the Python version, and whether the sizes were --quick."""
    return {
        "bench": "machine",
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "system": platform.system(),
        "memory_bytes": memory_bytes(),
        "gpu": gpu_name(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "quick": quick,
    }


def _version(module: str) -> str | None:
    loaded = sys.modules.get(module)
    if loaded is None:
        try:
            loaded = __import__(module)
        except ImportError:
            return None
    return getattr(loaded, "__version__", None)
