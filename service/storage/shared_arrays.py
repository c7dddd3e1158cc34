"""Named numpy arrays laid out in POSIX shared memory.

A buffer's arrays live in one data segment at 64-byte aligned offsets; a small header segment holds a
JSON description (names, dtypes, shapes, offsets, a layout version, and the owner's metadata), so
another process can attach by the header's name alone.
"""

from __future__ import annotations

import _posixshmem  # the POSIX calls behind shared_memory; used to unlink without the resource tracker
import json
import math
import os
import re
import threading
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from replayd.wire.errors import FailedPrecondition, ResourceExhausted

LAYOUT_VERSION = 1
MAGIC = "replayd-shm"
ALIGN = 64  # every array starts at a multiple of it
_NAME_OK = re.compile(r"[A-Za-z0-9_.-]{1,200}")


@dataclass(frozen=True)
class ArraySpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        # Python ints: a hostile shape must not wrap around int64 into a small size.
        return np.dtype(self.dtype).itemsize * math.prod(int(d) for d in self.shape)


def _untracked(segment: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    # Python's resource tracker unlinks segments when the creating process exits; lifetime is ours to
    # manage (crash recovery reattaches, readers must never unlink), so opt out.
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments as files


def shm_free_bytes() -> int | None:
    """Free space of the tmpfs behind POSIX shared memory (None where there is no /dev/shm)."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def promised_bytes(prefix: str = "rpd_") -> int:
    """Bytes the existing replayd segments may still claim: tmpfs backs a segment's pages only when they are
    first written, so the part of its size not yet backed is not in the free space yet, but will be taken."""
    promised = 0
    for name in segments(prefix):
        try:
            stats = os.stat(os.path.join(SHM_DIR, name))
        except FileNotFoundError:  # deleted meanwhile
            continue
        promised += max(stats.st_size - stats.st_blocks * 512, 0)
    return promised


def _size(nbytes: int) -> str:
    """A size to read at a glance, and exactly: '48,928.3 GB (48928267437667 bytes)'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


def check_allocation(header_name: str, nbytes: int, max_bytes: int | None) -> None:
    """Refuses a segment over `max_bytes` or over the shared memory left: tmpfs hands out sparse pages, so
    an oversized segment would be created fine and the server killed by SIGBUS on the first write past
    the space. What is left is the free space less what the existing buffers have not written yet (two
    buffers that each fit the free space may not fit together)."""
    # rpd_<instance>_<buffer> (instance names have no "_"): the name the user gave
    named = re.fullmatch(r"rpd_[^_]+_(.+)", header_name)
    what = f"buffer {named.group(1)!r}" if named else header_name
    if max_bytes is not None and nbytes > max_bytes:
        raise ResourceExhausted(
            f"{what}: needs {_size(nbytes)} of shared memory, over the server's limit of {_size(max_bytes)} "
            "(--max-buffer-gb); lower its size (capacity_steps, num_steps x num_envs, field shapes)"
        )
    free = shm_free_bytes()
    if free is None:
        return
    promised = promised_bytes()
    if nbytes > free - promised:
        raise ResourceExhausted(
            f"{what}: needs {_size(nbytes)} of shared memory, but /dev/shm has {_size(free)} free of which the "
            f"existing buffers will still fill {_size(promised)}; lower its size (capacity_steps, num_steps x "
            "num_envs, field shapes), delete a buffer, or give the host more shared memory"
        )


# One create at a time checks the free space and makes its segments: two creates that each fit the space
# left could otherwise both pass the check and together overcommit it (SIGBUS on a later write). A created
# segment counts in promised_bytes from then on.
_allocating = threading.Lock()


def _taken(name: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"shared-memory segment {name!r} already exists: a server of this instance crashed and left it, or "
        "another server uses the same --instance; `replayd segments --remove --instance ...` removes stale ones"
    )


def segments(prefix: str = "rpd_") -> list[str]:
    """Names of the POSIX shared-memory segments starting with `prefix` (header and data segments)."""
    try:
        return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))
    except FileNotFoundError:
        return []


def remove_segment(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)  # type: ignore[attr-defined]
    except FileNotFoundError:
        pass


def segment_identity(name: str) -> int | None:
    """The inode of segment `name` (None if there is none): a segment deleted and created again under the
    same name has another, while a mapping of the old one still reads fine."""
    try:
        return os.stat(os.path.join(SHM_DIR, name)).st_ino
    except FileNotFoundError:
        return None


def segment_exists(name: str) -> bool:
    try:
        segment = _untracked(shared_memory.SharedMemory(name=name, create=False))
    except FileNotFoundError:
        return False
    segment.close()
    return True


