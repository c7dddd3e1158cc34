"""Stopping the server processes a benchmark starts."""

from __future__ import annotations

import subprocess


def stop(process: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM (a replayd server then unlinks its shared memory), SIGKILL if it has not exited in `timeout` s."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
