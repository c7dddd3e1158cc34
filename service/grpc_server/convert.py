"""Protobuf messages <-> server objects (schemas, modes, spans, buffer info)."""

from __future__ import annotations

import socket

import numpy as np

from service.buffers.episodic import EpisodicBuffer, Spans
from service.buffers.rollout import RolloutBuffer, RolloutConfig, RolloutField
from service.errors import InvalidArgument
from service.limiters import RateLimiter
from service.removers import FifoRemover, MaxTimesSampledRemover
from service.samplers.geometric import GeometricMode
from service.samplers.modes import BatchMode
from service.samplers.prioritized import PrioritizedSampler
from service.samplers.states import StatesMode
from service.samplers.transitions import TransitionsMode
from service.samplers.uniform import UniformSampler
from service.schema import Field
from service.wire import replay_pb2 as pb

HOST = socket.gethostname()


def fields_from_proto(specs) -> tuple[Field, ...]:
    return tuple(Field(s.name, s.dtype, tuple(int(d) for d in s.shape), bool(s.observation)) for s in specs)


def fields_to_proto(fields: tuple[Field, ...]) -> list[pb.FieldSpec]:
    return [pb.FieldSpec(name=f.name, dtype=f.dtype, shape=list(f.shape), observation=f.observation) for f in fields]


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
    which = request.WhichOneof("mode")
    if which == "transitions":
        n_step = request.transitions.n_step if request.transitions.HasField("n_step") else 1
        gamma = request.transitions.gamma if request.transitions.HasField("gamma") else 0.99
        return TransitionsMode(n_step, gamma)
    if which == "geometric":
        return GeometricMode(request.geometric.discount)
    if which == "states":
        return StatesMode()
    raise InvalidArgument("sample: mode must be one of transitions, geometric, states")


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


# ---- sampler, remover, rate limiter (prioritized replay) ----
def components_from_config(
    config: pb.EpisodicConfig,
) -> tuple[UniformSampler | PrioritizedSampler, FifoRemover | MaxTimesSampledRemover, RateLimiter | None]:
    sampler = (PrioritizedSampler(config.sampler.prioritized.alpha)
               if config.sampler.WhichOneof("kind") == "prioritized" else UniformSampler())
    remover = (MaxTimesSampledRemover(config.remover.max_times_sampled.max_times_sampled)
               if config.remover.WhichOneof("kind") == "max_times_sampled" else FifoRemover())
    limiter = None
    if config.HasField("rate_limiter"):
        limits = config.rate_limiter
        limiter = RateLimiter(limits.min_size_to_sample, limits.samples_per_insert, limits.error_buffer)
    return sampler, remover, limiter


def components_to_proto(buffer: EpisodicBuffer) -> dict:
    sampler = buffer.sampler
    remover = buffer.remover
    fields: dict = {
        "sampler": pb.SamplerConfig(prioritized=pb.PrioritizedSampler(alpha=sampler.alpha))
        if isinstance(sampler, PrioritizedSampler) else pb.SamplerConfig(uniform=pb.UniformSampler()),
        "remover": pb.RemoverConfig(
            max_times_sampled=pb.MaxTimesSampledRemover(max_times_sampled=remover.max_times_sampled))
        if isinstance(remover, MaxTimesSampledRemover) else pb.RemoverConfig(fifo=pb.FifoRemover()),
    }
    if buffer.limiter is not None:
        fields["rate_limiter"] = pb.RateLimiterConfig(**buffer.limiter.config())
    return fields


def components_counters(buffer: EpisodicBuffer) -> dict[str, float]:
    counters = {f"remover.{k}": float(v) for k, v in buffer.remover.counters.items()}
    if isinstance(buffer.sampler, PrioritizedSampler):
        counters |= {f"prioritized.{k}": v for k, v in buffer.sampler.config().items()}
    if buffer.limiter is not None:
        counters |= {k: float(v) for k, v in buffer.limiter.counters().items()}
    return counters
# ---- end prioritized replay ----


def episodic_info(buffer: EpisodicBuffer) -> pb.BufferInfo:
    with buffer.live():  # components read shared memory too (max priority): not while a delete unmaps it
        info = buffer.info()
        components = components_to_proto(buffer)
        counters = components_counters(buffer)
    config = pb.EpisodicConfig(
        fields=fields_to_proto(buffer.fields),
        capacity_steps=buffer.capacity,
        reward_field=buffer.reward_field or "",
        **components,
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
