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
