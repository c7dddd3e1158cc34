"""Framed observation fields: what a client declares, and the checks both ends share.

A field declared with `Frames(stack=k)` stores one frame per row (the frame is the field's `shape`), and every
batch mode returns it stacked: the frames of rows t-k+1 .. t of the same episode, the episode's first frame
repeated before its start (gymnasium's `FrameStackObservation` with padding by the first observation). The
stack is a new axis of the batch's column, last by default (`stack_axis=-1`: (84, 84) frames come out as
(84, 84, k)) or first (`stack_axis=0`, channel-first: (k, 84, 84)).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from service.errors import InvalidArgument

STACK_AXES = (-1, 0)  # the stack's axis in a sampled column's row: last or first
MAX_STACK = 64


def check_frames(what: str, stack: object, stack_axis: object, observation: bool) -> tuple[int, int]:
    """(stack, stack_axis), checked; InvalidArgument naming `what` (the field, or the options) otherwise."""
    if isinstance(stack, bool) or not isinstance(stack, numbers.Integral) or not 1 <= stack <= MAX_STACK:
        raise InvalidArgument(f"{what}: stack must be an integer in 1..{MAX_STACK}, got {stack!r}")
    if isinstance(stack_axis, bool) or stack_axis not in STACK_AXES:
        raise InvalidArgument(f"{what}: stack_axis must be -1 (last) or 0 (first), got {stack_axis!r}")
    if stack > 1 and not observation:
        raise InvalidArgument(f"{what}: stack={stack}, expected 1: only observation fields are stacked "
                              "(step fields have one value per step)")
    return int(stack), int(stack_axis)


def stacked_shape(shape: tuple[int, ...], stack: int, stack_axis: int) -> tuple[int, ...]:
    """The row shape of a sampled column of frames of `shape` stacked `stack` deep (a frame's shape when 1)."""
    if stack == 1:
        return tuple(shape)
    return (stack, *shape) if stack_axis == 0 else (*shape, stack)


@dataclass(frozen=True)
class Frames:
    """How an observation field's frames are stored and sampled, given as a schema entry's third element:
    `{"obs": ("uint8", (84, 84), Frames(stack=4, stack_axis=0))}`. Validated where constructed (InvalidArgument
    naming `frames.<option>`); the server checks it against the field (only observation fields are stacked)."""

    stack: int = 1
    stack_axis: int = -1

    def __post_init__(self) -> None:
        stack, stack_axis = check_frames("frames", self.stack, self.stack_axis, observation=True)
        object.__setattr__(self, "stack", stack)
        object.__setattr__(self, "stack_axis", stack_axis)
