"""Vectorized K-ary sum tree and min tree over priorities, in caller-supplied (shared-memory) arrays.

Layout (K = 8): the tree is stored level by level, each level contiguous: the root (index 0), the top
level, ..., the leaves. The leaf level holds `capacity` leaves rounded up to a multiple of K; each
level above holds one node per K nodes of the level below, rounded up to a multiple of K, until a
level has at most _TOP_LEVEL nodes: that is the top level, and the root is the sum (min) of all of
it. Below the top level, node j has its children at [K*j, K*j + K) of the next level, so viewing
that level as rows of K, row j is node j's children and one row gather fetches them all. Padding
nodes stay 0 in the sum tree and +inf in the min tree, like empty leaves. 1,000,000 leaves give
levels of 1, 248, 1960, 15632, 125000 and 1000000 nodes.

Why K-ary, and why 8: at a million leaves each level below the top is a random read that misses the
cache once per item of a batch. A binary heap walks 20 levels; K = 8 walks 4 below a top level of 248
nodes, and eight float64 children are exactly one 64-byte cache line, so a row read costs one miss, like
a binary heap's pair.

A batch's descent and update are compiled loops (_kernels.tree_find, tree_update): as numpy calls, a few
per level, they cost ~140 µs each for 256 items at a million leaves, most of it call overhead. A descent
searches the top level's running sums, then each level's K children by running sums added in order, as a
cumulative sum adds them. An update sets each leaf and recomputes its ancestors from their children (an
update of most leaves recomputes whole levels instead), so no rounding drift accumulates however many
updates a leaf sees. The min tree exists only for the root's min_positive; the descent reads the sum tree
alone.
"""

from __future__ import annotations

import itertools

import numpy as np

from replayd.server.kernels import _kernels
from replayd.server.storage.shared_arrays import ArraySpec

K = 8  # children per node; one row of K float64 children is one 64-byte cache line
# The levels stop growing upward at the first level of at most this many nodes (the top level), which
# the root sums whole: a descent searches the top level's running sums, computed once per batch.
_TOP_LEVEL = 256
# An update of more than this many leaves per node of the level above the leaves recomputes whole levels.
_DENSE_PER_ITEM = 2

_ONES = np.ones(K)  # a row of K children @ _ONES: their sum


