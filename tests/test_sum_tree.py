"""The K-ary sum tree against plain numpy sums, minima and a cumulative-sum search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from replayd.server.samplers.sum_tree import K, SumTree, level_sizes, tree_size

# Tiny, just over a multiple of K, one top level, several K-ary levels, and not powers of K.
CAPACITIES = [1, 2, 3, K - 1, K, K + 1, 100, 1000, 5000, 70_001]


def new_tree(capacity: int) -> SumTree:
    size = tree_size(capacity)
    tree = SumTree(np.zeros(size), np.zeros(size))
    tree.clear()
    return tree


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_layout_fits_capacity_and_is_recovered_from_the_array_size(capacity: int) -> None:
    sizes = level_sizes(capacity)
    assert sizes[0] == 1 and sizes[-1] >= capacity
    assert all(size % K == 0 for size in sizes[1:])
    assert all(child <= K * parent for parent, child in itertools.pairwise(sizes[1:]))
    assert new_tree(capacity).leaves == sizes[-1]
    with pytest.raises(ValueError):
        SumTree(np.zeros(tree_size(capacity) + 1), np.zeros(tree_size(capacity) + 1))


def check_against(tree: SumTree, ref: np.ndarray) -> None:
    np.testing.assert_allclose(tree.total, ref.sum(), rtol=1e-12)
    np.testing.assert_array_equal(tree.get(np.arange(ref.size)), ref)
    positive = ref[ref > 0]
    assert tree.min_positive == (positive.min() if positive.size else np.inf)
    # Every inner node of both trees is the sum / min of its children (padding: 0 / +inf).
    levels = level_sizes(ref.size)
    starts = np.cumsum([0, *levels])
    for depth in range(len(levels) - 1, 1, -1):
        sums = tree.sums[starts[depth]:starts[depth + 1]].reshape(-1, K)
        mins = tree.mins[starts[depth]:starts[depth + 1]].reshape(-1, K)
        parents = slice(starts[depth - 1], starts[depth])
        np.testing.assert_allclose(tree.sums[parents][:sums.shape[0]], sums.sum(axis=1), rtol=1e-12)
        np.testing.assert_array_equal(tree.mins[parents][:mins.shape[0]], mins.min(axis=1))
        assert (tree.sums[parents][sums.shape[0]:] == 0).all() and (tree.mins[parents][mins.shape[0]:] == np.inf).all()


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_batch_updates_match_reference_and_last_write_wins(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    tree, ref = new_tree(capacity), np.zeros(capacity)
    for round_ in range(30):
        # Small batches take the sparse path up the levels, large ones the dense recompute.
        size = rng.integers(1, 3 * capacity + 2) if round_ % 2 else rng.integers(1, min(capacity, 300) + 1)
        leaves = rng.integers(0, capacity, size)
        values = np.where(rng.random(leaves.size) < 0.2, 0.0, rng.random(leaves.size))
        tree.update(leaves, values)
        for leaf, value in zip(leaves.tolist(), values.tolist(), strict=True):  # reference: sequential writes
            ref[leaf] = value
        check_against(tree, ref)
    tree.update(np.arange(capacity), 0.0)
    check_against(tree, np.zeros(capacity))
    assert tree.total == 0


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_find_prefix_matches_cumulative_search_and_skips_empty_leaves(capacity: int) -> None:
    rng = np.random.default_rng(1 + capacity)
    values = np.where(rng.random(capacity) < 0.5, 0.0, rng.random(capacity))
    values[rng.integers(0, capacity)] = 0.5  # at least one positive leaf
    tree = new_tree(capacity)
    tree.update(np.arange(capacity), values)
    targets = rng.random(5000) * tree.total
    np.testing.assert_array_equal(tree.find_prefix(targets), np.searchsorted(np.cumsum(values), targets, side="right"))
    # Edges and rounding: 0, just below, at and past the total land on positive leaves, the last one at the end.
    edges = np.array([0.0, np.nextafter(tree.total, 0), tree.total, tree.total * (1 + 1e-12), 2 * tree.total])
    leaves = tree.find_prefix(edges)
    assert (values[leaves] > 0).all()
    assert leaves[0] == np.flatnonzero(values)[0] and (leaves[2:] == np.flatnonzero(values)[-1]).all()


def test_find_prefix_never_lands_on_a_zero_leaf_next_to_boundaries() -> None:
    # Sparse positive leaves between runs of zeros (including whole empty rows of K): targets at and
    # around every running-sum boundary must still end on the positive leaf whose interval holds them.
    rng = np.random.default_rng(7)
    capacity = 20_000
    values = np.zeros(capacity)
    positive = rng.choice(capacity, 300, replace=False)
    values[positive] = rng.random(300) * 10.0 ** rng.integers(-8, 3, 300)
    tree = new_tree(capacity)
    tree.update(np.arange(capacity), values)
    bounds = np.cumsum(values)[np.sort(positive)]
    targets = np.concatenate([bounds, np.nextafter(bounds, 0), np.nextafter(bounds, np.inf)])
    targets = targets[targets < tree.total]
    assert (values[tree.find_prefix(targets)] > 0).all()
    np.testing.assert_array_equal(tree.find_prefix(rng.random(4096) * tree.total) < capacity, True)


def test_find_prefix_on_an_empty_tree_raises() -> None:
    with pytest.raises(ValueError):
        new_tree(100).find_prefix(np.zeros(3))


def test_a_search_through_levels_a_writer_is_changing_returns_minus_one_not_an_error() -> None:
    """A lock-free reader may read inner sums that promise a leaf the writer already zeroed: the search
    then reports -1 (no positive leaf) for those targets, which the sampler draws again."""
    tree = new_tree(5000)
    tree.update(np.arange(5000), np.ones(5000))
    tree._leaf_sums[:2500] = 0.0  # leaves zeroed, inner levels not yet recomputed (as mid-update)
    leaves = tree.find_prefix(np.array([10.0, 1000.0, 4000.0]))
    assert leaves[0] == leaves[1] == -1
    assert leaves[2] >= 2500 and tree.get(leaves[2:3])[0] > 0


def test_a_search_under_a_parent_larger_than_its_children_stays_on_the_tree() -> None:
    """Mid-update (leaves and the level above them recomputed, the levels further up not yet) a search
    may step into a padding node, which has no children: it descends exactly instead of failing."""
    capacity = 3000  # levels with padding nodes below the top
    tree = new_tree(capacity)
    tree.update(np.arange(capacity), np.ones(capacity))
    tree._leaf_sums[2990:capacity] = 0.0
    tree._sum_levels[-2][: tree._sum_rows[-1].shape[0]] = tree._sum_rows[-1].sum(axis=1)
    leaves = tree.find_prefix(np.array([2999.5, 10.0]))
    assert leaves[1] == 10
    assert leaves[0] == -1 or (0 <= leaves[0] < 2990 and tree.get(leaves[:1])[0] > 0)


@pytest.mark.parametrize("size", [3, 5000])  # the compiled per-leaf update and the whole-level one
@pytest.mark.parametrize("leaf", [-1, 1000])
def test_an_update_naming_a_leaf_off_the_tree_raises_and_writes_nothing(size: int, leaf: int) -> None:
    tree = new_tree(1000)
    tree.update(np.arange(1000), np.linspace(0.1, 1.0, 1000))
    sums, mins = tree.sums.copy(), tree.mins.copy()
    leaves = np.arange(size) % 1000
    leaves[-1] = leaf
    with pytest.raises(IndexError, match="off the tree"):
        tree.update(leaves, 5.0)
    np.testing.assert_array_equal(tree.sums, sums)
    np.testing.assert_array_equal(tree.mins, mins)
