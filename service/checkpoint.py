"""Checkpoints: every buffer of a registry written to disk as Arrow IPC files plus a manifest, and restored.

Layout under a checkpoint root DIR:

    DIR/LATEST                           name of the newest complete checkpoint
    DIR/ckpt-000007/manifest.json        format and layout version; per buffer: kind, the configuration that
                                         recreates it, its arrays (dtype, shape, file, CRC-32 of the array's
                                         bytes), its Python-side state
    DIR/ckpt-000007/<buffer>/<array>.arrow
                                         one Arrow IPC file per shared array: one column named after the
                                         array, the array flattened in its own dtype (the shape is in the
                                         manifest), as record batches of whole rows (the chunks it was copied in)

Atomicity. A checkpoint is written into DIR/.tmp-ckpt-..., every file and the directories are fsynced, the
manifest is written last, then the directory is renamed to its final name and LATEST is replaced the same
way (temporary name, fsync, rename, fsync of DIR). A crash leaves the previous LATEST in place; restore
never reads a .tmp-* directory or one without manifest.json, and the next checkpoint written to DIR removes
the temporary files of writers that died.

Consistency while serving. Each buffer is a consistent snapshot of itself (buffers are snapshotted one after
the other, not at one instant together). Episodic buffers: under the buffer's lock, everything but the field
columns is copied at once (state, row bounds, extent table, sampler and remover arrays, open extents,
counters, limiter and dedup state: O(capacity) small integers). The field columns (and the compressed fields'
per-row frame offsets and lengths), the bulk, are then copied in chunks of rows (`chunk_bytes`), and the
compressed fields' arenas in chunks of bytes, taking the lock per chunk only, so samples and inserts run
between chunks. A chunk copied later is still the snapshot's data: the writer never changes the row of a live
position (>= the tail) -- appends land in reserved rows past the snapshot's landed rows, moves copy to the
head and only relabel the old rows, and a row is overwritten only after its position was evicted, which first
moves the tail past it (the same invariant lock-free readers rely on, service/buffers/ring.py). So a chunk is
clean unless the tail, read under the lock with the chunk, has passed one of the snapshot's live positions
stored in the chunk's rows. Arenas alike: the bytes of a live position's frame never change, frames are
written only at the arena's head, after the extents whose frames those bytes held were evicted
(service/buffers/arena.py); an arena chunk is clean unless the head, read under the lock with the chunk, has
moved over bytes of the snapshot's live frames stored in it. If a chunk is not clean (the ring turned over
during the checkpoint), the snapshot is taken again; the last of SNAPSHOT_ATTEMPTS attempts copies every
column under one hold of the lock (a memory copy, no disk I/O under the lock). Rollout buffers are copied
whole under their lock (a memory copy; minibatches and pushes wait for it) and written afterwards.

Restore recreates each buffer with its configuration, checks that the arrays this code builds for it match
the checkpoint's (name, dtype, shape) and refuses the checkpoint naming the buffer and array otherwise,
copies every array back, checks its CRC-32 (a file damaged on disk would otherwise come back as a buffer
that breaks later, e.g. a flipped bit in its extent table), and sets the Python-side state, so that a
seeded sample draws the same batch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from replayd.server.buffers.arena import ARENA_HEAD, Arena
from replayd.server.buffers.episodic import EpisodicBuffer
from replayd.server.buffers.ring import HEAD, NEXT_SEQ, TAIL_POS, TAIL_SEQ
from replayd.server.buffers.rollout import RolloutBuffer, RolloutConfig, RolloutField
from replayd.server.registry import BufferRegistry
from replayd.wire.errors import FailedPrecondition, NotFound, ReplayError, Unavailable

log = logging.getLogger("replayd")

FORMAT = "replayd-checkpoint"
LAYOUT_VERSION = 2  # of the manifest: each field a dict of all its attributes; compressed fields in arenas
MANIFEST = "manifest.json"
LATEST = "LATEST"
CHUNK_BYTES = 64 * 2**20
SNAPSHOT_ATTEMPTS = 3
_NAME = re.compile(r"ckpt-(\d+)")
_write_lock = threading.Lock()  # one checkpoint at a time per process (RPC and periodic thread)
# What a checkpoint writer leaves if it dies: its temporary checkpoint or LATEST (named after its pid), and a
# checkpoint it renamed to remove.
_WRITING = re.compile(r"\.tmp-(?:ckpt-\d+|LATEST)-(\d+)-[0-9a-f]+")
_REMOVING = re.compile(r"\.tmp-removing-ckpt-\d+-[0-9a-f]+")


# ---------------------------------------------------------------------------------------------- files
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    with open(tmp, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.rename(tmp, path)
    _fsync(path.parent)


class _ArrayFile:
    """One array as an Arrow IPC file, appended to chunk by chunk (flattened in its own dtype); `crc32` is
    that of the bytes written so far."""

    def __init__(self, path: Path, name: str, dtype: np.dtype) -> None:
        self.path = path
        self.type = pa.from_numpy_dtype(dtype)
        self.schema = pa.schema([pa.field(name, self.type)])
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, self.schema)
        self.crc32 = 0

    def write(self, values: np.ndarray) -> None:
        flat = np.ascontiguousarray(values).reshape(-1)
        self.crc32 = zlib.crc32(flat.view(np.uint8), self.crc32)
        self._writer.write_batch(pa.record_batch([pa.array(flat, type=self.type)], schema=self.schema))

    def close(self) -> None:
        self._writer.close()
        self._sink.close()
        _fsync(self.path)


def _array_entries(arrays: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The manifest's entry of each array, but its CRC-32 (known once it is written: _with_crc32)."""
    return [{"name": name, "dtype": array.dtype.name, "shape": list(array.shape), "file": f"{name}.arrow"}
            for name, array in arrays.items()]


