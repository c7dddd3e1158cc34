"""A server stream of batches as an iterator that any thread may close (which cancels the call).

A generator over the call could only be closed by the thread running it: a Loader's thread waiting in
`next()` for the server made `Loader.close()` fail with "generator already executing".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from service.wire import codec


class BatchStream:
    """Decoded batches (numpy views of each message) of one server-streaming call.

    `close()` cancels the call, from any thread; iterating after it ends the iteration. A stream dropped
    without close() is cancelled when gRPC collects the call.
    """

    def __init__(self, call: Any, on_unavailable: Callable[[], None] | None = None) -> None:
        self._call = call  # a grpc call that is also an iterator of payloads
        self._on_unavailable = on_unavailable  # e.g. the client forgetting a sample worker's address
        self._closed = False

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        try:
            payload = next(self._call)
        except grpc.RpcError as exc:
            if self._closed and exc.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            if exc.code() == grpc.StatusCode.UNAVAILABLE and self._on_unavailable is not None:
                self._on_unavailable()
            raise
        return codec.decode(payload)

    def close(self) -> None:
        self._closed = True
        self._call.cancel()
