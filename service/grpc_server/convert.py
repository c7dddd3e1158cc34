"""Protobuf messages <-> server objects (schemas, components, modes, spans, buffer info).

Components go through their typed options (proto/components.py), the one round trip every
encoding shares; this module only moves them in and out of messages.
"""

from __future__ import annotations

import socket

import numpy as np

from replayd.server import components
from replayd.server.buffers.episodic import EpisodicBuffer
from replayd.server.buffers.planner import Spans
from replayd.server.buffers.rollout import RolloutBuffer, RolloutConfig, RolloutField
from replayd.server.limiters import RateLimiter
from replayd.server.modes.base import BatchMode
from replayd.server.removers import Remover
from replayd.server.samplers.base import Sampler
from replayd.server.schema import Field
from replayd.wire import components as options
from replayd.wire import replay_pb2 as pb

HOST = socket.gethostname()


def fields_from_proto(specs) -> tuple[Field, ...]:
    return tuple(Field(s.name, s.dtype, tuple(int(d) for d in s.shape), bool(s.observation),
                       stack=s.stack if s.HasField("stack") else 1,
                       stack_axis=s.stack_axis if s.HasField("stack_axis") else -1,
                       compression=s.compression or None,
                       compression_level=s.compression_level if s.HasField("compression_level") else None)
                 for s in specs)


def fields_to_proto(fields: tuple[Field, ...]) -> list[pb.FieldSpec]:
    return [pb.FieldSpec(name=f.name, dtype=f.dtype, shape=list(f.shape), observation=f.observation, stack=f.stack,
                         stack_axis=f.stack_axis, compression=f.compression or "",
                         compression_level=f.compression_level) for f in fields]


def rollout_config_from_proto(config: pb.RolloutConfig) -> RolloutConfig:
    fields = tuple(RolloutField(s.name, s.dtype, tuple(int(d) for d in s.shape)) for s in config.fields)
    return RolloutConfig(
        fields,
        int(config.num_steps),
        int(config.num_envs),
        gamma=config.gamma if config.HasField("gamma") else 0.99,
        gae_lambda=config.gae_lambda if config.HasField("gae_lambda") else 0.95,
    )


def mode_from_request(request: pb.SampleRequest) -> BatchMode:
    return components.build(options.from_proto("mode", request.mode))


def spans_from_request(request: pb.InsertRequest) -> Spans:
    return Spans(
        episode_ids=np.array(request.episode_ids, dtype=np.uint64),
        rows=np.array(request.span_rows, dtype=np.int64),
        begins=np.array(request.begins, dtype=bool),
        ends=np.array(request.ends, dtype=bool),
        terminated=np.array(request.terminated, dtype=bool),
        offsets=np.array(request.span_offsets, dtype=np.int64) if request.span_offsets else None,
    )


def buffer_info(name: str, buffer: EpisodicBuffer | RolloutBuffer) -> pb.BufferInfo:
    if isinstance(buffer, RolloutBuffer):
        return rollout_info(name, buffer)
    return episodic_info(buffer)


def rollout_info(name: str, buffer: RolloutBuffer) -> pb.BufferInfo:
    info = buffer.info()
    config = buffer.config
    return pb.BufferInfo(
        name=name,
        kind="rollout",
        rollout=pb.RolloutConfig(
            fields=[pb.FieldSpec(name=f.name, dtype=f.dtype, shape=list(f.shape)) for f in config.columns],
            num_steps=config.num_steps, num_envs=config.num_envs, gamma=config.gamma, gae_lambda=config.gae_lambda,
        ),
        bytes=info["bytes"],
        shm_name=info["shm_name"],
        host=HOST,
        stored_steps=config.num_steps * config.num_envs - info["missing_steps"],
        counters={k: float(v) for k, v in info["counters"].items()},
        policy_version=info["policy_version"],
        missing_steps=info["missing_steps"],
        rollout_complete=info["rollout_complete"],
    )


def goal_fields_from_proto(config: pb.EpisodicConfig) -> tuple[str, str] | None:
    """(achieved, desired) goal fields, or None when neither is named."""
    named = (config.achieved_goal_field, config.desired_goal_field)
    return None if named == ("", "") else named


def components_from_config(config: pb.EpisodicConfig) -> tuple[Sampler, Remover, RateLimiter]:
    """The components an EpisodicConfig names; unset ones are the defaults (uniform, fifo, min_size 1)."""
    return (components.build(options.from_proto("sampler", config.sampler, options.Uniform())),
            components.build(options.from_proto("remover", config.remover, options.Fifo())),
            components.build(options.from_proto("rate_limiter", config.rate_limiter, options.MinSize())))


def frame_counters(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """The compressed fields' figures as counters: frames.<field>.stored_bytes, .arena_bytes, .compression_ratio."""
    return {f"frames.{field}.{key}": value for field, figures in stats.items() for key, value in figures.items()}


def episodic_info(buffer: EpisodicBuffer) -> pb.BufferInfo:
    with buffer.live():  # components read shared memory too (max priority): not while a delete unmaps it
        info = buffer.info()
        counters = buffer.component_counters() | frame_counters(buffer.frame_stats())
    config = pb.EpisodicConfig(
        fields=fields_to_proto(buffer.fields),
        capacity_steps=buffer.capacity,
        capacity_bytes=buffer.config()["capacity_bytes"],
        reward_field=buffer.reward_field or "",
        achieved_goal_field=buffer.goal_fields[0] if buffer.goal_fields else "",
        desired_goal_field=buffer.goal_fields[1] if buffer.goal_fields else "",
        sampler=buffer.sampler.options.to_proto(),
        remover=buffer.remover.options.to_proto(),
        rate_limiter=buffer.limiter.options.to_proto(),
    )
    return pb.BufferInfo(
        name=info["name"],
        kind=info["kind"],
        episodic=config,
        bytes=info["bytes"],
        shm_name=info["shm_name"],
        host=HOST,
        stored_steps=info["stored_steps"],
        sampleable_steps=info["sampleable_steps"],
        episodes=info["episodes"],
        counters={k: float(v) for k, v in info["counters"].items()} | {"open_episodes": info["open_episodes"]}
        | counters,
    )
