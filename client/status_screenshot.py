"""A screenshot of a replay server's status page by the installed headless Chromium: the demo saves one into its
run folder (status.png), taken mid-run, so that the run folder shows what the server looked like."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tqdm import tqdm

from replayd.client.learners.common import Progress

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
WINDOW = (1200, 1000)  # the table and one buffer's row of charts
SCREENSHOT_AFTER = 30.0  # training seconds before the demo's screenshot: the charts have half a minute to show


def find_chromium() -> str | None:
    """The path of the first Chromium (or Chrome) on the PATH; None without one."""
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def screenshot(chromium: str, url: str, path: Path, timeout: float = 60.0) -> None:
    """Loads `url` in headless `chromium` and writes a PNG of the page to `path` (replaced whole, never
    half-written). Virtual time lets the page's fetches and timers run without waiting on the wall clock.
    CalledProcessError (with Chromium's output) when Chromium fails."""
    tmp = path.with_name(f".{path.name}.tmp.png")
    with tempfile.TemporaryDirectory(prefix="replayd-chromium-") as profile:
        # No sandbox: the page is the local server's own, and Chromium's sandbox refuses to run as root.
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={profile}", "--virtual-time-budget=3000", f"--window-size={WINDOW[0]},{WINDOW[1]}",
             "--hide-scrollbars", f"--screenshot={tmp}", url],
            capture_output=True, text=True, timeout=timeout, check=True)
    os.replace(tmp, path)


class MidRunScreenshot:
    """One screenshot of the status page at `url` into `path`, on a thread of its own (the learner goes on): at
    the first report `after` training seconds into the run, or, for a run that ends sooner, at `finish()`. Where
    no Chromium is on the machine it says so in one line when made, and takes none."""

    def __init__(self, url: str, path: Path, after: float = SCREENSHOT_AFTER) -> None:
        self.url, self.path, self.after = url, path, after
        self.chromium = find_chromium()
        self.thread: threading.Thread | None = None
        self.saved = False
        if self.chromium is None:
            tqdm.write(f"no Chromium on this machine (apt-get install chromium): no {path.name} of the status page",
                       file=sys.stderr)

    def __call__(self, progress: Progress) -> None:
        if progress.training and progress.seconds >= self.after:
            self._start()

    def _start(self) -> None:
        if self.chromium is not None and self.thread is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.thread = threading.Thread(target=self._take, name="replayd-screenshot", daemon=True)
            self.thread.start()

    def _take(self) -> None:
        try:
            screenshot(self.chromium, self.url, self.path)
            self.saved = True
        except (subprocess.SubprocessError, OSError) as exc:  # the run goes on without it: say why, in one line
            detail = exc.stderr.strip().splitlines()[-1:] if isinstance(exc, subprocess.CalledProcessError) else []
            tqdm.write(f"the status page screenshot failed: {exc} {' '.join(detail)}".rstrip(), file=sys.stderr)

    def finish(self) -> None:
        """Takes the screenshot now if none was started, and waits for it."""
        self._start()
        if self.thread is not None:
            self.thread.join()
