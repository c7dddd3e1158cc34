"""The lock a server holds on its instance name for as long as it runs.

Segments are named after the instance (rpd_<instance>_<buffer>). A second server started under the same
name would take a live server's segments for a crashed server's leftovers, and its --remove-stale,
--recover, or `replayd segments --remove` would wreck buffers in use. An exclusive flock on
/dev/shm/replayd-<instance>.lock tells the two apart: the kernel drops it when its holder exits, even by
SIGKILL, so a crashed server's instance is free again at once.
"""

from __future__ import annotations

import fcntl
import os
import time

from replayd.server.storage.shared_arrays import SHM_DIR
from replayd.wire.errors import FailedPrecondition


def lock_path(instance: str) -> str:
    return os.path.join(SHM_DIR, f"replayd-{instance}.lock")


class InstanceLock:
    """Held from construction to `release()`; FailedPrecondition if another process still holds it after
    `wait_seconds` (a `replayd segments` run holds it for a moment while it looks)."""

    def __init__(self, instance: str, wait_seconds: float = 1.0) -> None:
        self.instance, self.path = instance, lock_path(instance)
        give_up = time.monotonic() + wait_seconds
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < give_up:
                    time.sleep(0.01)
                    continue
                raise FailedPrecondition(
                    f"instance {instance!r} is served by another running process (it holds {self.path}): "
                    "start this server under another --instance, or stop that one first") from None
            # The holder before us may have unlinked the file after we opened it: then ours is not the lock.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd: int | None = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        os.unlink(self.path)  # while still locked, so nobody locks the old file after it is gone
        os.close(self._fd)
        self._fd = None

