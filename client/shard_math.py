"""The arithmetic of one client over several servers (shards), apart from any network: how a batch is split
between shards, how their sub-batches become one batch with global probabilities, importance weights and keys,
where an episode or a rollout buffer lives, and how a buffer's size and description are divided and merged.

Exactness of the split. A batch of B independent draws over the union of the shards' steps is drawn in two
stages: the item counts per shard (n_1..n_K) ~ Multinomial(B, m_k / sum m), then n_k draws from shard k by its
own sampler. With m_k a uniform shard's sampleable steps, each item is step i with probability
(m_k / M) (1 / m_k) = 1 / M; with m_k a prioritized shard's priority mass (its sum tree's root, sum p^alpha),
(m_k / M) (p_i^alpha / m_k) = p_i^alpha / M: one server's law over the union, exactly.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from replayd.wire.components import MinSize, RateLimiterOptions, SampleToInsertRatio

# A sharded client's key is the shard's position in bits 0..47 and the shard's index in bits 48..62, so keys stay
# non-negative int64 (the batch format of one server) and update_priorities can route each to its shard. A ring's
# positions count every row it ever held: 2**48 rows take 326 days at 10M rows/s.
SHARD_SHIFT = 48
POSITION_MASK = (1 << SHARD_SHIFT) - 1
MAX_SHARDS = 1 << (63 - SHARD_SHIFT)


def split_batch(batch_size: int, masses: Sequence[float], rng: np.random.Generator) -> np.ndarray:
    """Items per shard of a batch of `batch_size` draws over the union: a multinomial draw weighted by the shards'
    masses (sampleable steps, or priority mass), so that an item comes from shard k with probability
    masses[k] / sum(masses)."""
    weights = np.asarray(masses, dtype=np.float64)
    if weights.ndim != 1 or not weights.size or not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError(f"masses: expected a non-empty sequence of finite numbers >= 0, got {masses!r}")
    total = float(weights.sum())
    if total <= 0:
        raise ValueError(f"masses: expected a positive sum, got {masses!r}")
    return rng.multinomial(batch_size, weights / total)


def shard_seed(seed: int, shard_index: int) -> int:
    """The seed a request of `seed` sends to shard `shard_index`: different shards draw differently, and the same
    request to the same shards draws the same batch."""
    return int(np.random.SeedSequence([seed, shard_index]).generate_state(1, np.uint64)[0])


def keys_by_shard(keys: np.ndarray) -> dict[int, np.ndarray]:
    """Indices into `keys` (int64, >= 0) of each shard's keys, by shard index."""
    shards = keys >> SHARD_SHIFT
    return {int(shard): np.flatnonzero(shards == shard) for shard in np.unique(shards)}


def positions(keys: np.ndarray) -> np.ndarray:
    """Tagged keys as their shard's positions."""
    return keys & np.int64(POSITION_MASK)


def weight_factor(beta: float, shard_floor: float, global_floor: float) -> float:
    """What a shard's importance weights are multiplied by to be normalized over the union.

    A server normalizes its weights against its own smallest positive leaf f_k: w = (p / f_k)^-beta. Over the
    union, the largest weight belongs to the smallest leaf of all, f = min f_k: w = (p / f)^-beta
    = (p / f_k)^-beta (f_k / f)^-beta. In logs: leaves may span 1e-300..1e150."""
    return math.exp(-beta * (math.log(shard_floor) - math.log(global_floor)))


def _checked_keys(keys: np.ndarray) -> np.ndarray:
    if keys.size and int(keys.max()) > POSITION_MASK:
        raise ValueError(f"key: expected positions below 2**{SHARD_SHIFT} from a shard, got {int(keys.max())}")
    return keys


def globalize(batch: dict[str, np.ndarray], shard_index: int, share: float, factor: float) -> dict[str, np.ndarray]:
    """One shard's sub-batch as part of a batch over the union: keys tagged with the shard's index, `probability`
    (the server's p / m_k) times the shard's share m_k / M, `weight` times `factor` (weight_factor). Columns that do
    not change stay the arrays they are."""
    out = dict(batch)
    if "key" in batch:
        keys = _checked_keys(batch["key"])
        out["key"] = keys | np.int64(shard_index << SHARD_SHIFT) if shard_index else keys
    if "probability" in batch and share != 1.0:
        out["probability"] = batch["probability"] * share
    if "weight" in batch and factor != 1.0:
        out["weight"] = (batch["weight"].astype(np.float64) * factor).astype(np.float32)
    return out


def globalize_rows(batch: dict[str, np.ndarray], shard_index: np.ndarray, share: np.ndarray,
                   factor: np.ndarray) -> dict[str, np.ndarray]:
    """globalize with one shard index, share and factor per row: for a batch merged from several shards. Its
    columns are its own (merge_rows made them), so they change in place."""
    if "key" in batch:
        batch["key"] = _checked_keys(batch["key"]) | (shard_index << SHARD_SHIFT)
    if "probability" in batch:
        batch["probability"] *= share
    if "weight" in batch:
        batch["weight"] = (batch["weight"].astype(np.float64) * factor).astype(np.float32)
    return batch


Rows = tuple[Mapping[str, np.ndarray], int, int]  # a decoded batch and the range [lo, hi) of its rows taken


