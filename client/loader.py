"""Prefetching loader: server batches -> torch tensors on the learner's device, ahead of the learner.

The sample stream keeps requests in flight on the wire; a background thread decodes each Arrow batch
into tensors without copying (`torch.from_numpy` over the received bytes) and, on CUDA, stages them
in pinned host memory and copies with `non_blocking=True`, so the learner never waits while the server
keeps up. Batches come out in the order the server sent them, each exactly once. A stream sampled with
decompress="client" is decoded on that thread too: the compressed frames it ships are decompressed and
stacked there (client/batch_stream.py), beside the learner's work. An optional `prepare` function rewrites each
numpy batch in that thread before its tensors are made (hindsight relabeling's reward recomputation,
client/hindsight.py), off the learner's critical path.
"""

from __future__ import annotations

import inspect
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

_DONE = object()

Prepare = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def to_tensors(batch: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The batch's arrays as tensors on `device` (on the CPU, views of the arrays: no copy). A field the
    batch aliases (`bootstrap_obs` is `next_obs` for 1-step samples) stays one tensor: it is staged and
    copied once."""
    device = torch.device(device)
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


def _fill(source: Iterator[dict[str, np.ndarray]], device: torch.device, batches: queue.Queue,
          stop: threading.Event, prepare: Prepare | None) -> None:
    """The loader's thread: queues each batch of `source` (rewritten by `prepare` when given) as tensors, then
    the end or the error of the source or of `prepare`."""
    try:
        for batch in source:
            tensors = to_tensors(batch if prepare is None else prepare(batch), device)
            if device.type == "cuda":
                # The copies were queued on the target device's current stream (not the thread's current
                # device's, for cuda:1); the learner's stream on that device waits for them.
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                tensors = (tensors, event)
            if not _put(batches, tensors, stop):
                return
        _put(batches, _DONE, stop)
    except BaseException as exc:  # handed to the consumer, raised there (unless it closed the loader)
        _put(batches, exc, stop)
    finally:
        # Here the source is not running, so even a generator may be closed (cancelling a server stream).
        close = getattr(source, "close", None)
        if close is not None:
            close()


def _put(batches: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Queues `item` unless the loader is closed first (a full queue then has no reader); False if closed."""
    while not stop.is_set():
        try:
            batches.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _stop_filling(source: Iterator[dict[str, np.ndarray]], stop: threading.Event, thread: threading.Thread) -> None:
    """Stops the loader's thread, which closes the source after the batch it is reading.

    A source whose close() is thread-safe (a ReplayClient stream) is also closed from here at once, which
    cancels a call the thread may be waiting on. A generator cannot be closed while the thread runs it
    ("generator already executing"), so it is left to the thread.
    """
    stop.set()
    if not inspect.isgenerator(source):
        close = getattr(source, "close", None)
        if close is not None:
            close()
    if thread is not threading.current_thread():  # a garbage collection in the thread may collect the Loader
        thread.join(timeout=5)


class Loader:
    """Iterates `source` (numpy batches) in a background thread, yielding tensor dicts on `device`.

    `prepare`, when given, maps each numpy batch to the batch whose tensors are made, in that thread (an
    error it raises reaches the consumer as the source's would). Decoded server batches are read-only
    views of the received message: `prepare` returns new arrays rather than writing into them.

    Leaving the iteration early (a `break`, an error in the loop, the iterator dropped), leaving a `with`
    block, or close() stops the thread and closes the source: no server stream stays open. So does dropping
    an unclosed Loader: its thread holds only what it fills, so the Loader is collected.
    """

    def __init__(self, source: Iterable[dict[str, np.ndarray]], device: torch.device | str = "cpu",
                 prefetch: int = 4, prepare: Prepare | None = None) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.device = torch.device(device)
        self._source = iter(source)
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._finished = False  # closed (also once the consumer got the end or the source's error): iterations end
        self._thread = threading.Thread(target=_fill,
                                        args=(self._source, self.device, self._queue, self._stop, prepare),
                                        name="replayd-loader", daemon=True)
        # Runs once: on close(), or when an unclosed Loader is collected.
        self._stop_filling = weakref.finalize(self, _stop_filling, self._source, self._stop, self._thread)
        self._stop_filling.atexit = False  # at exit the daemon thread just ends with the process
        self._thread.start()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        try:
            while not self._finished:
                try:
                    # Not a blocking get(): close() from another thread must end a consumer waiting here.
                    item = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, tuple):
                    tensors, event = item
                    torch.cuda.current_stream(self.device).wait_event(event)
                    item = tensors
                yield item
        finally:
            # Also on a `break` (GeneratorExit here) or an error in the loop body, which would leave it open.
            self.close()

    def close(self) -> None:
        """Stops the background thread and closes the source (see _stop_filling); later iterations are empty."""
        self._finished = True
        self._stop_filling()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
