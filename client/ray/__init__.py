"""replayd on a Ray cluster: replay shards as Ray actors, and the actor and learner programs as Ray tasks.

    from client.ray import BufferSpec, run_actors, start_shards

    shards = start_shards(3, [BufferSpec("cartpole", 300_000, schema)], strategy="STRICT_SPREAD",
                          checkpoint_dir="/mnt/shared/replayd", checkpoint_every=60)
    rc = shards.client()                                  # a ShardedReplayClient that follows the shards
    run = run_actors(shards, "dqn", actors=4, learner_options={"seconds": 600})
    summary, reports = run.result()
    shards.stop()

Needs the `ray` extra (pip install 'replayd[ray]'); nothing else in replayd imports Ray. client/ray/shards.py places
and restarts the shards, client/ray/resolver.py tells clients where they are, client/ray/jobs.py runs the programs,
client/ray/cli.py is `replayd ray up|down|status|run`.
"""

try:
    import ray  # noqa: F401
except ImportError as exc:
    raise ImportError("replayd's Ray launcher needs Ray: pip install 'replayd[ray]'") from exc

from client.ray.jobs import ActorRun, run_actors
from client.ray.shards import BufferSpec, RayShards, shards, start_shards, stop_shards

__all__ = ["ActorRun", "BufferSpec", "RayShards", "run_actors", "shards", "start_shards", "stop_shards"]
