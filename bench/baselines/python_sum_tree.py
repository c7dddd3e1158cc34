"""Classic per-item sum tree (the usual PER reference implementation): one Python loop per sample and
per update, walking the tree one node at a time."""

from __future__ import annotations

import random


class PythonSumTree:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tree = [0.0] * (2 * capacity)

    def update(self, index: int, value: float) -> None:
        node = index + self.capacity
        self.tree[node] = value
        node //= 2
        while node >= 1:
            self.tree[node] = self.tree[2 * node] + self.tree[2 * node + 1]
            node //= 2

    def find(self, target: float) -> int:
        node = 1
        while node < self.capacity:
            left = self.tree[2 * node]
            if target < left:
                node = 2 * node
            else:
                target -= left
                node = 2 * node + 1
        return node - self.capacity

    def sample(self, batch_size: int) -> list[int]:
        total = self.tree[1]
        return [self.find(random.random() * total) for _ in range(batch_size)]
