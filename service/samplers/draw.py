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
    extra: dict[str, np.ndarray] | None = None  # sampler-specific columns, e.g. probability, weight
