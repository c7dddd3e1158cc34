"""Tabular gridworlds for checking Laplacian representation learners (ALLO) against exact eigenvectors.

Layouts are ASCII: ``#`` is a wall, anything else is a free cell.  The agent moves with 4 actions
(0 right, 1 up, 2 left, 3 down in (x, y) terms); a move into a wall or off the grid leaves it in
place.  Observations are the (x, y) = (column, row) coordinates normalized to [0, 1] (float32[2]).

Which operator's eigenvectors are the "truth" (following Gomez, Bowling & Machado, "Proper
Laplacian Representation Learning", ICLR 2024, and their code ``tarod13/laplacian_dual_dynamics``):

* ``P`` is the state-to-state transition matrix of the uniform random policy.  Because blocked
  moves become self-loops, every row and column of ``P`` sums to 1 and ``P`` is *symmetric*, so
  the stationary / uniform-start state distribution is uniform and no reweighting is needed.
* The Laplacian is ``L = I - P`` (the paper's code takes eigenvectors of ``P`` sorted by
  decreasing eigenvalue, i.e. of ``L`` by increasing eigenvalue).
* Training uses geometric pairs (offset k >= 1 with probability ∝ γ^(k-1)).  The operator this
  sampling induces is ``L_γ = I - (1-γ) Σ_{k>=1} γ^(k-1) P^k = I - (1-γ) P (I - γP)^{-1}``.  It is a
  function of ``P`` alone, and ``f(λ) = (1-γ)λ / (1-γλ)`` is strictly increasing on [-1, 1], so
  ``L_γ`` has exactly the same eigenvectors as ``L`` in the same order; only eigenvalues differ.
  ``laplacian(discount=γ)`` builds ``L_γ`` explicitly so tests can check that claim; by default
  (``discount=None``) the eigenvectors come from ``L = I - P`` as in the paper.

The metric is the paper's: per-dimension absolute cosine similarity between the learned
``phi_i`` and the true ``v_i`` over all states (absolute value = "up to sign"), and its average.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

# Classic Sutton, Precup & Singh (1999) four rooms: 11x11 interior, 104 free cells.
FOUR_ROOMS = """
#############
#     #     #
#     #     #
#           #
#     #     #
#     #     #
## ####     #
#     ### ###
#     #     #
#     #     #
#           #
#     #     #
#############
"""

# Single open room (no walls inside), 7x7 interior.
ONE_ROOM = """
#########
#       #
#       #
#       #
#       #
#       #
#       #
#       #
#########
"""

# Two rooms joined by one door.
TWO_ROOMS = """
#############
#     #     #
#     #     #
#           #
#     #     #
#     #     #
#############
"""

LAYOUTS: dict[str, str] = {"four_rooms": FOUR_ROOMS, "one_room": ONE_ROOM, "two_rooms": TWO_ROOMS}

# (dx, dy) per action: right, up, left, down (y grows downward, i.e. with the row index).
_ACTION_DELTAS = ((1, 0), (0, -1), (-1, 0), (0, 1))


def parse_layout(layout: str) -> np.ndarray:
    """ASCII layout -> bool array (rows, cols), True where the cell is free."""
    lines = [line for line in layout.strip("\n").splitlines() if line.strip()]
    if not lines:
        raise ValueError("layout is empty")
    width = max(len(line) for line in lines)
    free = np.zeros((len(lines), width), dtype=bool)
    for r, line in enumerate(lines):
        for c, ch in enumerate(line):
            free[r, c] = ch != "#"
    if not free.any():
        raise ValueError("layout has no free cell")
    return free


class GridWorld(gym.Env):
    """Gymnasium gridworld; observation = normalized (x, y) of the agent, float32[2]."""

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium convention)

    def __init__(self, layout: str = "four_rooms", max_episode_steps: int = 50) -> None:
        text = LAYOUTS.get(layout, layout)
        self.free = parse_layout(text)
        self.height, self.width = self.free.shape
        if max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}")
        self.max_episode_steps = max_episode_steps
        # State index <-> (row, col), row-major order.
        self.cells = np.argwhere(self.free)  # (N, 2) rows of (row, col)
        self.n_states = int(self.cells.shape[0])
        self._index = {(int(r), int(c)): i for i, (r, c) in enumerate(self.cells)}
        self._index_grid = np.full(self.free.shape, -1, dtype=np.int64)  # (rows, cols): state index or -1
        self._index_grid[self.cells[:, 0], self.cells[:, 1]] = np.arange(self.n_states)
        self.n_actions = 4
        # next_state[s, a] for deterministic dynamics.
        self.next_state = np.empty((self.n_states, self.n_actions), dtype=np.int64)
        for s, (r, c) in enumerate(self.cells):
            for a, (dx, dy) in enumerate(_ACTION_DELTAS):
                self.next_state[s, a] = self._index.get((int(r) + dy, int(c) + dx), s)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(self.n_actions)
        self._state = 0
        self._t = 0

    # --- observations -------------------------------------------------------------------------
    def all_observations(self) -> np.ndarray:
        """(N, 2) float32 observations of every state, in state-index order."""
        rows = self.cells[:, 0].astype(np.float32)
        cols = self.cells[:, 1].astype(np.float32)
        x = cols / max(self.width - 1, 1)
        y = rows / max(self.height - 1, 1)
        return np.stack([x, y], axis=1).astype(np.float32)

    def state_indices(self, obs: np.ndarray) -> np.ndarray:
        """Observations (N, 2) (as ``all_observations`` makes them) -> state indices (N,) int64."""
        obs = np.asarray(obs, dtype=np.float64).reshape(-1, 2)
        cols = np.rint(obs[:, 0] * max(self.width - 1, 1)).astype(np.int64)
        rows = np.rint(obs[:, 1] * max(self.height - 1, 1)).astype(np.int64)
        inside = (rows >= 0) & (rows < self.height) & (cols >= 0) & (cols < self.width)
        index = np.full(len(obs), -1, dtype=np.int64)
        index[inside] = self._index_grid[rows[inside], cols[inside]]
        if (index < 0).any():
            raise ValueError(f"observation {obs[np.argmax(index < 0)]} is not a free cell of this layout")
        return index

    def _obs(self) -> np.ndarray:
        return self.all_observations()[self._state]

    # --- gymnasium API ------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._state = int(self.np_random.integers(self.n_states))  # uniform start, as in the paper
        self._t = 0
        return self._obs(), {"state": self._state}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if not 0 <= int(action) < self.n_actions:
            raise ValueError(f"action must be in [0, {self.n_actions}), got {action}")
        self._state = int(self.next_state[self._state, int(action)])
        self._t += 1
        truncated = self._t >= self.max_episode_steps
        return self._obs(), 0.0, False, truncated, {"state": self._state}

    # --- exact spectral quantities ------------------------------------------------------------
    def transition_matrix(self) -> np.ndarray:
        """(N, N) uniform-random-policy transition matrix P (symmetric, doubly stochastic)."""
        P = np.zeros((self.n_states, self.n_states))
        for a in range(self.n_actions):
            np.add.at(P, (np.arange(self.n_states), self.next_state[:, a]), 1.0 / self.n_actions)
        return P

    def laplacian(self, discount: float | None = None) -> np.ndarray:
        """``I - P`` (discount None) or the geometric-sampling operator ``I - (1-γ) P (I - γP)^{-1}``."""
        P = self.transition_matrix()
        eye = np.eye(self.n_states)
        if discount is None:
            return eye - P
        if not 0.0 <= discount < 1.0:
            raise ValueError(f"discount must be in [0, 1), got {discount}")
        sr = (1.0 - discount) * P @ np.linalg.inv(eye - discount * P)
        return eye - (sr + sr.T) / 2.0  # symmetric already; symmetrize away round-off

    def laplacian_eigenvectors(self, d: int, discount: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Smallest-``d`` eigenpairs of the Laplacian: (eigvals (d,), eigvecs (N, d)), unit-norm columns.

        Sign convention: the largest-magnitude entry of each column is positive.
        """
        if not 1 <= d <= self.n_states:
            raise ValueError(f"d must be in [1, {self.n_states}], got {d}")
        eigvals, eigvecs = np.linalg.eigh(self.laplacian(discount))  # ascending
        eigvals, eigvecs = eigvals[:d], eigvecs[:, :d]
        idx = np.abs(eigvecs).argmax(axis=0)
        signs = np.sign(eigvecs[idx, np.arange(d)])
        signs[signs == 0] = 1.0
        return eigvals, eigvecs * signs

    def to_image(self, values: np.ndarray) -> np.ndarray:
        """(N,) per-state values -> (rows, cols) float array, NaN on walls (for heatmaps)."""
        img = np.full(self.free.shape, np.nan)
        img[self.cells[:, 0], self.cells[:, 1]] = values
        return img


def cosine_similarities(learned: np.ndarray, true: np.ndarray) -> np.ndarray:
    """Per-dimension |cos| between columns of ``learned`` (N, d) and ``true`` (N, d); shape (d,).

    The absolute value makes the metric sign-invariant (eigenvectors are defined up to sign).
    """
    learned = np.asarray(learned, dtype=np.float64)
    true = np.asarray(true, dtype=np.float64)
    if learned.shape != true.shape or learned.ndim != 2:
        raise ValueError(f"expected two (N, d) arrays of equal shape, got {learned.shape} and {true.shape}")
    num = np.abs((learned * true).sum(axis=0))
    den = np.linalg.norm(learned, axis=0) * np.linalg.norm(true, axis=0)
    return num / np.maximum(den, 1e-12)
