"""What an index sampler hands to a batch mode."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Draw:
    positions: np.ndarray  # int64 absolute positions; they double as stable item keys
    rows: np.ndarray  # ring rows of the positions
    bounds: np.ndarray  # absolute position of each episode's final row (last landed row if open)
    closed: np.ndarray  # bool: the episode has ended (its bound is its final observation)
    # The extent sequence number read for a row of an open episode (-1 for others): a lock-free reader
    # takes the episode's id from it, as the episode may move (and its rows' sequence numbers go) later.
    open_seq: np.ndarray
    extra: dict[str, np.ndarray] | None = None  # sampler-specific columns, e.g. probability, weight

    def select(self, kept: np.ndarray) -> Draw:
        """The draws a mask keeps."""
        extra = None if self.extra is None else {name: column[kept] for name, column in self.extra.items()}
        return Draw(self.positions[kept], self.rows[kept], self.bounds[kept], self.closed[kept], self.open_seq[kept],
                    extra)

    def head(self, count: int) -> Draw:
        """The first `count` draws."""
        if self.positions.size == count:
            return self
        return self.select(slice(0, count))

    @staticmethod
    def concatenate(parts: list[Draw]) -> Draw:
        """The draws of several rounds as one batch, in order."""
        if len(parts) == 1:
            return parts[0]
        extra = None if parts[0].extra is None else {
            name: np.concatenate([part.extra[name] for part in parts]) for name in parts[0].extra}
        return Draw(*(np.concatenate([getattr(part, name) for part in parts])
                      for name in ("positions", "rows", "bounds", "closed", "open_seq")), extra)
