"""Optional bearer-token authentication for the gRPC side (service/tokens.py holds the token rules).

Clients send `authorization: Bearer <token>` metadata on every call (ReplayClient does so when given
`token=`). A call without it, or with another token, ends UNAUTHENTICATED before its request is parsed.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from replayd.server.tokens import AUTHORIZATION, check_token, token_matches


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