def merge_rows(pieces: Sequence[Rows], order: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One array per column holding each piece's rows in turn, or taken in `order` (indices into them in turn); a
    piece that is a whole batch, without an order, is returned as it is. Columns that are one array in the first
    batch (bootstrap_obs is next_obs in 1-step transitions) stay one array."""
    first, lo, hi = pieces[0]
    if len(pieces) == 1 and order is None and lo == 0 and hi == len(next(iter(first.values()))):
        return dict(first)
    merged: dict[int, np.ndarray] = {}
    out = {}
    for name, array in first.items():
        column = merged.get(id(array))
        if column is None:
            column = np.concatenate([batch[name][lo:hi] for batch, lo, hi in pieces])
            column = merged[id(array)] = column if order is None else column.take(order, axis=0)
        out[name] = column
    return out


def rendezvous(key: str, candidates: Sequence[str]) -> int:
    """The index of the candidate that ranks `key` highest (rendezvous hashing): a stable hash spreads keys evenly,
    and a candidate joining or leaving moves only the keys it wins or held."""
    if not candidates:
        raise ValueError(f"candidates: expected at least one for {key!r}, got none")
    scores = [hashlib.blake2b(f"{key}|{candidate}".encode(), digest_size=8).digest() for candidate in candidates]
    return max(range(len(candidates)), key=scores.__getitem__)


def split_capacity(capacity_steps: int, shards: int) -> list[int]:
    """Rows of each of `shards` rings holding `capacity_steps` rows between them (sizes differ by at most 1)."""
    if capacity_steps < shards:
        raise ValueError(f"capacity_steps: expected at least one row per shard ({shards}), got {capacity_steps}")
    return [capacity_steps // shards + (k < capacity_steps % shards) for k in range(shards)]


def split_rate_limiter(options: RateLimiterOptions, shards: int) -> RateLimiterOptions:
    """Each shard's share of a rate limiter: the sizes divided between the shards (rounded up, at least 1), the
    ratio as it is. A SampleToInsertRatio's error buffer keeps the least a shard's own ratio needs
    (2 * error_buffer >= samples_per_insert + 1)."""
    if isinstance(options, MinSize):
        return MinSize(-(-options.min_size_to_sample // shards))
    if isinstance(options, SampleToInsertRatio):
        least = (options.samples_per_insert + 1) / 2 if options.samples_per_insert > 0 else 0.0
        return SampleToInsertRatio(options.samples_per_insert, -(-options.min_size_to_sample // shards),
                                   max(options.error_buffer / shards, least))
    raise ValueError(f"rate_limiter: expected MinSize or SampleToInsertRatio, got {options!r}")


def _summed_rate_limiter(limiters: Sequence[RateLimiterOptions]) -> RateLimiterOptions:
    first = limiters[0]
    min_size = sum(limiter.min_size_to_sample for limiter in limiters)
    if isinstance(first, SampleToInsertRatio):
        return SampleToInsertRatio(first.samples_per_insert, min_size, sum(lim.error_buffer for lim in limiters))
    return MinSize(min_size)


# Counters that are no sums over the shards: each merges its own way.
_COUNTER_MERGES = {"prioritized.alpha": lambda values: values[0], "prioritized.max_priority": max,
                   "prioritized.min_positive": lambda values: min((v for v in values if v > 0), default=0.0)}
_SUMMED = ("bytes", "stored_steps", "sampleable_steps", "episodes", "capacity_steps", "capacity_bytes", "missing_steps")
_ALIKE = ("kind", "fields", "frames", "sampler", "remover", "num_steps", "num_envs", "gamma", "gae_lambda")


def _compression_ratios(counters: dict[str, float], infos: Sequence[dict[str, Any]]) -> None:
    """A compressed field's ratio over every shard's stored frames: their raw bytes (each shard's ratio times its
    stored bytes) over their stored bytes, not the sum of the shards' ratios."""
    for name in [name for name in counters if name.startswith("frames.") and name.endswith(".compression_ratio")]:
        stored = name.removesuffix("compression_ratio") + "stored_bytes"
        raw = sum(info["counters"].get(name, 0.0) * info["counters"].get(stored, 0.0) for info in infos)
        counters[name] = raw / counters[stored] if counters.get(stored) else 0.0


def merge_descriptions(described: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One description of a buffer from its shards' (address, description) pairs: sizes and counters summed
    (prioritized: alpha as it is, max_priority the largest, min_positive the smallest positive), the rate
    limiter's sizes summed, and `shards`, each shard's own description with its `address`. ValueError naming the
    setting when shards hold the buffer made otherwise."""
    if not described:
        raise ValueError("described: expected at least one shard's description, got none")
    infos = [info for _, info in described]
    first = infos[0]
    for key in _ALIKE:
        values = {address: info.get(key) for address, info in described}
        if any(value != first.get(key) for value in values.values()):
            raise ValueError(f"buffer {first['name']!r}: {key} differs between shards: {values}")
    merged = dict(first) | {key: sum(info[key] for info in infos) for key in _SUMMED}
    names = {name for info in infos for name in info["counters"]}
    merged["counters"] = {name: _COUNTER_MERGES.get(name, sum)([info["counters"].get(name, 0.0) for info in infos])
                          for name in sorted(names)}
    _compression_ratios(merged["counters"], infos)
    if first["kind"] == "episodic":
        merged["rate_limiter"] = _summed_rate_limiter([info["rate_limiter"] for info in infos])
    merged |= {"shm_name": "", "host": "", "sample_endpoints": [],
               "shards": [{"address": address, **info} for address, info in described]}
    return merged
