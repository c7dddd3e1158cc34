"""Compiled loops of the sampling hot path (numba): bound lookup, rejection draw, n-step and geometric targets.

A batch of 256 needs a few dozen elementwise steps per sample; as numpy calls that is about twenty
calls of ~1 µs of overhead each, as one compiled loop per stage it is a few µs. The column gathers
stay numpy `take` calls: they are single calls already, and work for any dtype and row shape.

Kernels release the GIL (the servicer's threads overlap them). Importing this module compiles them
for the array types a writer and a read-only reader pass (or loads them from numba's on-disk cache),
so no sample waits on the compiler; `NUMBA_CACHE_DIR` moves the cache where the package directory is
read-only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit

OPEN = -1  # row_end of a row whose episode is still open
HOLE = -2  # row_end of a row that holds no episode
TERMINATED = 4  # extent flag

REWARD_DTYPES = ("float32", "float64")  # the reward columns transition_targets is compiled for ahead


def _jit(function: Callable) -> Callable:
    return njit(cache=True, nogil=True)(function)


@njit(inline="always")
def _wrap(row: int, capacity: int) -> int:
    """A row index wrapped onto the ring; divides only when it is off the ring. (A lock-free reader's
    offsets come from tables the writer may be changing, and a prioritized reader may draw a position
    that just stopped being a step, so sums can land anywhere: never index with an unchecked one.)"""
    return row % capacity if row >= capacity or row < 0 else row


@_jit
def _bounds_of_rows(rows: np.ndarray, row_end: np.ndarray, row_seq: np.ndarray, extent_last: np.ndarray,
                    extent_slots: int, times_sampled: np.ndarray, max_times_sampled: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bounds, closed, open_seq) of ring rows; open_seq is the extent sequence number read for a row of an
    open episode (-1 for others). Array in, arrays out: a per-element helper taking the tables would pay
    numba's reference counting of every array argument on each call (5x slower)."""
    count = rows.size
    bounds = np.empty(count, np.int64)
    closed = np.ones(count, np.bool_)
    open_seq = np.full(count, -1, np.int64)
    retires = times_sampled.size > 0
    for i in range(count):  # the random reads alone: a tight loop keeps many cache misses in flight
        bounds[i] = row_end[rows[i]]
    for i in range(count):
        row = rows[i]
        bound = bounds[i]
        if bound == OPEN:  # the open episode's bound is its last landed row, kept in the extent table
            seq = row_seq[row]
            # A lock-free reader may find the row turned into a hole since (its episode moved): no item.
            bound = extent_last[seq % extent_slots] if seq >= 0 else HOLE
            closed[i] = False
            open_seq[i] = seq
        if retires and times_sampled[row] >= max_times_sampled:
            bound = HOLE  # a retired step is no longer an item
        bounds[i] = bound
    return bounds, closed, open_seq


