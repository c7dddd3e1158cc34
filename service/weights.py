"""Parameter broadcast: the newest safetensors blob per name. Learners publish, actors fetch."""

from __future__ import annotations

import threading
from typing import NamedTuple

import safetensors

from replayd.server.schema import check_buffer_name
from replayd.wire.errors import InvalidArgument, ResourceExhausted


def check_safetensors(payload: bytes) -> None:
    """Rejects anything the safetensors library cannot load (header, dtypes, shapes, offsets that must tile
    the data): actors load what is stored here, and a bad blob would fail on every one of them."""
    try:
        safetensors.deserialize(payload)
    except safetensors.SafetensorError as exc:
        raise InvalidArgument(f"safetensors: {exc}") from exc


class StoredWeights(NamedTuple):
    version: int  # 0: nothing stored, or nothing newer than a fetch asked for
    payload: bytes
    final: bool  # published as its publisher's last version: no newer one will come


# Names the store holds at most: one per learner (and per model it broadcasts) is what it is for; without a
# bound a client could fill the server's memory with blobs under new names (each up to the message limit).
MAX_NAMES = 64


class WeightStore:
    def __init__(self) -> None:
        self._weights: dict[str, StoredWeights] = {}
        self._lock = threading.Lock()

    def publish(self, name: str, version: int, payload: bytes, final: bool = False) -> tuple[bool, int]:
        """Stores `payload` if `version` is newer than the stored one; returns (accepted, stored version).
        A newer version replaces a final one too (a new learner took the name over)."""
        check_buffer_name(name)
        if version < 1:
            raise InvalidArgument(f"weights version must be >= 1, got {version}")
        check_safetensors(payload)
        with self._lock:
            stored_version = self._weights.get(name, _NOTHING).version
            if version <= stored_version:
                return False, stored_version
            if name not in self._weights and len(self._weights) >= MAX_NAMES:
                raise ResourceExhausted(f"weights {name!r}: the server holds weights under {MAX_NAMES} names "
                                        "already, its most")
            self._weights[name] = StoredWeights(version, payload, final)
            return True, version

    def fetch(self, name: str, newer_than: int) -> StoredWeights:
        """The stored weights if newer than `newer_than`, else version 0 and no payload; `final` either way."""
        with self._lock:
            stored = self._weights.get(name, _NOTHING)
        return stored if stored.version > newer_than else StoredWeights(0, b"", stored.final)


_NOTHING = StoredWeights(0, b"", False)
