"""LocalReader: sample a buffer of a server on this host straight from its shared memory.

No network and no serialization: the reader maps the buffer's segments read-only and runs the same
samplers and batch modes as the server, returning the same batch format as `ReplayClient.sample`. The
server stays the single writer; a batch that raced with an eviction is drawn again, never returned torn.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from replayd.client.polling import never, wait_until
from replayd.client.replay_client import ReplayClient
from replayd.server import components
from replayd.server.buffers.reader import RingReader
from replayd.server.modes.base import BatchMode
from replayd.server.storage.shared_arrays import segment_identity
from replayd.wire.components import ModeOptions, Transitions
from replayd.wire.errors import DeadlineExceeded, InvalidArgument, NotFound

CHECK_EVERY = 0.05  # seconds between checks that the buffer still exists on the server


class LocalStream:
    """A LocalReader's batches. close(), from any thread, ends the iteration, also while it waits for data
    (a Loader closes its source from the consumer's thread while its own thread is reading it)."""

    def __init__(self, batches: Callable[[Callable[[], bool]], Iterator[dict[str, np.ndarray]]]) -> None:
        self._closed = threading.Event()
        self._batches = batches(self._closed.is_set)

    def __iter__(self) -> LocalStream:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._closed.is_set():
            raise StopIteration
        return next(self._batches)

    def close(self) -> None:
        self._closed.set()


def batch_mode(mode: ModeOptions) -> BatchMode:
    """The batch mode these options configure (the same class the server builds)."""
    if not isinstance(mode, ModeOptions):
        raise InvalidArgument(f"mode: expected a batch mode's options (Transitions(), Geometric(discount=...), "
                              f"...), got {mode!r}")
    return components.build(mode)


def _on_server(client: ReplayClient, buffer: str) -> bool:
    try:
        client.describe(buffer)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return False
    return True


class LocalReader:
    """Read-only view of one episodic buffer of a server on this host."""

    def __init__(self, client: ReplayClient, buffer: str) -> None:
        info = client.describe(buffer)
        if info["host"] != socket.gethostname():
            raise RuntimeError(
                f"buffer {buffer!r} lives on host {info['host']!r}, not on this host ({socket.gethostname()!r}): "
                "sample it over gRPC"
            )
        self.buffer = buffer
        self._segment = info["shm_name"]
        self._identity = segment_identity(self._segment)  # before attaching: a segment replaced later differs
        deleted = NotFound(f"buffer {buffer!r} was deleted on the server while this reader attached")
        if self._identity is None:
            if not _on_server(client, buffer):
                raise deleted
            raise RuntimeError(
                f"buffer {buffer!r}: shared-memory segment {self._segment!r} is not visible here (another "
                "container or IPC namespace?); sample it over gRPC"
            )
        try:
            self.ring = RingReader.attach(self._segment)
        except FileNotFoundError:
            raise deleted from None
        self.torn_redraws = 0
        self._rng = np.random.default_rng()
        self._checked = time.monotonic()

    def _has_data(self) -> bool:
        self._check_current()  # a buffer deleted while we wait never gets data: NotFound, not a timeout
        return self.ring.drawable()  # a prioritized buffer also needs a positive priority

    def _wait_for_data(self, timeout: float | None, stopped: Callable[[], bool] = never) -> bool:
        """Polls until the buffer has a step to draw (True) or `stopped()` (False)."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        try:
            return bool(wait_until(self._has_data, deadline, f"data in buffer {self.buffer!r}", stopped=stopped,
                                   max_delay=0.02))
        except TimeoutError as exc:
            raise DeadlineExceeded(f"buffer {self.buffer!r} got no step to draw within {timeout:.3g}s") from exc

    def _check_current(self) -> None:
        """Raises NotFound once the server deleted (or re-created) the buffer: the mapping outlives the
        segment, so without this check the reader would keep sampling a frozen snapshot. Checked at most
        every CHECK_EVERY seconds (a stat of the segment, about 1 µs)."""
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY:
            return
        self._checked = now
        if segment_identity(self._segment) != self._identity:
            raise NotFound(f"buffer {self.buffer!r} was deleted or re-created on the server since this reader "
                           "attached; attach a new LocalReader")

    def close(self) -> None:
        """Unmaps the buffer once the samples running on this reader finish (from any thread); a sample after
        it raises NotFound."""
        self.ring.close()

    def __enter__(self) -> LocalReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def sample(self, batch_size: int, mode: ModeOptions = Transitions(), *, seed: int | None = None,
               include_keys: bool = False, importance_beta: float = 0.0, wait: bool = False,
               timeout: float | None = None) -> dict[str, np.ndarray]:
        """Same arguments and batch format as ReplayClient.sample (fresh arrays, not views). `wait`: an empty
        buffer is polled for data until `timeout` seconds (None: no limit) instead of failing at once."""
        self._check_current()
        if wait:
            self._wait_for_data(timeout)
        rng = np.random.default_rng(seed) if seed is not None else self._rng
        batch, torn = self.ring.sample_shared(batch_size, batch_mode(mode), rng, include_keys,
                                              importance_beta)
        self.torn_redraws += torn
        return batch

    def sample_stream(self, batch_size: int, mode: ModeOptions = Transitions(), num_batches: int = 0, *,
                      seed: int | None = None, include_keys: bool = False, importance_beta: float = 0.0,
                      wait: bool = False, timeout: float | None = None) -> LocalStream:
        """Batches until `num_batches` (0: forever); one random stream, so a seeded stream is reproducible.
        `wait` and `timeout` as in `sample`, for the first batch."""
        if isinstance(num_batches, bool) or not isinstance(num_batches, int | np.integer) or num_batches < 0:
            raise InvalidArgument(f"sample_stream: num_batches expected an integer >= 0 (0 = until closed), "
                                  f"got {num_batches!r}")
        rng = np.random.default_rng(seed)
        chosen = batch_mode(mode)

        def batches(stopped: Callable[[], bool]) -> Iterator[dict[str, np.ndarray]]:
            if wait and not self._wait_for_data(timeout, stopped):
                return
            sent = 0
            while num_batches == 0 or sent < num_batches:
                self._check_current()
                batch, torn = self.ring.sample_shared(batch_size, chosen, rng, include_keys, importance_beta)
                self.torn_redraws += torn
                yield batch
                sent += 1

        return LocalStream(batches)
