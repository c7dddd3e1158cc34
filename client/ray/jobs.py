"""The actor and learner programs as Ray tasks against Ray shards: `run_actors(shards, "dqn", actors=4)`.

Each task runs the function `replayd actor` / `replayd learn` runs (client/algos.py), with the address `ray:NAME`, so
its ShardedReplayClient follows the shards wherever Ray restarts them. Ray places the tasks by the CPUs they ask
for (and any other Ray options given), and retries a task whose node dies (Ray's `max_retries`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, fields
from typing import Any

import ray

from replayd.client.ray.resolver import connect_ray
from replayd.client.ray.shards import RayShards
from replayd.client.sharded import RAY_PREFIX


@dataclass
class ActorRun:
    """The tasks `run_actors` started: the learner's (its summary) and each actor's (its ActorReport)."""

    learner: ray.ObjectRef | None
    actors: list[ray.ObjectRef]

    def result(self, timeout: float | None = None) -> tuple[dict | None, list[Any]]:
        """Waits for the learner, then the actors (which stop once the learner published its final weights)."""
        summary = None if self.learner is None else ray.get(self.learner, timeout=timeout)
        return summary, ray.get(self.actors, timeout=timeout)

    def cancel(self) -> None:
        """Ends the tasks of the run that are still going (a KeyboardInterrupt in each: an actor's recorder is not
        flushed, a learner writes no run folder)."""
        refs = [*self.actors, *([self.learner] if self.learner is not None else [])]
        _, going = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in going:
            ray.cancel(ref)


def _config(config_type: type, role: str, options: dict[str, Any]) -> Any:
    """`config_type(**options)`, refusing option names it does not have (building would drop them)."""
    names = {f.name for f in fields(config_type)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"{role} options {unknown} are not options of {config_type.__name__} "
                         f"(it has {sorted(names)})")
    return config_type(**options)


def _run_actor(algo: str, config: Any) -> Any:
    from replayd.client.algos import ALGOS

    return ALGOS[algo].actor(config)


def _run_learner(algo: str, config: Any) -> dict:
    import torch

    from replayd.client.algos import ALGOS

    torch.set_num_threads(1)
    return ALGOS[algo].learn(config)


def run_actors(shards: RayShards | str, algo: str = "dqn", actors: int = 2, *, learner: bool = True,
               actor_options: dict[str, Any] | None = None, learner_options: dict[str, Any] | None = None,
               cpus_per_actor: float = 1.0, cpus_per_learner: float = 1.0,
               actor_ray_options: dict[str, Any] | None = None,
               learner_ray_options: dict[str, Any] | None = None) -> ActorRun:
    """Starts `actors` actor programs of `algo` and (with `learner`) its learner as Ray tasks against `shards` (a
    RayShards, or the name of a running group), and returns at once.

    `actor_options` / `learner_options`: fields of the algorithm's actor and learner configs (client/actors,
    client/learners: e.g. {"seconds": 300, "run_dir": "/mnt/runs/dqn"}; the run folder is written on the learner's
    node). Actors get distinct seeds (from `actor_options["seed"]` when given) and, for ppo, their slot blocks.
    `*_ray_options`: Ray task options (resources, scheduling_strategy, max_retries, runtime_env, ...)."""
    from replayd.client.algos import ALGOS  # the learner extra (torch, gymnasium): needed here to check the options

    if algo not in ALGOS:
        raise ValueError(f"algo: expected one of {sorted(ALGOS)}, got {algo!r}")
    if actors < 0 or (algo == "ppo" and learner and actors < 1):
        raise ValueError(f"actors: expected a count >= {1 if algo == 'ppo' else 0}, got {actors}")
    spec = ALGOS[algo]
    group = shards if isinstance(shards, RayShards) else None
    address = group.address if group is not None else RAY_PREFIX + shards
    actor_options, learner_options = dict(actor_options or {}), dict(learner_options or {})
    token = group.token if group is not None else None
    env = {"env_vars": {"REPLAYD_TOKEN": token}} if token else None
    base_seed = actor_options.pop("seed", None)
    base_seed = secrets.randbits(30) if base_seed is None else base_seed
    actor_configs = []
    seeded = "seed" in {f.name for f in fields(spec.actor_config)}
    for index in range(actors):
        options = {"address": address, **({"seed": base_seed + 1000 * index} if seeded else {}), **actor_options}
        if algo == "ppo":
            options["actor_index"] = index
        actor_configs.append(_config(spec.actor_config, "actor", options))
    learner_config = None
    if learner:
        options = {"address": address, **learner_options}
        if algo == "ppo":
            options.setdefault("actors", actors)
        learner_config = _config(spec.learner_config, "learner", options)

    connect_ray()

    def task(function: Any, cpus: float, ray_options: dict[str, Any] | None) -> Any:
        options = {"num_cpus": cpus, **({"runtime_env": env} if env else {}), **(ray_options or {})}
        return ray.remote(function).options(**options)

    learner_ref = None
    if learner_config is not None:
        learner_ref = task(_run_learner, cpus_per_learner, learner_ray_options).remote(algo, learner_config)
    actor_task = task(_run_actor, cpus_per_actor, actor_ray_options)
    return ActorRun(learner_ref, [actor_task.remote(algo, config) for config in actor_configs])
