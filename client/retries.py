"""Reading the server's retry-after hint off a failed call."""

from __future__ import annotations

import time

import grpc

from replayd.wire.errors import RETRY_AFTER_METADATA


def server_retry_after(exc: grpc.RpcError) -> float | None:
    """Seconds the server asked to wait before retrying a call it refused before doing anything (it was
    busy), else None. Such a call is safe to retry whatever it is: the server changed nothing."""
    trailing = getattr(exc, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == RETRY_AFTER_METADATA:
            return int(value) / 1000
    return None


def cut_short_by_deadline(exc: grpc.RpcError, refusal: grpc.RpcError | None, deadline: float) -> bool:
    """Whether `exc` ended a retry of a call the server had refused as busy (`refusal`) because the call's
    own deadline (monotonic seconds) came before the server answered. The caller then raises the refusal,
    which says why the call failed and what to do; a server's own DEADLINE_EXCEEDED, saying what it waited
    for, comes before the deadline."""
    return (refusal is not None and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            and time.monotonic() >= deadline)