class SharedArrays:
    """A set of numpy arrays over one shared-memory segment, described by a header segment."""

    def __init__(
        self,
        header_name: str,
        header: shared_memory.SharedMemory,
        data: shared_memory.SharedMemory,
        layout: dict[str, Any],
        owner: bool,
        readonly: bool,
    ) -> None:
        self.header_name = header_name
        self._header = header
        self._data = data
        self.owner = owner
        self.meta: dict[str, Any] = layout["meta"]
        self.arrays: dict[str, np.ndarray] = {}
        for entry in layout["arrays"]:
            dtype = np.dtype(entry["dtype"])
            shape = tuple(entry["shape"])
            array = np.ndarray(shape, dtype=dtype, buffer=data.buf, offset=entry["offset"])
            if readonly:
                array.flags.writeable = False
            self.arrays[entry["name"]] = array
        self.nbytes = int(layout["data_bytes"])

    @classmethod
    def create(cls, header_name: str, specs: list[ArraySpec], meta: dict[str, Any],
               max_bytes: int | None = None) -> SharedArrays:
        """Creates both segments (zero-filled). Fails with FileExistsError if the name is taken, and with
        ResourceExhausted (nothing created) past `max_bytes` or the free shared memory."""
        if not _NAME_OK.fullmatch(header_name):
            raise ValueError(f"shared-memory name {header_name!r} must match {_NAME_OK.pattern}")
        entries, offset = [], 0
        for spec in specs:
            offset = (offset + ALIGN - 1) // ALIGN * ALIGN
            entries.append({"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape), "offset": offset})
            offset += spec.nbytes
        data_name = header_name + ".data"
        layout = {
            "magic": MAGIC,
            "layout_version": LAYOUT_VERSION,
            "data_segment": data_name,
            "data_bytes": offset,
            "arrays": entries,
            "meta": meta,
        }
        encoded = json.dumps(layout).encode()
        with _allocating:
            check_allocation(header_name, offset + len(encoded), max_bytes)
            try:
                data = _untracked(shared_memory.SharedMemory(name=data_name, create=True, size=max(offset, 1)))
            except FileExistsError:
                raise _taken(data_name) from None
            try:
                header = _untracked(shared_memory.SharedMemory(name=header_name, create=True, size=len(encoded)))
            except BaseException as exc:
                data.close()
                _posixshmem.shm_unlink(data._name)  # type: ignore[attr-defined]
                if isinstance(exc, FileExistsError):
                    raise _taken(header_name) from None
                raise
        header.buf[: len(encoded)] = encoded
        try:
            return cls(header_name, header, data, layout, owner=True, readonly=False)
        except BaseException:
            for segment in (data, header):
                segment.close()
                _posixshmem.shm_unlink(segment._name)  # type: ignore[attr-defined]
            raise

    @classmethod
    def attach(cls, header_name: str, readonly: bool = True) -> SharedArrays:
        """Maps an existing buffer's arrays by its header segment name."""
        header = _untracked(shared_memory.SharedMemory(name=header_name, create=False))
        try:
            layout = json.loads(bytes(header.buf).rstrip(b"\0"))
            if not isinstance(layout, dict):
                raise ValueError(f"segment {header_name!r} does not hold a replayd header (a JSON object)")
            if layout.get("magic") != MAGIC or layout.get("layout_version") != LAYOUT_VERSION:
                raise ValueError(
                    f"segment {header_name!r} has layout {layout.get('magic')}/{layout.get('layout_version')},"
                    f" expected {MAGIC}/{LAYOUT_VERSION}"
                )
            data = _untracked(shared_memory.SharedMemory(name=layout["data_segment"], create=False))
        except BaseException:
            header.close()
            raise
        return cls(header_name, header, data, layout, owner=False, readonly=readonly)

    def close(self) -> None:
        """Unmaps the segments. Arrays handed out earlier must not be used afterwards: they hold no export
        of the mapping, so they point into unmapped memory (readers guard this: buffers.lifetime)."""
        self.arrays.clear()
        for segment in (self._data, self._header):
            try:
                segment.close()
            except BufferError:
                # A memoryview of the mapping is still alive; the OS unmaps it when that view dies.
                pass

    def unlink(self) -> None:
        """Removes both segment names from the system (the memory goes once every mapping is closed)."""
        for segment in (self._data, self._header):
            try:
                _posixshmem.shm_unlink(segment._name)  # type: ignore[attr-defined]
            except FileNotFoundError:
                pass
