"""Prioritized index sampler (Schaul et al. 2016): P(i) = p_i^alpha / sum_j p_j^alpha over sampleable steps.

Leaf `row` of a sum tree holds p^alpha of the step in that ring row, or 0 when the row holds no
sampleable step (final observations, holes, evicted or retired steps), so draws land only on
sampleable positions. The trees live in the buffer's shared memory. New steps get the largest
priority ever given (1.0 before any update), so each is likely to be seen once before its TD error
is known.

Draws are independent (with replacement, as in Reverb), so `probability` is exactly each item's
sampling probability. Importance weights w_i = (N P(i))^-beta / max_j w_j; the maximum belongs to
the smallest positive probability, so w_i = (p_i^alpha / min_j p_j^alpha)^-beta (N cancels).
"""

from __future__ import annotations

import math

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.ring import EpisodicRing
from replayd.server.samplers.base import Sampler
from replayd.server.samplers.draw import Draw
from replayd.server.samplers.sum_tree import SumTree
from replayd.server.storage.shared_arrays import ArraySpec
from replayd.wire.components import Prioritized
from replayd.wire.errors import FailedPrecondition, InvalidArgument

# Largest leaf (priority ** alpha) accepted: a sum over any ring stays far below float64's limit, where
# one inf leaf would make every probability nan for good (new steps get the max priority).
MAX_LEAF = 1e150
# Smallest leaf accepted for a positive priority: below float64's smallest normal number the power loses
# precision, then becomes 0, and a step given a positive priority would silently never be drawn.
MIN_LEAF = float(np.finfo(np.float64).tiny)

# Rounds a lock-free reader draws its torn draws again before it draws the whole batch again.
_TORN_ROUNDS = 4


