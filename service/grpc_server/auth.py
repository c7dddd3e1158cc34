"""Optional bearer-token authentication for the gRPC side, and the rule for binding beyond loopback.

Clients send `authorization: Bearer <token>` metadata on every call (ReplayClient does so when given
`token=`). A call without it, or with another token, ends UNAUTHENTICATED before its request is parsed.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable

import grpc

AUTHORIZATION = "authorization"


def bearer(token: str) -> str:
    return f"Bearer {token}"


def token_matches(header: str | None, token: str) -> bool:
    """Constant-time comparison, so response timing does not reveal how much of a guess was right."""
    return header is not None and hmac.compare_digest(header.encode(), bearer(token).encode())


def check_token(token: str) -> None:
    """A token gRPC metadata and HTTP headers carry as it is: printable ASCII, no spaces at either end."""
    if not token or not (token.isascii() and token.isprintable()) or token != token.strip():
        raise ValueError(f"token: expected printable ASCII with no spaces at either end (what gRPC metadata and "
                         f"HTTP headers carry), got {len(token)} characters that are not")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve to any interface
        return False


def check_bind(host: str, token: str | None, insecure_bind_all: bool) -> None:
    """Refuses to expose an unauthenticated server beyond this machine unless explicitly told to."""
    if not token and not insecure_bind_all and not is_loopback(host):
        raise ValueError(
            f"refusing to listen on {host!r} without a token: anyone who can reach it could read and overwrite "
            "the buffers. Set --token (or REPLAYD_TOKEN), bind 127.0.0.1, or pass --insecure-bind-all on a "
            "trusted network"
        )


def _denied(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only rejects the call."""

    def reject(request, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(reject)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(reject)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(reject)
    return grpc.unary_unary_rpc_method_handler(reject)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Admits calls whose `authorization` metadata is `Bearer <token>`."""

    def __init__(self, token: str) -> None:
        check_token(token)
        self._token = token

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        metadata = dict(handler_call_details.invocation_metadata or ())
        header = metadata.get(AUTHORIZATION)
        if token_matches(header if isinstance(header, str) else None, self._token):
            return handler
        reason = "missing" if header is None else "wrong"
        return _denied(handler, f"{reason} bearer token: send metadata 'authorization: Bearer <token>'")
