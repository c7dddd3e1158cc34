"""Baseline: sequence sampling over a flat storage that finds each start's episode with np.searchsorted over
the episodes' start rows, the way most replay libraries locate trajectory boundaries at sample time."""

from __future__ import annotations

import numpy as np


class SearchsortedSequences:
    """Episodes stored back to back (each with its final-observation row, as in our ring); starts are drawn
    uniformly over the stored steps and located by binary search."""

    def __init__(self, columns: dict[str, np.ndarray], lengths: np.ndarray) -> None:
        self.columns = columns
        rows = lengths + 1
        self.starts = np.concatenate([[0], np.cumsum(rows)[:-1]])  # (E,) first row of each episode
        self.finals = self.starts + lengths  # (E,) row of each episode's final observation
        is_step = np.ones(int(rows.sum()), dtype=bool)
        is_step[self.finals] = False
        self.steps = np.flatnonzero(is_step)  # rows a sequence may start at

    def sample(self, batch_size: int, steps: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        start = self.steps[rng.integers(0, self.steps.size, batch_size)]  # (B,)
        episode = np.searchsorted(self.starts, start, side="right") - 1  # (B,)
        final = self.finals[episode][:, None]  # (B, 1)
        rows = start[:, None] + np.arange(steps)  # (B, T)
        held = rows <= final  # (B, T)
        rows = np.minimum(rows, final)  # (B, T) never past the episode
        batch = {}
        for name, column in self.columns.items():
            gathered = column[rows]  # (B, T, ...)
            gathered[~held] = 0
            batch[name] = gathered
        batch["mask"] = rows < final
        return batch