class PrioritizedSampler(Sampler):
    extra_item_bytes = 8 + 4  # columns draw adds to a batch, per item: probability (float64), weight (float32)

    def __init__(self, alpha: float = Prioritized.alpha) -> None:
        self.options = Prioritized(alpha)
        self.alpha = self.options.alpha
        self.tree: SumTree | None = None
        self._max_priority: np.ndarray | None = None

    def array_specs(self, capacity: int) -> list[ArraySpec]:
        return [*SumTree.array_specs("prioritized", capacity), ArraySpec("prioritized.max_priority", "float64", (1,))]

    def bind(self, arrays: dict[str, np.ndarray]) -> None:
        """Takes the freshly created arrays named by array_specs and initializes them (no step stored)."""
        self.tree = SumTree(arrays["prioritized.sum"], arrays["prioritized.min"])
        self.tree.clear()
        self._max_priority = arrays["prioritized.max_priority"]
        self._max_priority[0] = 1.0

    def attach(self, arrays: dict[str, np.ndarray]) -> None:
        """Takes arrays that already hold a tree (a writer restarting on its segments)."""
        self.tree = SumTree(arrays["prioritized.sum"], arrays["prioritized.min"])
        self._max_priority = arrays["prioritized.max_priority"]

    def recover(self, ring: EpisodicRing, tail: int, head: int) -> None:
        """Keeps the priorities of live sampleable steps and zeroes every other leaf (an interrupted
        insert may have given rows past the head their first priority), then rebuilds the tree."""
        rows = np.arange(ring.capacity, dtype=np.int64)
        positions = tail + (rows - tail) % ring.capacity  # the position each row holds in [tail, tail + cap)
        _, bounds, _ = ring.episode_bounds(positions)
        live = (positions < head) & (positions < bounds)
        self.tree.update(rows, np.where(live, self.tree.get(rows), 0.0))

    def _leaf_values(self, priorities: np.ndarray) -> np.ndarray:
        # Priority 0 means "never sample", also for alpha = 0 where 0**0 would be 1.
        return np.where(priorities > 0, np.power(priorities, self.alpha), 0.0)

    # ---------------------------------------------------------------- buffer hooks (under ring.lock)
    def on_rows_written(self, ring: EpisodicRing, lo: int, hi: int, bounds: np.ndarray | int) -> None:
        """Positions [lo, hi) are about to get `bounds`: the steps among them are new items (none retired).
        A lock-free reader that draws one before its bound is stored finds it no step, and draws again."""
        positions = np.arange(lo, hi, dtype=np.int64)
        fresh = self._leaf_values(self._max_priority[:1])[0]
        self.tree.update(positions % ring.capacity, np.where(positions < bounds, fresh, 0.0))

    def on_rows_cleared(self, ring: EpisodicRing, lo: int, hi: int) -> None:
        self.tree.update(np.arange(lo, hi, dtype=np.int64) % ring.capacity, 0.0)

    def on_positions_cleared(self, ring: EpisodicRing, positions: np.ndarray) -> None:
        """Scattered positions stopped being items (a remover retired them)."""
        self.tree.update(positions % ring.capacity, 0.0)

    def state_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The leaves of steps about to move with their open episode (their priorities travel along)."""
        return self.tree.get(rows)

    def restore_rows(self, ring: EpisodicRing, rows: np.ndarray, state: np.ndarray | None) -> None:
        self.tree.update(rows, state)

    def drawable(self, ring: EpisodicRing) -> bool:
        """Whether a draw can succeed now: a sampleable step with a positive priority (0: never drawn)."""
        return ring.sampleable_steps > 0 and self.tree.total > 0

    # ---------------------------------------------------------------- sampling
    def weight_floor(self) -> float:
        """The smallest positive priority now: what the weights of a draw are normalized against."""
        return self.tree.min_positive

    def draw(self, ring: EpisodicRing, batch_size: int, rng: np.random.Generator,
             importance_beta: float = 0.0, weight_floor: float | None = None) -> Draw:
        """Positions by priority, with `probability` and the importance `weight`, normalized against
        `weight_floor` (None: weight_floor() now). A batch drawn in rounds (a remover retiring the steps drawn,
        whose leaves go to 0) passes its first round's, so that equal priorities get equal weights."""
        # The head first: it maps the leaves read after it to positions. A lock-free reader whose leaves are
        # newer than its head (an eviction and insert reused their rows meanwhile) gets positions below the
        # new tail, which its check of the batch refuses; leaves older than the head would pass with the
        # evicted step's priority.
        head = ring.head
        total = self.tree.total
        if total <= 0:
            raise FailedPrecondition(
                f"buffer {ring.name!r} has no sampleable step with a positive priority "
                f"(sampleable_steps={ring.sampleable_steps})"
            )
        # A lock-free reader races the writer: its search may find no positive leaf (-1), or a leaf the
        # writer zeroed since (a step that moved or was evicted). Such draws are drawn again, a few rounds,
        # and any left get a HOLE bound, which makes the reader's check of its batch (drawn_live) draw the
        # whole batch again. Under the writer's lock neither happens.
        leaves = self._search(rng.random(batch_size) * total)
        for redraws in range(_TORN_ROUNDS + 1):
            values = self.tree.get(leaves)
            torn = (leaves < 0) | ~(values > 0)
            if redraws == _TORN_ROUNDS or not torn.any():
                break
            leaves[torn] = self._search(rng.random(int(torn.sum())) * total)
        # Leaf = ring row; the live range lies within the last `capacity` positions before the head.
        base = head - ring.capacity
        positions = base + (leaves - base) % ring.capacity
        rows, bounds, closed, open_seq = ring.locate(positions)
        if torn.any():
            bounds[torn] = kernels.HOLE
            values = np.where(torn, 1.0, values)
        # w = (N P)^-beta / max w = (p / p_min)^-beta, in logs: leaves may span 1e-300..1e150, whose ratio
        # overflows float64 (and inf ** -beta would make the weight 0). p_min also counts the drawn leaves: a
        # lock-free reader may read a leaf below the tree's minimum as read (a priority changed meanwhile).
        floor = self.weight_floor() if weight_floor is None else weight_floor
        log_ratio = np.log(values) - math.log(min(floor, float(values.min())))
        weight = np.exp(-importance_beta * log_ratio).astype(np.float32)
        return Draw(positions, rows, bounds, closed, open_seq, {"probability": values / total, "weight": weight})

    def _search(self, targets: np.ndarray) -> np.ndarray:
        try:
            return self.tree.find_prefix(targets)
        except ValueError:  # the levels read all zero under a positive total: a lock-free reader mid-update
            return np.full(targets.size, -1, np.int64)

    def update_priorities(self, ring: EpisodicRing, keys: np.ndarray, priorities: np.ndarray) -> tuple[int, int]:
        """Sets the priorities of live keys; returns (applied, ignored_stale). Call with ring.lock held.

        A key is stale when its position is no longer a sampleable step of the ring (evicted, moved,
        overwritten, retired): its row may hold another step now, which must keep its own priority. A key at
        or past the head is stale too (an earlier buffer of the same name handed it out); a negative key is
        no position at all and is refused.
        """
        keys = np.asarray(keys, dtype=np.int64).ravel()
        priorities = np.asarray(priorities, dtype=np.float64).ravel()
        if keys.size != priorities.size:
            raise InvalidArgument(f"update_priorities: {keys.size} keys but {priorities.size} priorities")
        negative = keys < 0
        if negative.any():
            index = int(np.argmax(negative))
            raise InvalidArgument(f"update_priorities: keys[{index}] = {int(keys[index])}; keys are the positions "
                                  "samples return (include_keys), >= 0")
        bad = ~np.isfinite(priorities) | (priorities < 0)
        if bad.any():
            index = int(np.argmax(bad))
            raise InvalidArgument(
                f"update_priorities: priorities[{index}] = {float(priorities[index])!r}; "
                "priorities must be finite and >= 0"
            )
        with np.errstate(over="ignore", under="ignore"):  # checked below, on the leaves themselves
            leaves = self._leaf_values(priorities)
        huge = leaves > MAX_LEAF
        if huge.any():
            index = int(np.argmax(huge))
            raise InvalidArgument(
                f"update_priorities: priorities[{index}] = {float(priorities[index])!r} gives priority ** alpha (alpha "
                f"{self.alpha}) = {leaves[index]:.3g}, over {MAX_LEAF:.0e}"
            )
        tiny = (priorities > 0) & (leaves < MIN_LEAF)
        if tiny.any():
            index = int(np.argmax(tiny))
            raise InvalidArgument(
                f"update_priorities: priorities[{index}] = {float(priorities[index])!r} gives priority ** alpha (alpha "
                f"{self.alpha}) = {leaves[index]:.3g}, under {MIN_LEAF:.3g}: the step could never be drawn "
                "(a priority of 0 says that)"
            )
        rows, bounds, _ = ring.episode_bounds(keys)
        live = (keys >= ring.tail_position()) & (keys < ring.head) & (keys < bounds)
        applied = int(np.count_nonzero(live))
        if applied:
            self._max_priority[0] = max(float(self._max_priority[0]), float(priorities[live].max()))
            self.tree.update(rows[live], leaves[live])
        return applied, keys.size - applied

    def counters(self) -> dict[str, float]:
        """alpha, the largest priority given, and the tree's root: `total` (sum of p^alpha, the buffer's priority
        mass) and `min_positive` (the smallest positive p^alpha, 0 when no step has a positive priority). A
        client sampling several servers splits batches by their totals and normalizes importance weights
        against the smallest min_positive (client/shard_math.py)."""
        smallest = self.tree.min_positive
        return {"alpha": self.alpha, "max_priority": float(self._max_priority[0]), "total": self.tree.total,
                "min_positive": smallest if math.isfinite(smallest) else 0.0}
