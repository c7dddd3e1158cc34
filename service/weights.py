"""Parameter broadcast: the newest safetensors blob per name. Learners publish, actors fetch."""

from __future__ import annotations

import threading

import safetensors

from service.errors import InvalidArgument
from service.schema import check_buffer_name


def check_safetensors(payload: bytes) -> None:
    """Rejects anything the safetensors library cannot load (header, dtypes, shapes, offsets that must tile
    the data): actors load what is stored here, and a bad blob would fail on every one of them."""
    try:
        safetensors.deserialize(payload)
    except safetensors.SafetensorError as exc:
        raise InvalidArgument(f"safetensors: {exc}") from exc


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
