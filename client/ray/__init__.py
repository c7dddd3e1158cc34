"""replayd on a Ray cluster: replay shards as Ray actors, and the actor and learner programs as Ray tasks.

    from replayd.client.ray import BufferSpec, run_actors, start_shards

    shards = start_shards(3, [BufferSpec("cartpole", 300_000, schema)], strategy="STRICT_SPREAD",
                          checkpoint_dir="/mnt/shared/replayd", checkpoint_every=60)
    rc = shards.client()                                  # a ShardedReplayClient that follows the shards
    run = run_actors(shards, "dqn", actors=4, learner_options={"seconds": 600})
    summary, reports = run.result()
    shards.stop()

Needs the `ray` extra (pip install 'replayd[ray]'); nothing else in replayd imports Ray, and this package imports it
only when one of the names below is used (so `replayd ray --help` works without it). client/ray/shards.py places
and restarts the shards, client/ray/resolver.py tells clients where they are, client/ray/jobs.py runs the programs,
client/ray/cli.py is `replayd ray up|down|status|run`.
"""

from __future__ import annotations

import importlib
from typing import Any

STRATEGIES = ("SPREAD", "STRICT_SPREAD")  # the placement group strategies that spread the shards over the nodes

_MODULES = {"ActorRun": "jobs", "run_actors": "jobs", "BufferSpec": "shards", "RayShards": "shards",
            "find_shards": "shards", "start_shards": "shards", "stop_shards": "shards"}

__all__ = sorted(_MODULES)


def require_ray() -> None:
    """ImportError naming the extra to install, where Ray is not installed."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise ImportError("replayd's Ray launcher needs Ray: pip install 'replayd[ray]'") from exc


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'replayd.client.ray' has no attribute {name!r}")
    require_ray()
    return getattr(importlib.import_module(f"replayd.client.ray.{module}"), name)