def level_sizes(capacity: int) -> list[int]:
    """Node counts of the levels for a tree of at least `capacity` leaves: root, top level, ..., leaves."""
    sizes = [-(-max(1, capacity) // K) * K]
    while sizes[-1] > _TOP_LEVEL:
        sizes.append(-(-sizes[-1] // (K * K)) * K)  # one node per K below, rounded up to whole rows
    return [1, *sizes[::-1]]


def tree_size(capacity: int) -> int:
    """Elements of each of the sum and min arrays of a tree for `capacity` leaves."""
    return sum(level_sizes(capacity))


class SumTree:
    """Sums and minima of non-negative leaf values; empty (zero) leaves hold +inf in the min tree."""

    def __init__(self, sums: np.ndarray, mins: np.ndarray) -> None:
        if sums.shape != mins.shape or sums.ndim != 1:
            raise ValueError(f"sum/min trees need equal 1-D shapes, got {sums.shape} and {mins.shape}")
        # The arrays come from array_specs(capacity); recover the leaf count from their size (tree_size
        # grows strictly with the leaf count, one step per K leaves).
        low, high = 1, max(1, sums.size // K)
        while low < high:
            middle = (low + high) // 2
            if tree_size(middle * K) < sums.size:
                low = middle + 1
            else:
                high = middle
        sizes = level_sizes(low * K)
        if sum(sizes) != sums.size:
            raise ValueError(f"{sums.size} elements is not the size of a {K}-ary sum tree (see tree_size)")
        self.sums, self.mins = sums, mins
        self.leaves = sizes[-1]
        starts = np.cumsum([0, *sizes]).tolist()
        self._level_starts = np.array(starts, dtype=np.int64)  # level d: [starts[d], starts[d + 1])
        # Level 0 is the root, level 1 the top level (the root's children, all of them).
        self._sum_levels = [sums[a:b] for a, b in itertools.pairwise(starts)]
        self._min_levels = [mins[a:b] for a, b in itertools.pairwise(starts)]
        self._leaf_sums, self._leaf_mins = self._sum_levels[-1], self._min_levels[-1]
        # Level d >= 2 as rows of K: row j is the children of node j of level d - 1.
        self._sum_rows = [None, None, *(level.reshape(-1, K) for level in self._sum_levels[2:])]
        self._min_rows = [None, None, *(level.reshape(-1, K) for level in self._min_levels[2:])]

    @staticmethod
    def array_specs(prefix: str, capacity: int) -> list[ArraySpec]:
        size = tree_size(capacity)
        return [ArraySpec(f"{prefix}.sum", "float64", (size,)), ArraySpec(f"{prefix}.min", "float64", (size,))]

    def clear(self) -> None:
        self.sums.fill(0.0)
        self.mins.fill(np.inf)

    @property
    def total(self) -> float:
        return float(self.sums[0])

    @property
    def min_positive(self) -> float:
        """The smallest positive leaf value (+inf when every leaf is zero)."""
        return float(self.mins[0])

    def get(self, leaves: np.ndarray) -> np.ndarray:
        return self._leaf_sums.take(np.asarray(leaves, dtype=np.int64))

    def update(self, leaves: np.ndarray, values: np.ndarray) -> None:
        """Sets leaf values (>= 0); a leaf named more than once takes its last value. IndexError for a leaf off
        the tree (nothing is written then)."""
        leaves = np.ascontiguousarray(leaves, dtype=np.int64).ravel()
        values = np.ascontiguousarray(np.broadcast_to(np.asarray(values, dtype=np.float64), leaves.shape))
        if leaves.size > _DENSE_PER_ITEM * self._sum_levels[-2].size:  # most leaves: whole levels are cheaper
            if leaves.size and (leaves.min() < 0 or leaves.max() >= self._leaf_sums.size):
                raise IndexError(f"a leaf is off the tree's {self._leaf_sums.size} leaves")
            # Fancy assignment does not promise which of repeated indices wins; a stable sort keeps repeats in
            # request order, and the last of each run is the write that wins.
            order = np.argsort(leaves, kind="stable")
            nodes = leaves.take(order)
            last = np.empty(nodes.size, dtype=bool)
            last[-1] = True
            np.not_equal(nodes[1:], nodes[:-1], out=last[:-1])
            nodes, values = nodes[last], values.take(order[last])
            self._leaf_sums[nodes] = values
            self._leaf_mins[nodes] = np.where(values > 0, values, np.inf)
            self._recompute_levels(len(self._sum_levels) - 2)
            return
        _kernels.tree_update(self.sums, self.mins, self._level_starts, leaves, values)

    def _recompute_levels(self, depth: int) -> None:
        """Recomputes every node of level `depth` and of all levels above it from their children."""
        for d in range(depth, 0, -1):
            rows = self._sum_rows[d + 1]
            np.matmul(rows, _ONES, out=self._sum_levels[d][:rows.shape[0]])
            rows = np.ascontiguousarray(self._min_rows[d + 1].T)
            np.minimum.reduce(rows, axis=0, out=self._min_levels[d][:rows.shape[1]])
        self.sums[0] = self._sum_levels[1].sum()
        self.mins[0] = self._min_levels[1].min()

    def find_prefix(self, targets: np.ndarray) -> np.ndarray:
        """For each target in [0, total), the leaf i with sum(leaf < i) <= target < sum(leaf <= i).

        Only positive leaves are returned, also for targets at or past the total (rounding): they take
        the last positive leaf. Raises ValueError when every leaf is zero. A lock-free reader, whose tree
        changes under the search, may get -1: the search found no positive leaf.
        """
        targets = np.ascontiguousarray(targets, dtype=np.float64).ravel()
        nodes = np.empty(targets.size, dtype=np.int64)
        # Below the top level's total (the same additions as its running sums), a search can only stop at a
        # node whose running sum rises past the target, i.e. at a positive node. A node past its level's rows
        # is chosen only under a parent read larger than its children (a reader mid-update, or rounding at
        # the very end of the tree); the search then goes on in the last real node, whose last positive leaf
        # is what such a target takes. None past the target (it exceeds the node's children by a rounding
        # error): the last child, which may be empty.
        if not _kernels.tree_find(self.sums, self._level_starts, targets, nodes):
            raise ValueError("find_prefix on a tree whose leaves are all zero")
        np.minimum(nodes, self._leaf_sums.size - 1, out=nodes)  # past the last leaf: only after such a read
        values = self._leaf_sums.take(nodes)
        if not values.all():
            total = float(np.cumsum(self._sum_levels[1])[-1])
            for i in np.flatnonzero(values == 0).tolist():
                nodes[i] = self._descend_exact(min(max(float(targets[i]), 0.0), float(np.nextafter(total, 0.0))))
        return nodes

    def _descend_exact(self, target: float) -> int:
        """One target's descent by exact cumulative sums, choosing only positive nodes (the slow path);
        -1 when a node has no positive child (only in a tree that changes under a lock-free reader)."""
        node = 0
        for level in [self._sum_levels[1], *self._sum_rows[2:]]:
            children = np.array(level if node == 0 and level.ndim == 1 else level[node])  # a copy: stable
            positive = np.flatnonzero(children)
            if not positive.size:
                return -1
            running = np.cumsum(children)
            child = min(int(np.searchsorted(running, target, side="right")), int(positive[-1]))
            if child:
                target -= float(running[child - 1])
            node = node * K + child
        return node