def _with_crc32(entries: list[dict[str, Any]], crc32: dict[str, int]) -> list[dict[str, Any]]:
    return [{**entry, "crc32": crc32[entry["name"]]} for entry in entries]


def _write_whole(directory: Path, arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """Writes each array to its file; returns their CRC-32s."""
    crc32 = {}
    for name, values in arrays.items():
        out = _ArrayFile(directory / f"{name}.arrow", name, values.dtype)
        out.write(values)
        out.close()
        crc32[name] = out.crc32
    return crc32


# ---------------------------------------------------------------------------------------------- write
def _ring_rows_overlap(lo: int, hi: int, row_lo: int, row_hi: int, capacity: int) -> bool:
    """Whether the ring rows of positions [lo, hi) meet rows [row_lo, row_hi)."""
    if hi <= lo:
        return False
    if hi - lo >= capacity:
        return True
    a, b = lo % capacity, hi % capacity
    pieces = [(a, b)] if a < b else [(a, capacity), (0, b)]
    return any(x < row_hi and row_lo < y for x, y in pieces)


@dataclass(frozen=True)
class _Region:
    """Arrays of a buffer copied in chunks along their first axis: ring rows (the columns and per-row frame
    tables), or an arena's bytes. `damaged()`, read under the lock, is the absolute range [lo, hi) of the
    snapshot's live units that writes since the snapshot may have overwritten."""

    names: tuple[str, ...]
    length: int  # units of the first axis (ring rows, arena bytes)
    per_chunk: int
    damaged: Callable[[], tuple[int, int]]


def _regions(buffer: EpisodicBuffer, chunk_bytes: int) -> list[_Region]:
    """The bulk of an episodic buffer (call with its lock held: the snapshot's bounds are read here). Live rows
    are the positions [tail, head) of the snapshot; an arena's live bytes lie in [first frame of the tail
    extent, arena head). A write overwrites a live unit only after the tail moved past it (the invariant
    lock-free readers rely on, service/buffers/ring.py): rows below the tail now, arena bytes below its head
    now less its size."""
    ring, capacity = buffer.ring, buffer.capacity
    arrays = buffer.storage.arrays
    tail, head = int(ring.state[TAIL_POS]), int(ring.state[HEAD])
    rows = tuple(f"field.{name}" for name in ring.columns) + tuple(
        f"field.{name}.{part}" for name in ring.arenas for part in ("offset", "length"))
    row_bytes = sum(arrays[name][:1].nbytes for name in rows)
    regions = [_Region(rows, capacity, max(1, chunk_bytes // max(1, row_bytes)),
                       lambda: (tail, min(int(ring.state[TAIL_POS]), head)))]
    live = int(ring.state[TAIL_SEQ]) < int(ring.state[NEXT_SEQ])
    first_row = int(ring.extent_start[int(ring.state[TAIL_SEQ]) % ring.extent_slots]) % capacity
    for name, arena in ring.arenas.items():
        arena_head = int(arena.state[ARENA_HEAD])
        arena_tail = int(arena.offset[first_row]) if live else arena_head

        def damaged(arena: Arena = arena, arena_head: int = arena_head, arena_tail: int = arena_tail
                    ) -> tuple[int, int]:
            return max(arena_tail, arena_head - arena.size), min(arena_head, int(arena.state[ARENA_HEAD]) - arena.size)

        regions.append(_Region((f"field.{name}.arena",), arena.size, chunk_bytes, damaged))
    return regions


def _write_regions(buffer: EpisodicBuffer, directory: Path, regions: list[_Region],
                   on_chunk: Callable[[], None] | None) -> tuple[dict[str, int], bool]:
    """Writes each region chunk by chunk, the lock held per chunk; (CRC-32s, whether a chunk was found torn)."""
    arrays = buffer.storage.arrays
    with buffer.live():  # the layout is read under the lock: a delete racing the chunks empties `arrays`
        dtypes = {name: arrays[name].dtype for region in regions for name in region.names}
    outputs = {name: _ArrayFile(directory / f"{name}.arrow", name, dtype) for name, dtype in dtypes.items()}
    try:
        for region in regions:
            for lo in range(0, region.length, region.per_chunk):
                hi = min(region.length, lo + region.per_chunk)
                with buffer.live():
                    chunk = {name: arrays[name][lo:hi].copy() for name in region.names}
                    damaged = region.damaged()
                if _ring_rows_overlap(*damaged, lo, hi, region.length):
                    return {name: out.crc32 for name, out in outputs.items()}, True
                for name, values in chunk.items():
                    outputs[name].write(values)
                if on_chunk is not None:
                    on_chunk()
    finally:
        for out in outputs.values():
            out.close()
    return {name: out.crc32 for name, out in outputs.items()}, False


def _write_episodic(buffer: EpisodicBuffer, directory: Path, chunk_bytes: int,
                    on_chunk: Callable[[], None] | None) -> dict[str, Any]:
    arrays = buffer.storage.arrays
    config = buffer.config()
    for attempt in range(1, SNAPSHOT_ATTEMPTS + 1):
        whole = attempt == SNAPSHOT_ATTEMPTS
        with buffer.live():
            # The layout is read under the lock: a delete racing the chunks below empties `arrays`.
            entries = _array_entries(arrays)
            regions = _regions(buffer, chunk_bytes)
            bulk = {name for region in regions for name in region.names}
            small = {name: array.copy() for name, array in arrays.items() if name not in bulk}
            state = buffer.python_state()
            copies = {name: arrays[name].copy() for name in bulk} if whole else None
        crc32 = _write_whole(directory, small)
        if copies is not None:  # last attempt: everything was copied under one hold of the lock
            crc32.update(_write_whole(directory, copies))
            break
        written, torn = _write_regions(buffer, directory, regions, on_chunk)
        crc32.update(written)
        if not torn:
            break
        log.info("checkpoint of buffer %r raced with evictions (attempt %d); taking the snapshot again",
                 buffer.name, attempt)
    return {"kind": "episodic", "config": config, "arrays": _with_crc32(entries, crc32), "state": state,
            "snapshot_attempts": attempt}


def _rollout_config(buffer: RolloutBuffer) -> dict[str, Any]:
    config = buffer.config
    return {"fields": [[f.name, f.dtype, list(f.shape)] for f in config.columns], "num_steps": config.num_steps,
            "num_envs": config.num_envs, "gamma": config.gamma, "gae_lambda": config.gae_lambda}


def _write_rollout(buffer: RolloutBuffer, directory: Path) -> dict[str, Any]:
    copies, state = buffer.snapshot()
    crc32 = _write_whole(directory, copies)
    # The copies' layout, not the shared arrays': a delete after the snapshot empties those.
    return {"kind": "rollout", "config": _rollout_config(buffer), "arrays": _with_crc32(_array_entries(copies), crc32),
            "state": state}


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _NAME.fullmatch(path.name)
        if match and (path / MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_leftovers(root: Path) -> None:
    """Removes what checkpoint writers that died left under `root` (a crash mid-write, a kill): temporary
    checkpoints and LATEST files of processes no longer running, or of an earlier process with this one's pid
    (a container's server is often pid 1; this process is not writing, it holds the write lock), and
    checkpoints renamed for removal. A running process's temporary files are its own to finish or remove.
    A checkpoint directory belongs to one server, on one host (its checkpoint numbers are chosen so too)."""
    for path in root.iterdir():
        writing = _WRITING.fullmatch(path.name)
        pid = int(writing.group(1)) if writing else None
        if (pid is not None and (pid == os.getpid() or not _running(pid))) or _REMOVING.fullmatch(path.name):
            log.info("checkpoint: removing %s, left by a writer that died", path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def write_checkpoint(registry: BufferRegistry, directory: str | os.PathLike, keep: int | None = None,
                     chunk_bytes: int = CHUNK_BYTES, on_chunk: Callable[[], None] | None = None) -> Path:
    """Writes every buffer of `registry` as a new checkpoint under `directory`; returns its manifest's path.

    `keep`: remove all but the newest `keep` complete checkpoints afterwards. `on_chunk`: called (without any
    lock held) after each chunk of an episodic buffer's rows is written (tests use it to interleave calls).
    """
    root = Path(directory)
    with _write_lock:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        numbers = [int(m.group(1)) for p in root.iterdir() if (m := _NAME.fullmatch(p.name))]
        final = root / f"ckpt-{max(numbers, default=0) + 1:06d}"
        tmp = root / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            buffers = []
            for name, buffer in registry.all():
                buffer_dir = tmp / name
                buffer_dir.mkdir()
                try:
                    if isinstance(buffer, EpisodicBuffer):
                        entry = _write_episodic(buffer, buffer_dir, chunk_bytes, on_chunk)
                    else:
                        entry = _write_rollout(buffer, buffer_dir)
                except NotFound:  # deleted while the checkpoint was being written: not part of it
                    shutil.rmtree(buffer_dir)
                    continue
                _fsync(buffer_dir)
                buffers.append({"name": name, **entry})
            if registry.closed:  # the server stopped under this checkpoint: its buffers went, not by a delete
                raise Unavailable("checkpoint: the server stopped while it was being written; it was discarded "
                                  "(LATEST still names the previous checkpoint)")
            manifest = {"format": FORMAT, "layout_version": LAYOUT_VERSION, "instance": registry.instance,
                        "buffers": buffers}
            with open(tmp / MANIFEST, "w") as file:
                json.dump(manifest, file)
                file.flush()
                os.fsync(file.fileno())
            _fsync(tmp)
            os.rename(tmp, final)
            _fsync(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _write_atomically(root / LATEST, f"{final.name}\n".encode())
        if keep is not None and keep > 0:
            for old in _complete(root)[:-keep]:
                if old != final:
                    # Renamed first: a crash mid-removal must not leave a ckpt-N whose manifest outlived arrays.
                    doomed = root / f".tmp-removing-{old.name}-{secrets.token_hex(4)}"
                    os.rename(old, doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
    log.info("checkpoint %s: %d buffer(s)", final, len(buffers))
    return final / MANIFEST


# ---------------------------------------------------------------------------------------------- restore
def check_writable(directory: str | os.PathLike) -> None:
    """Creates `directory` if need be and writes a file in it, so that a server refuses a checkpoint directory it
    cannot write before it serves (not at each periodic checkpoint, for its whole life). OSError naming it."""
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        raise OSError(f"checkpoint directory {str(directory)!r} cannot be written: {exc}") from None


def has_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether `directory` names a complete checkpoint (see latest_checkpoint)."""
    try:
        latest_checkpoint(directory)
    except FailedPrecondition:
        return False
    return True


def latest_checkpoint(directory: str | os.PathLike) -> Path:
    """The checkpoint `directory` names: itself (or its manifest) if it is one, else the checkpoint LATEST
    names under it, else the newest complete one. Incomplete ones (no manifest, .tmp-*) are never chosen."""
    path = Path(directory)
    if path.name == MANIFEST and path.is_file():
        return path.parent
    if (path / MANIFEST).is_file():
        return path
    pointer = path / LATEST
    if pointer.is_file():
        name = pointer.read_text(errors="replace").strip()  # damaged bytes only make it no checkpoint's name
        if _NAME.fullmatch(name) and (path / name / MANIFEST).is_file():
            return path / name
        log.warning("restore: %s names %r, which is not a complete checkpoint; using the newest complete one",
                    pointer, name)
    complete = _complete(path)
    if not complete:
        raise FailedPrecondition(f"restore: no complete checkpoint under {str(path)!r} (expected {LATEST} or "
                                 f"ckpt-N/{MANIFEST})")
    return complete[-1]


def _check_arrays(name: str, entry: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    saved = {a["name"]: a for a in entry["arrays"]}
    for array_name in sorted(set(saved) | set(arrays)):
        if array_name not in arrays:
            raise FailedPrecondition(f"buffer {name!r}: array {array_name!r} of the checkpoint is not part of the "
                                     "buffer this code builds from its configuration (incompatible schema)")
        built = arrays[array_name]
        if array_name not in saved:
            raise FailedPrecondition(f"buffer {name!r}: array {array_name!r} ({built.dtype} {list(built.shape)}) "
                                     "is missing from the checkpoint (incompatible schema)")
        got = saved[array_name]
        if not isinstance(got.get("crc32"), int):
            raise FailedPrecondition(f"buffer {name!r}: array {array_name!r} has no CRC-32 in the manifest")
        if got["file"] != f"{array_name}.arrow":  # the manifest names a file of the buffer's own directory
            raise FailedPrecondition(f"buffer {name!r}: array {array_name!r} points to file {got['file']!r}, "
                                     f"expected {array_name + '.arrow'!r}")
        if got["dtype"] != built.dtype.name or list(got["shape"]) != list(built.shape):
            raise FailedPrecondition(
                f"buffer {name!r}: array {array_name!r} is {got['dtype']} {list(got['shape'])} in the checkpoint, "
                f"but this code builds {built.dtype.name} {list(built.shape)} (incompatible schema)"
            )


def _load_array(path: Path, name: str, target: np.ndarray, expected_crc32: int) -> None:
    flat = target.reshape(-1)
    expected = pa.from_numpy_dtype(target.dtype)
    offset = 0
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source)
        if reader.schema.names != [name] or reader.schema.field(0).type != expected:
            raise FailedPrecondition(f"array {name!r}: {path} holds {reader.schema}, expected one column {name}: "
                                     f"{expected}")
        for i in range(reader.num_record_batches):
            values = reader.get_batch(i).column(0).to_numpy(zero_copy_only=False)
            if offset + len(values) > flat.size:
                raise FailedPrecondition(f"array {name!r}: {path} holds more than its {flat.size} values")
            flat[offset:offset + len(values)] = values
            offset += len(values)
    if offset != flat.size:
        raise FailedPrecondition(f"array {name!r}: {path} holds {offset} values, expected {flat.size}")
    crc32 = zlib.crc32(flat.view(np.uint8))
    if crc32 != expected_crc32:
        raise FailedPrecondition(f"array {name!r}: {path} holds values whose CRC-32 is {crc32:#010x}, the "
                                 f"manifest's is {expected_crc32:#010x} (the file was damaged)")


def _build_rollout(name: str, entry: dict[str, Any], instance: str, max_bytes: int | None) -> RolloutBuffer:
    config = entry["config"]
    fields = tuple(RolloutField(f, dtype, tuple(shape)) for f, dtype, shape in config["fields"])
    rollout_config = RolloutConfig(fields, int(config["num_steps"]), int(config["num_envs"]),
                                   gamma=config["gamma"], gae_lambda=config["gae_lambda"])
    return RolloutBuffer.create(name, instance, rollout_config, policy_version=int(entry["state"]["policy_version"]),
                                max_bytes=max_bytes)


def restore_checkpoint(directory: str | os.PathLike, registry: BufferRegistry,
                       max_bytes: int | None = None, only: set[str] | None = None) -> list[str]:
    """Recreates every buffer (or those named in `only`) of the checkpoint `directory` names (see
    latest_checkpoint) in `registry`.

    All or nothing: on any error the buffers restored so far are deleted again, and FailedPrecondition
    names the checkpoint, the buffer and what does not match. Returns the restored buffers' names.
    """
    path = latest_checkpoint(directory)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"restore {str(path)!r}: unreadable {MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict):
        raise FailedPrecondition(f"restore {str(path)!r}: {MANIFEST} holds a {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT or manifest.get("layout_version") != LAYOUT_VERSION:
        raise FailedPrecondition(
            f"restore {str(path)!r}: checkpoint format {manifest.get('format')!r} layout_version "
            f"{manifest.get('layout_version')!r}, this code reads {FORMAT!r} layout_version {LAYOUT_VERSION}"
        )
    try:
        entries = [(entry, str(entry["name"])) for entry in manifest["buffers"]]
    except (KeyError, TypeError) as exc:
        raise FailedPrecondition(f"restore {str(path)!r}: {MANIFEST} does not list its buffers by name "
                                 f"({type(exc).__name__}: {exc})") from None
    restored: list[str] = []
    try:
        for entry, name in entries:
            if only is not None and name not in only:
                continue
            try:
                registry.reserve_check(name)
                kind = entry["kind"]
                if kind == "episodic":
                    buffer = EpisodicBuffer.from_config(name, registry.instance, entry["config"], max_bytes)
                    arrays = buffer.storage.arrays
                elif kind == "rollout":
                    buffer = _build_rollout(name, entry, registry.instance, max_bytes)
                    arrays = buffer.shared.arrays
                else:
                    raise FailedPrecondition(f"unknown buffer kind {kind!r}")
                try:
                    _check_arrays(name, entry, arrays)
                    for array in entry["arrays"]:
                        _load_array(path / name / array["file"], array["name"], arrays[array["name"]],
                                    array["crc32"])
                    if isinstance(buffer, EpisodicBuffer):
                        buffer.restore_python_state(entry["state"])
                    else:
                        buffer.restore_state(entry["state"])
                except BaseException:
                    buffer.close(unlink=True)
                    raise
                registry.add(name, buffer)
            except (ReplayError, OSError, KeyError, TypeError, ValueError, pa.ArrowException) as exc:
                detail = str(exc) if str(exc).startswith(f"buffer {name!r}") else f"buffer {name!r}: {exc}"
                raise FailedPrecondition(f"restore {str(path)!r}: {detail}") from exc
            restored.append(name)
    except BaseException:
        for name in restored:
            registry.delete(name)
        raise
    log.info("restored %d buffer(s) from %s: %s", len(restored), path, restored)
    return restored
