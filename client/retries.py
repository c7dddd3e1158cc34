"""Reading the server's retry-after hint off a failed call."""

from __future__ import annotations

import grpc

from service.errors import RETRY_AFTER_METADATA


def server_retry_after(exc: grpc.RpcError) -> float | None:
    """Seconds the server asked to wait before retrying a call it refused before doing anything (it was
    busy), else None. Such a call is safe to retry whatever it is: the server changed nothing."""
    trailing = getattr(exc, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == RETRY_AFTER_METADATA:
            return int(value) / 1000
    return None
