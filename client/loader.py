"""Prefetching loader: server batches -> torch tensors on the learner's device, ahead of the learner.

The sample stream keeps requests in flight on the wire; a background thread decodes each Arrow batch
into tensors without copying (`torch.from_numpy` over the received bytes) and, on CUDA, stages them
in pinned host memory and copies with `non_blocking=True`, so the learner never waits while the server
keeps up. Batches come out in the order the server sent them, each exactly once.
"""

from __future__ import annotations

import inspect
import queue
import threading
import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import torch

_DONE = object()


def to_tensors(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's arrays as tensors on `device` (on the CPU, views of the arrays: no copy). A field the
    batch aliases (`bootstrap_obs` is `next_obs` for 1-step samples) stays one tensor: it is staged and
    copied once."""
    tensors: dict[str, torch.Tensor] = {}
    by_array: dict[int, tuple[np.ndarray, torch.Tensor]] = {}  # the array is held: its id stays its own
    with warnings.catch_warnings():
        # Decoded arrays are read-only views of the received message; the trainers never write to them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, array in batch.items():
            seen = by_array.get(id(array))
            if seen is None:
                seen = by_array[id(array)] = (array, _on_device(torch.from_numpy(array), device))
            tensors[name] = seen[1]
    return tensors


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor if device.type == "cpu" else tensor.to(device)


class Loader:
    """Iterates `source` (numpy batches) in a background thread, yielding tensor dicts on `device`."""

    def __init__(self, source: Iterable[dict[str, np.ndarray]], device: torch.device | str = "cpu",
                 prefetch: int = 4) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.device = torch.device(device)
        self._source = iter(source)
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._finished = False  # the consumer got the end or the source's error: later iterations end at once
        self._thread = threading.Thread(target=self._fill, name="replayd-loader", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            for batch in self._source:
                tensors = to_tensors(batch, self.device)
                if self.device.type == "cuda":
                    # The copies were queued on the target device's current stream (not the thread's current
                    # device's, for cuda:1); the learner's stream on that device waits for them.
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(self.device))
                    tensors = (tensors, event)
                if not self._put(tensors):
                    return
            self._put(_DONE)
        except BaseException as exc:  # handed to the consumer, raised there (unless it closed the loader)
            self._put(exc)
        finally:
            # Here the source is not running, so even a generator may be closed (cancelling a server stream).
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

    def _put(self, item: object) -> bool:
        """Queues `item` unless the loader is closed first (a full queue then has no reader); False if closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while not self._finished:
            item = self._queue.get()
            if item is _DONE:
                self._finished = True
                return
            if isinstance(item, BaseException):
                self._finished = True
                raise item
            if isinstance(item, tuple):
                tensors, event = item
                torch.cuda.current_stream(self.device).wait_event(event)
                item = tensors
            yield item

    def close(self) -> None:
        """Stops the background thread, which closes the source after the batch it is reading.

        A source whose close() is thread-safe (a ReplayClient stream) is also closed from here at once,
        which cancels a call the thread may be waiting on. A generator cannot be closed while the
        thread runs it ("generator already executing"), so it is left to the thread.
        """
        self._stop.set()
        self._finished = True
        if not inspect.isgenerator(self._source):
            close = getattr(self._source, "close", None)
            if close is not None:
                close()
        self._thread.join(timeout=5)
