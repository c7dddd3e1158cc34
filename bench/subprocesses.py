"""The server processes a benchmark starts: stopping them, and the CPU they spend; a process's peak RSS."""

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


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM of /proc/self/status, Linux).

    Not getrusage's ru_maxrss: Linux keeps that across execve, so a child started by a larger process
    (bench.run has GBs of rings behind it by then) reports its parent's peak, not its own."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("/proc/self/status has no VmHWM line")
