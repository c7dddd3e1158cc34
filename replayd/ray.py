"""replayd on a Ray cluster (the `ray` extra): replay shards as Ray actors, the actor and learner programs as Ray
tasks. The API of replayd.client.ray, where it is implemented:

    from replayd.ray import BufferSpec, run_actors, start_shards
"""

from replayd.client.ray import ActorRun, BufferSpec, RayShards, find_shards, run_actors, start_shards, stop_shards

__all__ = ["ActorRun", "BufferSpec", "RayShards", "find_shards", "run_actors", "start_shards", "stop_shards"]