@_jit
def episode_bounds(positions: np.ndarray, capacity: int, row_end: np.ndarray, row_seq: np.ndarray,
                   extent_last: np.ndarray, extent_slots: int, times_sampled: np.ndarray,
                   max_times_sampled: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows, bounds, closed, open_seq) of absolute positions; see EpisodicRing.locate."""
    rows = np.empty(positions.size, np.int64)
    for i in range(positions.size):
        rows[i] = positions[i] % capacity
    bounds, closed, open_seq = _bounds_of_rows(rows, row_end, row_seq, extent_last, extent_slots, times_sampled,
                                               max_times_sampled)
    return rows, bounds, closed, open_seq


@_jit
def draw_uniform(uniforms: np.ndarray, low: int, high: int, located: np.ndarray, closed: np.ndarray, filled: int,
                 capacity: int, row_end: np.ndarray, row_seq: np.ndarray, extent_last: np.ndarray, extent_slots: int,
                 times_sampled: np.ndarray, max_times_sampled: int) -> int:
    """Rejection sampling over [low, high): one candidate per uniform, kept when it is a step.

    Writes the accepted candidates, in draw order, into columns `filled`.. of `located` (4, B)
    (positions, rows, bounds, open_seq) and `closed` (B,) until they are full or the uniforms ran out (the caller
    draws more); returns the columns now filled. (Outputs come from the caller: each array numba hands
    back costs about 0.5 µs.)
    """
    span = high - low
    low_row = low % capacity
    count = uniforms.size
    rows = np.empty(count, np.int64)
    for i in range(count):
        rows[i] = _wrap(low_row + np.int64(uniforms[i] * span), capacity)
    bounds, candidate_closed, open_seq = _bounds_of_rows(rows, row_end, row_seq, extent_last, extent_slots,
                                                         times_sampled, max_times_sampled)
    for i in range(count):
        if filled == closed.size:
            break
        position = low + np.int64(uniforms[i] * span)
        if position < bounds[i]:  # a step: it has a successor in its episode
            located[0, filled], located[1, filled], located[2, filled] = position, rows[i], bounds[i]
            located[3, filled] = open_seq[i]
            closed[filled] = candidate_closed[i]
            filled += 1
    return filled


@_jit
def transition_targets(positions: np.ndarray, rows: np.ndarray, bounds: np.ndarray, closed: np.ndarray, n_step: int,
                       powers: np.ndarray, capacity: int, reward: np.ndarray, row_seq: np.ndarray,
                       extent_flags: np.ndarray, extent_slots: int, target_rows: np.ndarray, flags: np.ndarray,
                       targets: np.ndarray) -> None:
    """Fills next_and_bootstrap `target_rows` (2, B) int64, terminated_and_truncated `flags` (2, B) bool and
    return_and_discount `targets` (2, B) float32: the rows of t + 1 and t + n_eff, the 1-step flags,
    n_step_return and bootstrap_discount (see TransitionsMode). (Outputs come from the caller: each array
    numba hands back costs about 0.5 µs.)

    `powers` = gamma^0 .. gamma^n_step; `reward` is the reward column (empty: no reward field, and then
    `targets` is not written).
    """
    count = positions.size
    next_rows, bootstrap_rows = target_rows[0], target_rows[1]
    terminated, truncated = flags[0], flags[1]
    n_step_return, bootstrap_discount = targets[0], targets[1]
    has_reward = reward.size > 0
    first_reward = np.empty(count if has_reward else 0)  # r_t, float64 like the sums below
    for i in range(first_reward.size):  # the random reads alone: a tight loop keeps many cache misses in flight
        first_reward[i] = reward[rows[i]]
    for i in range(count):
        position, row = positions[i], rows[i]
        # A position at or past its bound is no step (a torn or hole bound a reader will redraw); 0 keeps
        # the reads below on the ring and in `powers`.
        n_eff = max(min(n_step, bounds[i] - position), 0)
        next_rows[i] = _wrap(row + 1, capacity)
        bootstrap_rows[i] = _wrap(row + n_eff, capacity)
        # Only a window that reaches a closed episode's final row can see its termination.
        episode_terminated = False
        if closed[i] and bounds[i] == position + n_eff:
            episode_terminated = (extent_flags[row_seq[row] % extent_slots] & TERMINATED) != 0
        last_step = closed[i] and bounds[i] == position + 1  # the 1-step transition ends the episode
        terminated[i] = last_step and episode_terminated
        truncated[i] = last_step and not episode_terminated
        if has_reward:
            total = first_reward[i] if n_eff > 0 else 0.0  # powers[0] = 1
            for k in range(1, n_eff):
                total += powers[k] * reward[_wrap(row + k, capacity)]
            n_step_return[i] = total
            bootstrap_discount[i] = 0.0 if episode_terminated else powers[n_eff]


@_jit
def bounds_kept(rows: np.ndarray, bounds: np.ndarray, closed: np.ndarray, row_end: np.ndarray) -> bool:
    """Whether a lock-free reader's drawn rows kept the bounds the draw read, as far as its batch could
    have seen. Call after every other read of the batch (row_end is read again here), and read the tail
    only after this returns (a later check of the positions against it catches rows evicted and reused):
    - a closed episode's rows keep their bound until evicted;
    - an open episode's rows stay OPEN, or turn into holes when it moves to the head (its old rows and
      extent record stay as they were until evicted, and the batch took its id from the draw), or its
      bounds become its final row when it closes: at the last row the draw read, the draw may have read
      that row without knowing the episode ended (the writer sets the bounds before the last row), past
      it the episode closed after the draw and the batch is what the open episode held."""
    for i in range(rows.size):
        now = row_end[rows[i]]
        if now != bounds[i] if closed[i] else (now != OPEN and now != HOLE and now <= bounds[i]):
            return False
    return True


@_jit
def drawn_live(positions: np.ndarray, bounds: np.ndarray, tail: int) -> bool:
    """Whether every drawn position was a step and is still live (>= the tail, read after the batch)."""
    for i in range(positions.size):  # noqa: SIM110 (numba compiles loops, not generator expressions)
        if positions[i] < tail or positions[i] >= bounds[i]:
            return False
    return True


@_jit
def geometric_offsets(exponentials: np.ndarray, discount: float, positions: np.ndarray, rows: np.ndarray,
                      bounds: np.ndarray, capacity: int, offsets_and_future_rows: np.ndarray) -> None:
    """Fills offsets_and_future_rows (2, B) int64: d in 1..M with P(d) proportional to discount^(d-1),
    M = bound - position, and the row of t + d.

    From E ~ Exp(1) (`exponentials`), K = floor(E / -ln g) is geometric on 0, 1, ... with P(K = k) =
    (1 - g) g^k, and K mod M follows that law truncated to 0..M-1, because P(K mod M = j) =
    sum_m (1 - g) g^(j + mM) is proportional to g^j. So d = 1 + (K mod M): one division per sample and
    no logarithm (numpy's ziggurat draws E faster than a uniform's log). g = 1 is uniform on 1..M, with
    1 - exp(-E) ~ U[0, 1).
    """
    count = positions.size
    offsets, future_rows = offsets_and_future_rows[0], offsets_and_future_rows[1]
    scale = -1.0 / np.log(discount) if 0.0 < discount < 1.0 else 0.0  # 1 / lambda
    for i in range(count):
        horizon = bounds[i] - positions[i]
        if horizon <= 1 or discount == 0.0:
            offset = min(horizon, 1)  # below 1 only for a torn read, which the reader discards
        elif discount == 1.0:
            offset = min(np.int64(-np.expm1(-exponentials[i]) * horizon), horizon - 1) + 1
        else:
            k = exponentials[i] * scale
            if k >= horizon:  # float fmod is exact; it also keeps k far below int64's range
                k = np.fmod(k, horizon)
            offset = np.int64(k) + 1
        offsets[i] = offset
        future_rows[i] = _wrap(rows[i] + offset, capacity)


def _compile_ahead() -> None:
    """Runs every kernel once on tiny arrays, writable and read-only (a reader's shared memory)."""
    def tables(readonly: bool) -> tuple:
        row_end, row_seq, extent_last = (np.zeros(4, np.int64) for _ in range(3))
        for array in (row_end, row_seq, extent_last):
            array.flags.writeable = not readonly
        counts = np.zeros(4, np.int64)  # a remover's own counts, or an empty array: writable in readers too
        return 4, row_end, row_seq, extent_last, 3, counts, 1

    positions = np.zeros(2, np.int64)
    read_only_positions = positions.copy()
    read_only_positions.flags.writeable = False
    closed = np.ones(2, np.bool_)
    for readonly in (False, True):
        capacity, row_end, row_seq, extent_last, slots, counts, max_times = tables(readonly)
        for keys in (positions, read_only_positions):
            episode_bounds(keys, capacity, row_end, row_seq, extent_last, slots, counts, max_times)
        draw_uniform(np.zeros(2), 0, 2, np.empty((4, 2), np.int64), np.empty(2, np.bool_), 0, capacity, row_end,
                     row_seq, extent_last, slots, counts, max_times)
        extent_flags = np.zeros(4, np.uint8)  # the ring's extent.flags column
        extent_flags.flags.writeable = not readonly
        for dtype in REWARD_DTYPES:
            reward = np.zeros(4, dtype)
            reward.flags.writeable = not readonly
            transition_targets(positions, positions, positions + 1, closed, 1, np.ones(2), capacity, reward,
                               row_seq, extent_flags, slots, np.empty((2, 2), np.int64), np.empty((2, 2), np.bool_),
                               np.empty((2, 2), np.float32))
        geometric_offsets(np.zeros(2), 0.5, positions, positions, positions + 1, capacity, np.empty((2, 2), np.int64))
    for readonly in (False, True):
        row_end = np.zeros(4, np.int64)
        row_end.flags.writeable = not readonly
        bounds_kept(positions, positions + 1, closed, row_end)
    drawn_live(positions, positions + 1, 0)


_compile_ahead()
