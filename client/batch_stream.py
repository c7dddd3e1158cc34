"""A server stream of batches as an iterator that any thread may close (which cancels the call), and the
decoding of a sampled message.

A generator over the call could only be closed by the thread running it: a Loader's thread waiting in
`next()` for the server made `Loader.close()` fail with "generator already executing".

A batch sampled with decompress="client" carries its compressed fields' frames compressed, each distinct frame
once, and in their columns the index of each stacked frame into them: decoding decompresses each frame once
and stacks them into the columns (the compiled kernel the server stacks with). It runs where the stream is
iterated: in a Loader, on its prefetch thread.
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

from replayd.client.retries import cut_short_by_deadline, server_retry_after
from replayd.server import kernels
from replayd.wire import codec
from replayd.wire.frame_fields import decompress_many, stacked_shape
from replayd.wire.frames import SampledMessage

log = logging.getLogger("replayd.client")


def decode_sample(message: SampledMessage) -> dict[str, np.ndarray]:
    """A sampled batch as numpy arrays: views of the message, and the shipped compressed fields decompressed and
    stacked into their columns (fresh arrays)."""
    columns = codec.decode(message.batch)
    if not message.frames:
        return columns
    columns = dict(columns)
    for shipped, frames in message.frames:
        spec = shipped.spec
        shape, dtype, stack = tuple(spec.shape), np.dtype(spec.dtype), spec.stack if spec.HasField("stack") else 1
        frame_bytes = dtype.itemsize * math.prod(shape)
        decoded = decompress_many(spec.compression, frames, frame_bytes).view(dtype).reshape(len(frames), *shape)
        stacked: dict[int, np.ndarray] = {}  # an aliased column (bootstrap_ of 1-step transitions) is stacked once
        for name in shipped.columns:
            indices = columns[name]
            if id(indices) not in stacked:
                rows = indices.reshape(-1, stack).astype(np.int64)  # (N, stack)
                leading = indices.shape[:-1] if stack > 1 else indices.shape
                out = np.empty(leading + stacked_shape(shape, stack, spec.stack_axis), dtype)
                kernels.stack_frames(out, decoded, rows, int(spec.stack_axis == 0))
                stacked[id(indices)] = out
            columns[name] = stacked[id(indices)]
    return columns


class BatchStream:
    """Decoded batches (numpy views of each message) of one server-streaming call.

    `close()` cancels the call, from any thread; iterating after it ends the iteration. A stream dropped
    without close() is cancelled when gRPC collects the call. A stream the server refused as busy before
    its first message (nothing was sampled) is opened again after the server's retry-after hint, within
    the stream's `timeout` (None: no deadline, so it keeps trying, with a warning in the log). One the
    server refuses until its deadline fails with the refusal (UNAVAILABLE, "the server is busy").
    """

    def __init__(self, open_call: Callable[[float | None], Any], timeout: float | None,
                 on_unavailable: Callable[[], None] | None = None,
                 decode: Callable[[Any], dict[str, np.ndarray]] = codec.decode) -> None:
        self._open_call = open_call  # open_call(seconds): the grpc call, an iterator of payloads that can be cancelled
        self._decode = decode  # a payload -> its batch (decode_sample for sampled messages)
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
        return self._decode(payload)

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
