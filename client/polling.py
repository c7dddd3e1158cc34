"""Waiting on another process without fixed sleeps: poll a condition with exponential backoff until it
holds, a stop flag is raised, or a deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc

T = TypeVar("T")

# A server that is restarting (or a buffer a learner has not created yet) answers with these.
RECONNECT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED)


def never() -> bool:
    return False


def wait_until(check: Callable[[], T | None], deadline: float, what: str, stopped: Callable[[], bool] = never,
               retry_codes: tuple[grpc.StatusCode, ...] = RECONNECT, delay: float = 0.002,
               max_delay: float = 0.25) -> T | None:
    """Returns the first truthy result of `check()`; None once `stopped()`; TimeoutError after `deadline`.

    gRPC errors with a code in `retry_codes` count as "not yet" (the server or buffer may be coming up).
    """
    while True:
        try:
            result = check()
        except grpc.RpcError as exc:
            if exc.code() not in retry_codes:
                raise
            result, reason = None, f": {exc.code().name} {exc.details()}"
        else:
            reason = ""
        if result:
            return result
        if stopped():
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen before the deadline{reason}")
        time.sleep(delay)
        delay = min(delay * 2, max_delay)
