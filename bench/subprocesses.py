"""The server processes a benchmark starts: stopping them, and the CPU they spend."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import psutil


def stop(process: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM (a replayd server then unlinks its shared memory), SIGKILL if it has not exited in `timeout` s."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def cpu_seconds(process: psutil.Process) -> float:
    """CPU time of a process and its children (a server and its sample workers)."""
    total = 0.0
    for member in [process, *process.children(recursive=True)]:
        try:
            times = member.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class CpuMeter:
    """The CPU seconds a server process (with its children) and this process (gRPC's threads included) have
    spent so far: the difference of two reads over a window's wall time is the cores each side kept busy."""

    def __init__(self, server_pid: int) -> None:
        self.server_process = psutil.Process(server_pid)

    def read(self) -> np.ndarray:
        """[server, client] CPU seconds."""
        return np.array([cpu_seconds(self.server_process), time.process_time()])
