"""A server stream of batches as an iterator that any thread may close (which cancels the call).

A generator over the call could only be closed by the thread running it: a Loader's thread waiting in
`next()` for the server made `Loader.close()` fail with "generator already executing".
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from client.retries import cut_short_by_deadline, server_retry_after
from service.wire import codec

log = logging.getLogger("replayd.client")


class BatchStream:
    """Decoded batches (numpy views of each message) of one server-streaming call.

    `close()` cancels the call, from any thread; iterating after it ends the iteration. A stream dropped
    without close() is cancelled when gRPC collects the call. A stream the server refused as busy before
    its first message (nothing was sampled) is opened again after the server's retry-after hint, within
    the stream's `timeout` (None: no deadline, so it keeps trying, with a warning in the log). One the
    server refuses until its deadline fails with the refusal (UNAVAILABLE, "the server is busy").
    """

    def __init__(self, open_call: Callable[[float | None], Any], timeout: float | None,
                 on_unavailable: Callable[[], None] | None = None) -> None:
        self._open_call = open_call  # open_call(seconds): the grpc call, an iterator of payloads that can be cancelled
        self._on_unavailable = on_unavailable  # e.g. the client forgetting a sample worker's address
        self._timeout = timeout
        self._deadline = math.inf if timeout is None else time.monotonic() + timeout
        self._lock = threading.Lock()  # close() and reopening never cross
        self._closed = threading.Event()  # also cuts short a busy retry's pause
        self._received = False
        self._call = open_call(timeout)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        delay, refusal = 0.05, None
        while True:
            try:
                payload = next(self._call)
                break
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    raise StopIteration from None
                if cut_short_by_deadline(exc, refusal, self._deadline):
                    raise refusal from exc
                if exc.code() == grpc.StatusCode.UNAVAILABLE and self._on_unavailable is not None:
                    self._on_unavailable()  # before a reopen too: it may have to go elsewhere
                retry_after = None if self._received else server_retry_after(exc)
                if retry_after is not None:
                    if refusal is None:
                        log.warning("stream refused: %s; opening it again", exc.details())
                    refusal = exc
                    delay = max(delay, retry_after)
                    try:
                        reopened = self._reopen(delay)
                    except grpc.RpcError as reopen_error:  # opening may ask the server first (where to sample)
                        if cut_short_by_deadline(reopen_error, refusal, self._deadline):
                            raise refusal from reopen_error
                        raise
                    if reopened:
                        delay = min(delay * 2, 2.0)
                        continue
                    if self._closed.is_set():
                        raise StopIteration from None
                raise
        self._received = True
        return codec.decode(payload)

    def _reopen(self, delay: float) -> bool:
        """Opens the call again after a pause (False: the stream was closed, or its deadline came first)."""
        if self._closed.wait(min(delay * (1 + random.random()), max(self._deadline - time.monotonic(), 0.0))):
            return False
        remaining = None if self._timeout is None else self._deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        # Opened outside the lock: opening may ask the server first (a describe), which close() must not wait on.
        call = self._open_call(remaining)
        with self._lock:
            if self._closed.is_set():
                call.cancel()
                return False
            self._call = call
            return True

    def close(self) -> None:
        """Cancels the call (from any thread); iterating after it ends the iteration."""
        with self._lock:
            self._closed.set()
            self._call.cancel()
