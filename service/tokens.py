"""Bearer tokens, shared by the gRPC and HTTP sides, and the rule for binding beyond loopback.

Clients send `authorization: Bearer <token>` (gRPC metadata, or the HTTP header) on every call.
"""

from __future__ import annotations

import hmac
import ipaddress

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
