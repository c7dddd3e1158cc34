"""Protobuf messages <-> server objects (schemas, modes, spans, buffer info)."""

from __future__ import annotations

import socket

import numpy as np

from service.buffers.episodic import EpisodicBuffer, Spans
from service.errors import InvalidArgument
from service.samplers.geometric import GeometricMode
from service.samplers.modes import BatchMode
from service.samplers.states import StatesMode
from service.samplers.transitions import TransitionsMode
from service.schema import Field
from service.wire import replay_pb2 as pb

HOST = socket.gethostname()


def fields_from_proto(specs) -> tuple[Field, ...]:
    return tuple(Field(s.name, s.dtype, tuple(int(d) for d in s.shape), bool(s.observation)) for s in specs)


def fields_to_proto(fields: tuple[Field, ...]) -> list[pb.FieldSpec]:
    return [pb.FieldSpec(name=f.name, dtype=f.dtype, shape=list(f.shape), observation=f.observation) for f in fields]


def mode_from_request(request: pb.SampleRequest) -> BatchMode:
    which = request.WhichOneof("mode")
    if which == "transitions":
        n_step = request.transitions.n_step or 1
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
    )


def buffer_info(buffer: EpisodicBuffer) -> pb.BufferInfo:
    info = buffer.info()
    config = pb.EpisodicConfig(
        fields=fields_to_proto(buffer.fields),
        capacity_steps=buffer.capacity,
        reward_field=buffer.reward_field or "",
        sampler=pb.SamplerConfig(uniform=pb.UniformSampler()),
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
        counters={k: float(v) for k, v in info["counters"].items()} | {"open_episodes": info["open_episodes"]},
    )
