"""What the HTTP side reads from the buffers: one line of figures per buffer (the status table, /metrics and the
charts' samples) and one buffer's detail view (configuration, rate limiter, priorities, rollout state)."""

from __future__ import annotations

from typing import Any

import numpy as np

from replayd.server.buffers.episodic import EpisodicBuffer
from replayd.server.buffers.rollout import RolloutBuffer
from replayd.server.registry import Buffer, BufferRegistry
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.wire.errors import NotFound

PRIORITY_BINS = 20  # log-spaced bins of the detail view's priority histogram


def buffer_stat(name: str, buffer: Buffer) -> dict[str, Any] | None:
    """Sizes and counters of one buffer; None when it was deleted while they were read."""
    try:
        if isinstance(buffer, EpisodicBuffer):
            with buffer.live():
                capacity, stored, row_bytes = buffer.capacity, buffer.stored_steps, buffer.row_bytes
                counters, episodes = {**buffer.counters, **buffer.component_counters()}, buffer.episodes
                sampleable, rate_limiter = buffer.sampleable_steps, buffer.limiter.to_config()
                frames = buffer.frame_stats()
            policy_version = None
        else:
            info = buffer.info()
            capacity = info["num_steps"] * info["num_envs"]
            stored, counters, episodes = capacity - info["missing_steps"], info["counters"], 0
            sampleable, rate_limiter, row_bytes = None, None, buffer.cell_bytes
            policy_version, frames = info["policy_version"], {}
    except NotFound:
        return None
    return {
        "name": name,
        "kind": buffer.kind if isinstance(buffer, EpisodicBuffer) else "rollout",
        "capacity_steps": capacity,
        "stored_steps": stored,
        # the rows' columns, and the compressed fields' frames as stored
        "stored_bytes": stored * row_bytes + int(sum(figures["stored_bytes"] for figures in frames.values())),
        "fill": stored / capacity,
        "sampleable_steps": sampleable,
        "episodes": episodes,
        "rate_limiter": rate_limiter,
        "policy_version": policy_version,
        "inserted_steps": int(counters.get("inserted_rows", counters.get("pushed_steps", 0))),
        "sampled_items": int(counters.get("sampled_items", counters.get("served_samples", 0))),
        "counters": {k: float(v) for k, v in counters.items()},
        "frames": frames,  # per compressed field: stored_bytes, arena_bytes, compression_ratio
    }


def buffer_stats(registry: BufferRegistry) -> list[dict[str, Any]]:
    """`buffer_stat` of every buffer the registry holds (those deleted meanwhile left out)."""
    return [stat for name, buffer in registry.all() if (stat := buffer_stat(name, buffer)) is not None]


def buffer_detail(name: str, buffer: Buffer) -> dict[str, Any]:
    """One buffer's configuration and state: its rate limiter's (episodic buffers), a histogram of its
    priorities (prioritized buffers), its rollout's (rollout buffers). NotFound once it is deleted."""
    if isinstance(buffer, RolloutBuffer):
        return _rollout_detail(name, buffer)
    with buffer.live():
        config, counters = buffer.config(), buffer.component_counters()
        sampler = buffer.sampler
        leaves = sampler.tree.get(np.arange(buffer.capacity)) if isinstance(sampler, PrioritizedSampler) else None
    limiter = {side: {"waiting": counters.get(f"rate_limiter.{side}_waiting", 0.0),
                      "waits": counters.get(f"rate_limiter.{side}_waits", 0.0),
                      "wait_seconds": counters.get(f"rate_limiter.{side}_wait_seconds", 0.0)}
               for side in ("insert", "sample")}
    return {
        "name": name,
        "kind": buffer.kind,
        "config": config,  # its fields: one dict of all attributes each (Field.to_config)
        "rate_limiter": limiter,
        "priorities": None if leaves is None else priority_histogram(leaves, config["sampler"]["alpha"]),
        "rollout": None,
    }


def _rollout_detail(name: str, buffer: RolloutBuffer) -> dict[str, Any]:
    info = buffer.info()
    cells = info["num_steps"] * info["num_envs"]
    fields = [{"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)} for spec in buffer.config.columns]
    return {
        "name": name,
        "kind": "rollout",
        "config": {"capacity_steps": cells, "fields": fields, "num_steps": info["num_steps"],
                   "num_envs": info["num_envs"], "gamma": buffer.config.gamma, "gae_lambda": buffer.config.gae_lambda},
        "rate_limiter": None,
        "priorities": None,
        "rollout": {"policy_version": info["policy_version"], "filled_cells": cells - info["missing_steps"],
                    "cells": cells, "rollout_complete": info["rollout_complete"],
                    "stale_pushes": info["counters"]["stale_pushes"]},
    }


def priority_histogram(leaves: np.ndarray, alpha: float) -> dict[str, Any]:
    """Counts of the priorities of the steps a draw can reach, in log-spaced bins (TD-error priorities span
    orders of magnitude). `leaves` are the sum tree's: priority ** alpha, 0 for rows without a sampleable step
    and for priority 0. With alpha = 0 every positive leaf is 1 and the priorities are not kept: the histogram
    is of the leaves then (`of` says which)."""
    positive = leaves[leaves > 0]
    of, values = ("priority", positive ** (1.0 / alpha)) if alpha > 0 else ("priority ** alpha", positive)
    if values.size == 0:
        return {"of": of, "steps": 0, "edges": [], "counts": []}
    low, high = float(values.min()), float(values.max())
    counts, edges = np.histogram(values, bins=np.geomspace(low, high, PRIORITY_BINS + 1) if high > low else 1)
    return {"of": of, "steps": int(values.size), "edges": edges.tolist(), "counts": counts.tolist()}
