"""A server stream of batches as an iterator that any thread may close (which cancels the call).

A generator over the call could only be closed by the thread running it: a Loader's thread waiting in
`next()` for the server made `Loader.close()` fail with "generator already executing".
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from client.retries import server_retry_after
from service.wire import codec


class BatchStream:
    """Decoded batches (numpy views of each message) of one server-streaming call.

    `close()` cancels the call, from any thread; iterating after it ends the iteration. A stream dropped
    without close() is cancelled when gRPC collects the call. A stream the server refused as busy before
    its first message (nothing was sampled) is opened again after the server's retry-after hint, for up
    to `busy_retry_seconds`.
    """

    def __init__(self, open_call: Callable[[], Any], on_unavailable: Callable[[], None] | None = None,
                 busy_retry_seconds: float = 30.0) -> None:
        self._open_call = open_call  # starts the grpc call: an iterator of payloads that can be cancelled
        self._on_unavailable = on_unavailable  # e.g. the client forgetting a sample worker's address
        self._give_up = time.monotonic() + busy_retry_seconds
        self._lock = threading.Lock()  # close() and reopening never cross
        self._closed = False
        self._received = False
        self._call = open_call()

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        delay = 0.05
        while True:
            try:
                payload = next(self._call)
                break
            except grpc.RpcError as exc:
                if self._closed and exc.code() == grpc.StatusCode.CANCELLED:
                    raise StopIteration from None
                retry_after = None if self._received else server_retry_after(exc)
                if retry_after is not None:
                    delay = max(delay, retry_after)
                    if time.monotonic() + delay < self._give_up and self._reopen(delay):
                        delay = min(delay * 2, 2.0)
                        continue
                if exc.code() == grpc.StatusCode.UNAVAILABLE and self._on_unavailable is not None:
                    self._on_unavailable()
                raise
        self._received = True
        return codec.decode(payload)

    def _reopen(self, delay: float) -> bool:
        time.sleep(delay * (1 + random.random()))
        with self._lock:
            if self._closed:
                return False
            self._call = self._open_call()
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._call.cancel()
