"""The vectorized sum tree against plain numpy sums and a cumulative-sum search."""

from __future__ import annotations

import numpy as np
import pytest

from service.samplers.sum_tree import SumTree, leaves_for


def new_tree(capacity: int) -> SumTree:
    size = 2 * leaves_for(capacity)
    tree = SumTree(np.zeros(size), np.zeros(size))
    tree.clear()
    return tree


@pytest.mark.parametrize("capacity", [1, 2, 5, 1000, 5000])
def test_batch_updates_match_reference_and_last_write_wins(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    tree, ref = new_tree(capacity), np.zeros(capacity)
    for _ in range(30):
        leaves = rng.integers(0, capacity, rng.integers(1, 3 * capacity + 2))
        values = np.where(rng.random(leaves.size) < 0.2, 0.0, rng.random(leaves.size))
        tree.update(leaves, values)
        for leaf, value in zip(leaves, values, strict=True):  # reference: sequential writes
            ref[leaf] = value
        np.testing.assert_allclose(tree.total, ref.sum(), rtol=1e-12)
        np.testing.assert_array_equal(tree.get(np.arange(capacity)), ref)
        positive = ref[ref > 0]
        assert tree.min_positive == (positive.min() if positive.size else np.inf)


def test_find_prefix_matches_cumulative_search_and_skips_empty_leaves() -> None:
    rng = np.random.default_rng(1)
    capacity = 3000
    values = np.where(rng.random(capacity) < 0.5, 0.0, rng.random(capacity))
    tree = new_tree(capacity)
    tree.update(np.arange(capacity), values)
    targets = np.concatenate([rng.random(5000) * tree.total, [0.0, np.nextafter(tree.total, 0), tree.total]])
    leaves = tree.find_prefix(targets)
    expected = np.minimum(np.searchsorted(np.cumsum(values), targets[:-1], side="right"), capacity - 1)
    np.testing.assert_array_equal(leaves[:-1], expected)
    assert (values[leaves] > 0).all()  # also for the target at the total (rounding guard)
