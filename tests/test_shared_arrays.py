import os
import threading
from multiprocessing import shared_memory

import numpy as np
import pytest

from replayd.server.storage import shared_arrays
from replayd.server.storage.shared_arrays import SHM_DIR, ArraySpec, SharedArrays, segment_exists
from replayd.wire.errors import FailedPrecondition, ResourceExhausted


def test_create_attach_unlink() -> None:
    name = f"rpd_test{os.getpid()}_arrays"
    owner = SharedArrays.create(name, [ArraySpec("a", "float32", (10, 3)), ArraySpec("b", "int64", (7,))], {"k": 1})
    try:
        owner.arrays["a"][:] = 1.5
        owner.arrays["b"][:] = np.arange(7)
        reader = SharedArrays.attach(name)
        assert reader.meta == {"k": 1}
        np.testing.assert_array_equal(reader.arrays["a"], np.full((10, 3), 1.5, np.float32))
        np.testing.assert_array_equal(reader.arrays["b"], np.arange(7))
        assert not reader.arrays["a"].flags.writeable
        owner.arrays["b"][3] = 42  # the reader sees the writer's memory, not a copy
        assert reader.arrays["b"][3] == 42
        for array in owner.arrays.values():
            assert array.ctypes.data % 64 == 0
        reader.close()
        with pytest.raises(FailedPrecondition, match="already exists"):
            SharedArrays.create(name, [ArraySpec("a", "float32", (1,))], {})
    finally:
        owner.close()
        owner.unlink()
    assert not segment_exists(name)
    assert not segment_exists(name + ".data")


@pytest.mark.parametrize(("content", "message"), [
    (b"[]", "does not hold a replayd header"), (b"42", "does not hold a replayd header"),
    (b'"text"', "does not hold a replayd header"), (b"{}", "has layout None/None, expected replayd-shm/1"),
])
def test_attach_refuses_a_segment_without_a_replayd_header(content: bytes, message: str) -> None:
    """Recovery attaches every rpd_<instance>_ segment it finds: a foreign one must fail as ValueError."""
    name = f"rpd_test{os.getpid()}_foreign"
    segment = shared_memory.SharedMemory(name=name, create=True, size=64)
    try:
        segment.buf[:len(content)] = content
        with pytest.raises(ValueError, match=f"segment '{name}' {message}"):
            SharedArrays.attach(name)
    finally:
        segment.close()
        segment.unlink()


def test_attach_refuses_a_header_of_another_layout_version_naming_it() -> None:
    """A segment left by a server of another replayd version: its arrays may be laid out otherwise, so
    recovery must not map them by this version's rules."""
    name = f"rpd_test{os.getpid()}_future"
    owner = SharedArrays.create(name, [ArraySpec("a", "float32", (4,))], {})
    try:
        with open(os.path.join(SHM_DIR, name), "r+b") as header:  # the segment's file, as another version wrote it
            layout = header.read()
            assert layout.count(b'"layout_version": 1,') == 1
            header.seek(0)
            header.write(layout.replace(b'"layout_version": 1,', b'"layout_version": 2,'))
        with pytest.raises(ValueError, match=f"segment '{name}' has layout replayd-shm/2, expected replayd-shm/1"):
            SharedArrays.attach(name).close()  # the close runs only if the header was wrongly accepted
    finally:
        owner.close()
        owner.unlink()


def test_a_create_whose_header_name_is_taken_leaves_no_data_segment() -> None:
    """The data segment is made first: when the header then turns out taken (a crashed server's leftover),
    the new data segment must go again, or each retry leaks one the size of the buffer."""
    name = f"rpd_test{os.getpid()}_taken"
    leftover = os.path.join(SHM_DIR, name)
    with open(leftover, "xb") as segment:
        segment.write(bytes(64))
    try:
        with pytest.raises(FailedPrecondition, match=f"segment '{name}' already exists"):
            SharedArrays.create(name, [ArraySpec("a", "float32", (1000,))], {})
        assert not segment_exists(name + ".data")
        assert segment_exists(name)  # the leftover is not ours to remove
    finally:
        os.unlink(leftover)


def test_a_buffer_the_space_left_after_the_others_fill_cannot_hold_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs backs pages when they are first written: a first buffer of 6 MB takes almost nothing of 10 MB
    free at create, and a second of 6 MB would fit the free space as read, then SIGBUS the server once both
    fill up. The second is refused; once the first is written through, the free space itself says so."""
    free = 10 * 2**20
    monkeypatch.setattr(shared_arrays, "shm_free_bytes", lambda: free)
    monkeypatch.setattr(shared_arrays, "segments", lambda prefix="rpd_": [n for n in os.listdir(SHM_DIR)
                                                                        if n.startswith(f"rpd_test{os.getpid()}")])
    first = SharedArrays.create(f"rpd_test{os.getpid()}_first", [ArraySpec("a", "uint8", (6 * 2**20,))], {})
    try:
        assert shared_arrays.promised_bytes() >= 6 * 2**20 - 4096  # nothing written yet
        with pytest.raises(ResourceExhausted, match=r"existing buffers will still fill \d+"):
            SharedArrays.create(f"rpd_test{os.getpid()}_second", [ArraySpec("a", "uint8", (6 * 2**20,))], {})
        assert not segment_exists(f"rpd_test{os.getpid()}_second.data")
        first.arrays["a"][:] = 1  # written through: backed, no longer promised
        assert shared_arrays.promised_bytes() < 2**16
        second = SharedArrays.create(f"rpd_test{os.getpid()}_second", [ArraySpec("a", "uint8", (2**20,))], {})
        second.close()
        second.unlink()
    finally:
        first.close()
        first.unlink()


def test_concurrent_creates_cannot_together_overcommit_the_free_space(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two creates of 6 MB with 10 MB free, each reading the free space before the other makes its segment:
    one is refused (both passing the check would get the server killed by SIGBUS once both were filled)."""
    both_checking = threading.Barrier(2)
    monkeypatch.setattr(shared_arrays, "shm_free_bytes", lambda: 10 * 2**20)
    monkeypatch.setattr(shared_arrays, "segments", lambda prefix="rpd_": [n for n in os.listdir(SHM_DIR)
                                                                        if n.startswith(f"rpd_test{os.getpid()}")])
    promised_bytes = shared_arrays.promised_bytes

    def promised_once_both_counted(prefix: str = "rpd_") -> int:
        promised = promised_bytes(prefix)
        try:  # let a second create count what is promised meanwhile, if anything lets it
            both_checking.wait(timeout=1)
        except threading.BrokenBarrierError:
            pass
        return promised

    monkeypatch.setattr(shared_arrays, "promised_bytes", promised_once_both_counted)
    created, refused = [], []

    def create(name: str) -> None:
        try:
            created.append(SharedArrays.create(name, [ArraySpec("a", "uint8", (6 * 2**20,))], {}))
        except ResourceExhausted as exc:
            refused.append(exc)

    threads = [threading.Thread(target=create, args=(f"rpd_test{os.getpid()}_race{k}",)) for k in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(created) == 1 and len(refused) == 1
    finally:
        for arrays in created:
            arrays.close()
            arrays.unlink()
