"""Crash recovery: a server restarted under the instance name of a killed one reattaches to its buffers.

Episodic buffers keep everything a writer needs in shared memory; `EpisodicBuffer.recover` checks the
segments and repairs what an interrupted insert left half done. Segments that fail the checks (and rollout
buffers, whose policy version lives in the writer) are unlinked and reported; the caller restores those
from a checkpoint when it has one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from replayd.server.buffers.episodic import EpisodicBuffer
from replayd.server.registry import BufferRegistry
from replayd.server.storage.shared_arrays import SharedArrays, remove_segment, segments
from replayd.wire.errors import FailedPrecondition

log = logging.getLogger("replayd")


@dataclass
class Recovery:
    recovered: list[str] = field(default_factory=list)
    lost: dict[str, str] = field(default_factory=dict)  # buffer -> why its segments were not reattached


def _kind(header_name: str) -> str | None:
    try:
        storage = SharedArrays.attach(header_name)
    except (FileNotFoundError, ValueError, KeyError):
        return None
    kind = storage.meta.get("kind")
    storage.close()
    return kind


def recover_instance(registry: BufferRegistry) -> Recovery:
    """Reattaches every buffer whose segments the instance's previous server left behind."""
    prefix = f"rpd_{registry.instance}_"
    result = Recovery()
    found = set(segments(prefix))
    for header in sorted(found):
        if header.endswith(".data"):
            if header[: -len(".data")] not in found:  # a create killed between its two segments
                remove_segment(header)
                log.warning("removed orphan data segment %r (no header)", header)
            continue
        name = header[len(prefix):]
        kind = _kind(header)
        try:
            if kind != "episodic":
                raise FailedPrecondition(f"a {kind or 'unreadable'} buffer cannot be reattached")
            buffer = EpisodicBuffer.recover(header)
            registry.add(name, buffer)
            result.recovered.append(name)
            log.info("recovered buffer %r: %d steps, %d episodes", name, buffer.stored_steps, buffer.episodes)
        except FailedPrecondition as exc:
            result.lost[name] = str(exc)
            remove_segment(header)
            remove_segment(header + ".data")
            log.warning("buffer %r was not reattached: %s", name, exc)
    return result
