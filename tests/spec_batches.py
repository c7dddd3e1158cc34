"""`Sequences` and `Hindsight` batches built in numpy from whole episodes, row by row as the batch modes'
specification describes them: the trainers' and learners' tests feed them where a server would, and
tests/test_sequence_batches.py checks the server's batches against them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Episode:
    """One stored episode: observation fields of L + 1 rows, step fields of L rows, how it ended."""

    observations: dict[str, np.ndarray]
    steps: dict[str, np.ndarray]
    terminated: bool

    @property
    def length(self) -> int:
        return len(next(iter(self.steps.values())))


def sequence_rows(episode: Episode, start: int, rows: int, n_step: int, gamma: float) -> dict[str, np.ndarray]:
    """The `rows` rows of a sequence starting at step `start` (boundary "pad"): every field, `mask`, `is_first`,
    `terminated`, `truncated`, and with n_step >= 1 `n_step_return`, `bootstrap_discount`, `bootstrap_step`."""
    L = episode.length
    out: dict[str, np.ndarray] = {}
    for name, column in [*episode.observations.items(), *episode.steps.items()]:
        values = np.zeros((rows, *column.shape[1:]), column.dtype)
        have = column[start:start + rows]
        values[:len(have)] = have
        out[name] = values
    t = start + np.arange(rows)
    out["mask"] = t < L
    out["is_first"] = t == 0
    out["terminated"] = (t == L - 1) & episode.terminated
    out["truncated"] = (t == L - 1) & (not episode.terminated)
    if n_step >= 1:
        rewards = episode.steps["reward"].astype(np.float64)
        out["n_step_return"] = np.zeros(rows, np.float32)
        out["bootstrap_discount"] = np.zeros(rows, np.float32)
        out["bootstrap_step"] = np.zeros(rows, np.int32)
        for i in np.flatnonzero(out["mask"]):
            n_eff = min(n_step, L - t[i])
            out["n_step_return"][i] = sum(gamma**k * rewards[t[i] + k] for k in range(n_eff))
            ends_terminated = episode.terminated and t[i] + n_eff == L
            out["bootstrap_discount"][i] = 0.0 if ends_terminated else gamma**n_eff
            out["bootstrap_step"][i] = i + n_eff
    return out


def sequences_batch(episodes: Sequence[Episode], picks: Sequence[tuple[int, int]], length: int, burn_in: int = 0,
                    n_step: int = 0, gamma: float = 0.99) -> dict[str, np.ndarray]:
    """A batch of sequences, one per (episode index, start step) in `picks`, each burn_in + length rows."""
    rows = [sequence_rows(episodes[e], start, burn_in + length, n_step, gamma) for e, start in picks]
    return {name: np.stack([r[name] for r in rows]) for name in rows[0]}


def hindsight_batch(episodes: Sequence[Episode], picks: Sequence[tuple[int, int, int]],
                    desired: str = "desired_goal") -> dict[str, np.ndarray]:
    """A batch of 1-step transitions, one per (episode index, step t, goal offset k) in `picks`: k = 0 keeps the
    stored goal, k >= 1 relabels it with the achieved goal at step t + k (the achieved-goal field is the
    goal field other than `desired`). The stored reward is kept (the client recomputes it)."""
    columns: dict[str, list[np.ndarray]] = {}

    def put(name: str, value: np.ndarray) -> None:
        columns.setdefault(name, []).append(np.asarray(value))

    for e, t, k in picks:
        episode = episodes[e]
        achieved = next(n for n in episode.observations if n.startswith("achieved"))
        for name, column in episode.observations.items():
            put(name, episode.observations[achieved][t + k] if name == desired and k else column[t])
            if name != desired:
                put(f"next_{name}", column[t + 1])
        for name, column in episode.steps.items():
            put(name, column[t])
        last = t == episode.length - 1
        put("terminated", last and episode.terminated)
        put("truncated", last and not episode.terminated)
        put("relabeled", k > 0)
        put("goal_offset", np.int64(k))
    return {name: np.stack(values) for name, values in columns.items()}
