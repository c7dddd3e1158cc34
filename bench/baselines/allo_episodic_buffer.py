"""The ALLO episodic replay buffer and its two `sample()` versions, re-implemented for timing.

Layout as in that buffer: every component lives in a (max_episodes, max_len + 1, ...) array, one slot per
episode (slots reused round-robin once the buffer is full), with per-episode lengths and a `terminals`
component (1 at the step where the episode terminated; truncated episodes have none).

`sample(batch_size, discount)` draws an episode per sample, a start index in it, a horizon bound
`max_durations` from the terminals, a geometric offset clipped to that bound, and returns the
observation at the start and at start + offset (its geometric future-state pairs).

  * `sample_loop`: the per-sample Python loop that calls np.where on each sample's terminals slice.
  * `sample_vectorized`: the vectorized terminal-index sampler: the precomputed `terminal_indices`
    table (capped at 100 per episode, -1 padding), mask + sort, selection with nested np.where.

Defect kept on purpose: `add_episode` writes only the first `num_terms` entries of a reused slot's
`terminal_indices` row and never clears the rest, and the vectorized sampler masks with `>= 0` rather
than with `num_terminals`. Once slots are reused, a truncated episode (no terminal) inherits the previous
occupant's terminal positions, so its samples get the old episode's bound (see `bound_errors`).
Also kept: its "second terminal if there are two" quirk (irrelevant with one terminal per episode).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

MAX_TERMINALS = 100


class AlloEpisodicReplayBuffer:
    def __init__(self, max_episodes: int, max_len: int, components: Mapping[str, tuple[str, tuple[int, ...]]],
                 seed: int = 0) -> None:
        self._max_episodes = max_episodes
        self._max_len = max_len
        self._episodes: dict[str, np.ndarray] = {
            name: np.zeros((max_episodes, max_len + 1, *shape), dtype=dtype)
            for name, (dtype, shape) in components.items()
        }
        self._episodes["terminals"] = np.zeros((max_episodes, max_len + 1), dtype=np.float32)
        self._episode_lengths = np.zeros(max_episodes, dtype=np.int64)
        self._idx = 0
        self._size = 0
        self.rng = np.random.default_rng(seed)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._episodes.values())

    def add_episode(self, episode: Mapping[str, np.ndarray]) -> None:
        """`episode` holds every component with L + 1 rows (the buffer pads step components) and `terminals`."""
        length = len(episode["terminals"])
        for step_component, component_array in episode.items():
            self._episodes[step_component][self._idx, :length] = component_array
            if step_component == "terminals":
                terminal_positions = np.where(component_array == 1)[0]
                if "terminal_indices" not in self._episodes:
                    self._episodes["terminal_indices"] = np.full(
                        (self._max_episodes, MAX_TERMINALS), -1, dtype=np.int32
                    )
                    self._episodes["num_terminals"] = np.zeros(self._max_episodes, dtype=np.int32)
                num_terms = len(terminal_positions)
                if num_terms > 0:
                    n = min(num_terms, self._episodes["terminal_indices"].shape[1])
                    self._episodes["terminal_indices"][self._idx, :n] = terminal_positions[:n]
                    self._episodes["num_terminals"][self._idx] = n
                else:
                    self._episodes["num_terminals"][self._idx] = 0  # old indices stay: the defect
        self._episode_lengths[self._idx] = length
        self._idx = (self._idx + 1) % self._max_episodes
        self._size = min(self._size + 1, self._max_episodes)

    # ------------------------------------------------------------------ sampling
    def _draw(self, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        episode_idx = self.rng.integers(0, self._size, size=batch_size)
        transition_ranges = self._episode_lengths[episode_idx]
        obs_idx = (self.rng.random(batch_size) * (transition_ranges - 1)).astype(np.int64)
        return episode_idx, obs_idx, transition_ranges

    def durations_loop(self, episode_idx: np.ndarray, obs_idx: np.ndarray,
                       transition_ranges: np.ndarray) -> np.ndarray:
        batch_size = len(episode_idx)
        max_durations = np.zeros(batch_size, dtype=np.int32)
        for i in range(batch_size):
            ep_idx = episode_idx[i]
            start_idx = obs_idx[i]
            ep_length = transition_ranges[i]
            terminals = self._episodes["terminals"][ep_idx, start_idx:ep_length]
            terminal_indices = np.where(terminals == 1)[0]
            if len(terminal_indices) > 0:
                if len(terminal_indices) > 1:
                    max_durations[i] = terminal_indices[1]
                else:
                    max_durations[i] = terminal_indices[0]
            else:
                max_durations[i] = ep_length - start_idx - 1
        return max_durations

    def durations_vectorized(self, episode_idx: np.ndarray, obs_idx: np.ndarray,
                             transition_ranges: np.ndarray) -> np.ndarray:
        batch_term_indices = self._episodes["terminal_indices"][episode_idx]
        valid_mask = batch_term_indices >= obs_idx[:, None]
        valid_mask &= batch_term_indices >= 0
        relative_term_indices = batch_term_indices - obs_idx[:, None]
        relative_term_indices = np.where(valid_mask, relative_term_indices, 999999)
        sorted_terms = np.sort(relative_term_indices, axis=1)
        num_valid_terms = np.sum(valid_mask, axis=1)
        return np.where(
            num_valid_terms >= 2,
            sorted_terms[:, 1],
            np.where(num_valid_terms >= 1, sorted_terms[:, 0], transition_ranges - obs_idx - 1),
        )

    def _geometric_pairs(self, episode_idx: np.ndarray, obs_idx: np.ndarray, max_durations: np.ndarray,
                         discount: float) -> dict[str, np.ndarray]:
        durations = self.rng.geometric(1.0 - discount, size=len(episode_idx))
        durations = np.minimum(durations, np.maximum(max_durations, 1))
        future_idx = obs_idx + durations
        obs = self._episodes["obs"]
        return {"obs": obs[episode_idx, obs_idx], "future_obs": obs[episode_idx, future_idx],
                "offset": durations}

    def sample_loop(self, batch_size: int, discount: float) -> dict[str, np.ndarray]:
        episode_idx, obs_idx, ranges = self._draw(batch_size)
        return self._geometric_pairs(episode_idx, obs_idx, self.durations_loop(episode_idx, obs_idx, ranges),
                                     discount)

    def sample_vectorized(self, batch_size: int, discount: float) -> dict[str, np.ndarray]:
        episode_idx, obs_idx, ranges = self._draw(batch_size)
        return self._geometric_pairs(
            episode_idx, obs_idx, self.durations_vectorized(episode_idx, obs_idx, ranges), discount
        )

    def sample_transitions_vectorized(self, batch_size: int) -> dict[str, np.ndarray]:
        """Its gather shape for (obs, action, reward, next_obs) with the vectorized bound (used for the
        transitions cases; the buffer has no n-step targets)."""
        episode_idx, obs_idx, ranges = self._draw(batch_size)
        self.durations_vectorized(episode_idx, obs_idx, ranges)
        e = self._episodes
        return {"obs": e["obs"][episode_idx, obs_idx], "action": e["action"][episode_idx, obs_idx],
                "reward": e["reward"][episode_idx, obs_idx], "next_obs": e["obs"][episode_idx, obs_idx + 1],
                "terminals": e["terminals"][episode_idx, obs_idx]}

    def sample_transitions_loop(self, batch_size: int) -> dict[str, np.ndarray]:
        episode_idx, obs_idx, ranges = self._draw(batch_size)
        self.durations_loop(episode_idx, obs_idx, ranges)
        e = self._episodes
        return {"obs": e["obs"][episode_idx, obs_idx], "action": e["action"][episode_idx, obs_idx],
                "reward": e["reward"][episode_idx, obs_idx], "next_obs": e["obs"][episode_idx, obs_idx + 1],
                "terminals": e["terminals"][episode_idx, obs_idx]}

    def bound_errors(self, batch_size: int, batches: int) -> tuple[int, int]:
        """(wrong, total): samples whose vectorized bound differs from the true bound of their episode.

        The true bound is what the per-sample loop computes from the slot's current terminals (the
        episode that actually lives there)."""
        wrong = total = 0
        for _ in range(batches):
            episode_idx, obs_idx, ranges = self._draw(batch_size)
            fast = self.durations_vectorized(episode_idx, obs_idx, ranges)
            true = self.durations_loop(episode_idx, obs_idx, ranges)
            wrong += int(np.count_nonzero(fast != true))
            total += batch_size
        return wrong, total
