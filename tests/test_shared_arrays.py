import os
from multiprocessing import shared_memory

import numpy as np
import pytest

from service.errors import FailedPrecondition
from service.storage.shared_arrays import ArraySpec, SharedArrays, segment_exists


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


@pytest.mark.parametrize("content", [b"[]", b"42", b'"text"', b"{}"])
def test_attach_refuses_a_segment_without_a_replayd_header(content: bytes) -> None:
    """Recovery attaches every rpd_<instance>_ segment it finds: a foreign one must fail as ValueError."""
    name = f"rpd_test{os.getpid()}_foreign"
    segment = shared_memory.SharedMemory(name=name, create=True, size=64)
    try:
        segment.buf[:len(content)] = content
        with pytest.raises(ValueError, match="foreign"):
            SharedArrays.attach(name)
    finally:
        segment.close()
        segment.unlink()
