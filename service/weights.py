"""Parameter broadcast: the newest safetensors blob per name. Learners publish, actors fetch."""

from __future__ import annotations

import json
import struct
import threading

from service.errors import InvalidArgument
from service.schema import check_buffer_name


def check_safetensors(payload: bytes) -> None:
    """Rejects anything that is not a safetensors file (8-byte header length + JSON header + data)."""
    if len(payload) < 8:
        raise InvalidArgument(f"safetensors: payload of {len(payload)} bytes is shorter than its 8-byte header")
    (header_length,) = struct.unpack("<Q", payload[:8])
    if header_length > len(payload) - 8:
        raise InvalidArgument(f"safetensors: header length {header_length} exceeds the {len(payload)}-byte payload")
    try:
        header = json.loads(payload[8 : 8 + header_length])
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidArgument(f"safetensors: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise InvalidArgument("safetensors: header must be a JSON object")
    # Actors load what is stored here: a tensor entry pointing outside the data would fail on every actor.
    data_bytes = len(payload) - 8 - header_length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise InvalidArgument(
                f"safetensors: tensor {name[:100]!r} expected data_offsets [begin, end] within the {data_bytes} data "
                f"bytes, got {offsets if isinstance(offsets, list) else entry!r:.100}"
            )


class WeightStore:
    def __init__(self) -> None:
        self._weights: dict[str, tuple[int, bytes]] = {}
        self._lock = threading.Lock()

    def publish(self, name: str, version: int, payload: bytes) -> tuple[bool, int]:
        """Stores `payload` if `version` is newer than the stored one; returns (accepted, stored version)."""
        check_buffer_name(name)
        if version < 1:
            raise InvalidArgument(f"weights version must be >= 1, got {version}")
        check_safetensors(payload)
        with self._lock:
            stored_version = self._weights.get(name, (0, b""))[0]
            if version <= stored_version:
                return False, stored_version
            self._weights[name] = (version, payload)
            return True, version

    def fetch(self, name: str, newer_than: int) -> tuple[int, bytes]:
        """(version, payload) if newer than `newer_than`, else (0, b"")."""
        with self._lock:
            version, payload = self._weights.get(name, (0, b""))
        return (version, payload) if version > newer_than else (0, b"")
