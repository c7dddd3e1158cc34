"""Checks of trainer settings, shared by the trainers: each setting is used as given, so a wrong one would
train wrongly without an error. Written so that NaN fails every check."""

from __future__ import annotations

import math


def check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")


def check_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


def check_max_grad_norm(max_grad_norm: float | None) -> None:
    """None (no clipping) or finite and > 0: clip_grad_norm_ scales the gradients by max_grad_norm / norm, so a
    negative one turns them around (training climbs the loss) and 0 or NaN wipes them out."""
    if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be None or finite and > 0, got {max_grad_norm!r}")
