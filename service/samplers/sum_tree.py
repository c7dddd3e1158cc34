"""Vectorized sum tree and min tree over priorities, in caller-supplied (shared-memory) arrays.

Layout: a binary heap of 2 * leaves nodes, 1-based: node 1 is the root, node n has children 2n and
2n + 1, leaf i is node leaves + i (node 0 is unused). `leaves` is a power of two >= capacity, so every
level is full and a node's children are adjacent: viewing the array as (leaves, 2) pairs, row n holds
node n's two children, and one gather fetches both.

Batches are updated level by level (the set of touched parents, each recomputed from its two
children), and B prefix sums descend together, so the Python loops run over the tree's depth only.
Parents are recomputed from their children rather than patched with deltas, so no rounding drift
accumulates however many updates a leaf sees.
"""

from __future__ import annotations

import numpy as np

from service.storage.shared_arrays import ArraySpec

# Levels of at most this many nodes are handled whole: one vector op over the level beats the
# per-level bookkeeping of a sparse update or descent.
_TOP_LEVEL = 1024
_DENSE_LEVEL = 16  # an update recomputes whole levels once it touches >= 1/_DENSE_LEVEL of a level's nodes


def leaves_for(capacity: int) -> int:
    return 1 << max(0, int(capacity - 1).bit_length())


class SumTree:
    """Sums and minima of non-negative leaf values; empty (zero) leaves hold +inf in the min tree."""

    def __init__(self, sums: np.ndarray, mins: np.ndarray) -> None:
        if sums.shape != mins.shape or sums.ndim != 1 or sums.size < 2 or sums.size & (sums.size - 1):
            raise ValueError(f"sum/min trees need equal 1-D power-of-two sizes, got {sums.shape} and {mins.shape}")
        self.sums, self.mins = sums, mins
        self.leaves = sums.size // 2
        self.depth = self.leaves.bit_length() - 1
        self._sum_pairs = sums.reshape(self.leaves, 2)  # row n: the children of node n
        self._min_pairs = mins.reshape(self.leaves, 2)

    @staticmethod
    def array_specs(prefix: str, capacity: int) -> list[ArraySpec]:
        size = 2 * leaves_for(capacity)
        return [ArraySpec(f"{prefix}.sum", "float64", (size,)), ArraySpec(f"{prefix}.min", "float64", (size,))]

    def clear(self) -> None:
        self.sums.fill(0.0)
        self.mins.fill(np.inf)

    @property
    def total(self) -> float:
        return float(self.sums[1])

    @property
    def min_positive(self) -> float:
        """The smallest positive leaf value (+inf when every leaf is zero)."""
        return float(self.mins[1])

    def get(self, leaves: np.ndarray) -> np.ndarray:
        return self.sums.take(np.asarray(leaves, dtype=np.int64) + self.leaves)

    def update(self, leaves: np.ndarray, values: np.ndarray) -> None:
        """Sets leaf values (>= 0); a leaf named more than once takes its last value."""
        leaves = np.asarray(leaves, dtype=np.int64).ravel()
        values = np.broadcast_to(np.asarray(values, dtype=np.float64), leaves.shape)
        if leaves.size == 0:
            return
        # A stable sort keeps repeats in request order; the last of each run is the write that wins.
        order = np.argsort(leaves, kind="stable")
        nodes = leaves[order] + self.leaves
        last = np.empty(nodes.size, dtype=bool)
        last[-1] = True
        np.not_equal(nodes[1:], nodes[:-1], out=last[:-1])
        nodes, values = nodes[last], values[order[last]]
        self.sums[nodes] = values
        self.mins[nodes] = np.where(values > 0, values, np.inf)
        level_size = self.leaves
        while level_size > 1:
            level_size //= 2
            if nodes.size >= level_size // _DENSE_LEVEL:
                # Few nodes per level left: recomputing the whole level is cheaper than deduplicating.
                self._recompute_levels(level_size)
                return
            nodes = nodes >> 1  # parents of a sorted array are sorted: drop adjacent repeats
            keep = np.empty(nodes.size, dtype=bool)
            keep[0] = True
            np.not_equal(nodes[1:], nodes[:-1], out=keep[1:])
            nodes = nodes[keep]
            pairs = self._sum_pairs.take(nodes, axis=0)
            self.sums[nodes] = pairs[:, 0] + pairs[:, 1]
            pairs = self._min_pairs.take(nodes, axis=0)
            self.mins[nodes] = np.minimum(pairs[:, 0], pairs[:, 1])

    def _recompute_levels(self, level_size: int) -> None:
        """Recomputes every node of the level with `level_size` nodes and of all levels above it."""
        while level_size >= 1:
            level = slice(level_size, 2 * level_size)
            pairs = self._sum_pairs[level]
            np.add(pairs[:, 0], pairs[:, 1], out=self.sums[level])
            pairs = self._min_pairs[level]
            np.minimum(pairs[:, 0], pairs[:, 1], out=self.mins[level])
            level_size //= 2

    def find_prefix(self, targets: np.ndarray) -> np.ndarray:
        """For each target in [0, total), the leaf i with sum(leaf < i) <= target < sum(leaf <= i).

        Only positive leaves are returned. The top levels are skipped in one step: a search in the
        running sums of one whole level of at most _TOP_LEVEL nodes. Below it, a step right is taken
        only into a positive subtree, so rounding in the subtractions can never strand a target on an
        empty leaf.
        """
        targets = np.array(targets, dtype=np.float64)
        top = min(self.leaves, _TOP_LEVEL)
        level = self.sums[top:2 * top]
        running = np.cumsum(level)
        nodes = np.searchsorted(running, targets, side="right")
        # A target at or past the last running sum (rounding near the total) takes the last positive node.
        np.minimum(nodes, int(np.flatnonzero(level)[-1]), out=nodes)
        targets -= np.where(nodes > 0, running.take(nodes - 1), 0.0)
        nodes += top
        while top < self.leaves:
            pairs = self._sum_pairs.take(nodes, axis=0)
            left = pairs[:, 0]
            right = targets >= left
            right &= pairs[:, 1] > 0
            targets -= left * right
            nodes += nodes
            nodes += right
            top *= 2
        return nodes - self.leaves
