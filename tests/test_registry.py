"""The server's buffers by name: a name is taken once, and a buffer handed over under a taken name is freed."""

from __future__ import annotations

import numpy as np
import pytest

from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.registry import BufferRegistry
from replayd.server.schema import Field
from replayd.server.storage.shared_arrays import segments
from replayd.wire.errors import FailedPrecondition, ResourceExhausted, Unavailable
from tests.conftest import TEST_INSTANCE

FIELDS = [Field("obs", "float32", (2,), observation=True), Field("reward", "float32")]


def test_adding_a_second_buffer_under_a_taken_name_frees_it_and_keeps_the_first() -> None:
    """Two creates racing for one name: the loser's buffer (its shared memory already allocated) must be
    unlinked, not left behind for the life of the server, and the winner keeps serving."""
    instance = f"{TEST_INSTANCE}reg"
    registry = BufferRegistry(instance)
    try:
        first = EpisodicBuffer("b", instance, FIELDS, 64)
        registry.add("b", first)
        second = EpisodicBuffer("loser", instance, FIELDS, 64)  # segments of its own, handed over as "b"
        assert segments(f"rpd_{instance}_loser") == [f"rpd_{instance}_loser", f"rpd_{instance}_loser.data"]
        with pytest.raises(FailedPrecondition, match="buffer 'b' already exists"):
            registry.add("b", second)
        assert segments(f"rpd_{instance}_") == [f"rpd_{instance}_b", f"rpd_{instance}_b.data"]
        assert registry.get("b") is first and [name for name, _ in registry.all()] == ["b"]
        columns = {"obs": np.ones((4, 2), np.float32), "reward": np.ones(4, np.float32)}
        first.insert(columns, Spans.whole_episodes(np.array([3]), np.array([1], np.uint64), np.array([True])))
        batch = registry.episodic("b").sample(8, TransitionsMode(1, 0.9), np.random.default_rng(0))
        np.testing.assert_array_equal(batch["obs"], np.ones((8, 2), np.float32))
    finally:
        registry.close()  # a leaked "loser" is unlinked (and reported) by conftest's leak check


def test_a_buffer_past_the_servers_most_is_refused_and_freed() -> None:
    """Each buffer keeps 4 file descriptors: tiny buffers created without end exhausted a 1024 limit."""
    instance = f"{TEST_INSTANCE}most"
    registry = BufferRegistry(instance, max_buffers=2)
    try:
        for name in ("a", "b"):
            registry.reserve_check(name)
            registry.add(name, EpisodicBuffer(name, instance, FIELDS, 8))
        with pytest.raises(ResourceExhausted, match="buffer 'c': the server holds 2 buffers, its most"):
            registry.reserve_check("c")
        with pytest.raises(ResourceExhausted, match="its most"):
            registry.add("c", EpisodicBuffer("c", instance, FIELDS, 8))
        assert segments(f"rpd_{instance}_c") == []  # the refused buffer's memory freed
        registry.delete("a")
        registry.add("c", EpisodicBuffer("c", instance, FIELDS, 8))  # room again
    finally:
        registry.close()


def test_a_buffer_added_after_the_registry_closed_is_refused_and_freed() -> None:
    """A CreateBuffer still running when the server stops (gRPC does not wait for its handler) hands its
    buffer over after close(): it is refused and freed, not kept in the closed registry with its segments
    left in /dev/shm."""
    instance = f"{TEST_INSTANCE}late"
    registry = BufferRegistry(instance)
    late = EpisodicBuffer("late", instance, FIELDS, 8)  # allocated before the stop, handed over after it
    registry.close()
    with pytest.raises(Unavailable, match="stopping"):
        registry.add("late", late)
    assert segments(f"rpd_{instance}_") == []
    with pytest.raises(Unavailable, match="stopping"):
        registry.reserve_check("other")
