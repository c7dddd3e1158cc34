"""A buffer's components as typed options: what a client asks for, and what a server builds and stores.

Every option class names its role (`sampler`, `remover`, `rate_limiter`, `mode`) and its kind. The kind is
the name of its field in the role's `oneof kind` in proto/replay.proto and the "kind" of its configuration
dict (the shared-memory header, checkpoints), so one registry of kinds serves every encoding:

    options.to_config()  <->  from_config(role, config)      (JSON-able dicts)
    options.to_proto()   <->  from_proto(role, message)       (SamplerConfig, RemoverConfig, ...)

Options are validated where they are constructed: a bad value raises InvalidArgument (a ValueError) naming
`<kind>.<field>`, what was expected and what was got, on the client before anything is sent and on the
server for a request that skipped the client. Options hold no state; the server builds its component
objects from them (service/components.py).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

from replayd.wire import replay_pb2 as pb
from replayd.wire.errors import InvalidArgument

__all__ = [
    "BOUNDARIES",
    "MAX_N_STEP",
    "STRATEGIES",
    "Fifo",
    "Geometric",
    "Hindsight",
    "MaxTimesSampled",
    "MinSize",
    "ModeOptions",
    "Options",
    "Prioritized",
    "RateLimiterOptions",
    "RemoverOptions",
    "SampleToInsertRatio",
    "SamplerOptions",
    "Sequences",
    "States",
    "Transitions",
    "Uniform",
    "from_config",
    "from_proto",
    "kinds",
    "sampling_changes_state",
]

MAX_N_STEP = 1000
BOUNDARIES = ("pad", "fit")  # how a sequence meets its episode's end
STRATEGIES = ("final", "future", "episode", "geometric")  # where a hindsight goal comes from

# role -> the proto message holding one component of that role in its `oneof kind`
_CONTAINERS: dict[str, type] = {
    "sampler": pb.SamplerConfig,
    "remover": pb.RemoverConfig,
    "rate_limiter": pb.RateLimiterConfig,
    "mode": pb.BatchMode,
}
_REGISTRY: dict[str, dict[str, type[Options]]] = {role: {} for role in _CONTAINERS}


@dataclass(frozen=True)
class Options:
    """Base of every option class: `role` and `kind` are class attributes, the dataclass fields are its
    parameters."""

    role: ClassVar[str]
    kind: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:  # a concrete kind: registered under its role
            kinds = _REGISTRY[cls.role]
            if cls.kind in kinds:
                raise TypeError(f"{cls.role} kind {cls.kind!r} is registered twice ({kinds[cls.kind].__name__}, "
                                f"{cls.__name__})")
            if cls.kind not in _CONTAINERS[cls.role].DESCRIPTOR.fields_by_name:
                raise TypeError(f"{cls.__name__}: {_CONTAINERS[cls.role].__name__} has no field {cls.kind!r}")
            kinds[cls.kind] = cls

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_config(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.params()}

    def to_proto(self) -> Any:
        """The role's container message (SamplerConfig, ..., BatchMode) with this kind set."""
        container = _CONTAINERS[self.role]()
        message = getattr(container, self.kind)
        message.SetInParent()  # a kind without parameters is set too
        for name, value in self.params().items():
            if value is not None:
                setattr(message, name, value)
        return container

    def _field(self, name: str) -> str:
        return f"{self.kind}.{name}"

    def _integer(self, name: str, least: int, most: int | None = None) -> None:
        value = getattr(self, name)
        if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least
                or (most is not None and value > most)):
            span = f"in {least}..{most}" if most is not None else f">= {least}"
            raise InvalidArgument(f"{self._field(name)} must be an integer {span}, got {value!r}")
        object.__setattr__(self, name, int(value))

    def _choice(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            raise InvalidArgument(f"{self._field(name)} must be one of {', '.join(map(repr, choices))}, got {value!r}")

    def _real(self, name: str, least: float = -math.inf, most: float = math.inf, *, above: bool = False,
              expected: str | None = None) -> None:
        value = getattr(self, name)
        ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
              and (value > least if above else value >= least) and value <= most)
        if not ok:
            raise InvalidArgument(f"{self._field(name)} must be {expected}, got {value!r}")
        object.__setattr__(self, name, float(value))


def kinds(role: str) -> dict[str, type[Options]]:
    """The registered option classes of a role, by kind."""
    return dict(_REGISTRY[role])


def from_config(role: str, config: dict[str, Any]) -> Options:
    """The options a configuration dict (to_config) describes."""
    params = dict(config)
    kind = params.pop("kind", None)
    cls = _REGISTRY[role].get(kind)
    if cls is None:
        raise InvalidArgument(f"{role}: unknown kind {kind!r}, expected one of {sorted(_REGISTRY[role])}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise InvalidArgument(f"{role} {kind!r}: {exc}") from None


def from_proto(role: str, container: Any, default: Options | None = None) -> Options:
    """The options a container message holds; `default` when its kind is not set (None: refused)."""
    kind = container.WhichOneof("kind")
    if kind is None:
        if default is None:
            raise InvalidArgument(f"{role} must be one of {sorted(_REGISTRY[role])}, got none")
        return default
    message = getattr(container, kind)
    params = {}
    for field in message.DESCRIPTOR.fields:
        if field.has_presence and not message.HasField(field.name):
            continue  # an optional field not sent: the option's default
        params[field.name] = getattr(message, field.name)
    return _REGISTRY[role][kind](**params)


# ---------------------------------------------------------------------------------------------- samplers
@dataclass(frozen=True)
class SamplerOptions(Options):
    role = "sampler"


@dataclass(frozen=True)
class Uniform(SamplerOptions):
    """Every sampleable step equally likely."""

    kind = "uniform"


@dataclass(frozen=True)
class Prioritized(SamplerOptions):
    """P(i) = p_i^alpha / sum_j p_j^alpha (Schaul et al. 2016); new steps get the largest priority given."""

    kind = "prioritized"
    alpha: float = 0.6

    def __post_init__(self) -> None:
        self._real("alpha", 0.0, expected="finite and >= 0")


# ---------------------------------------------------------------------------------------------- removers
@dataclass(frozen=True)
class RemoverOptions(Options):
    role = "remover"
    retires: ClassVar[bool]  # whether sampling retires steps (counts draws): such buffers change when sampled


@dataclass(frozen=True)
class Fifo(RemoverOptions):
    """The ring evicts its oldest whole episodes when it needs room; nothing else is removed."""

    kind = "fifo"
    retires = False


@dataclass(frozen=True)
class MaxTimesSampled(RemoverOptions):
    """A step sampled `max_times_sampled` times is retired (never drawn again), as Reverb's remover."""

    kind = "max_times_sampled"
    retires = True
    max_times_sampled: int

    def __post_init__(self) -> None:
        self._integer("max_times_sampled", 1)


# ---------------------------------------------------------------------------------------------- rate limiters
@dataclass(frozen=True)
class RateLimiterOptions(Options):
    role = "rate_limiter"
    samples_change_state: ClassVar[bool]  # whether a sample moves the limiter's balance

    def _min_size(self) -> None:
        value = self.min_size_to_sample
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise InvalidArgument(f"rate_limiter.min_size_to_sample must be an integer >= 1 (an empty buffer has "
                                  f"nothing to sample), got {value!r}")
        object.__setattr__(self, "min_size_to_sample", int(value))


@dataclass(frozen=True)
class MinSize(RateLimiterOptions):
    """Samples wait until the buffer holds `min_size_to_sample` sampleable steps; inserts never wait.
    MinSize(1), the default, holds back only samples of an empty buffer."""

    kind = "min_size"
    samples_change_state = False
    min_size_to_sample: int = 1

    def __post_init__(self) -> None:
        self._min_size()


@dataclass(frozen=True)
class SampleToInsertRatio(RateLimiterOptions):
    """Reverb's SampleToInsertRatio: samples and inserts each wait when they run ahead of
    `samples_per_insert` by more than `error_buffer` sampled items (service/limiters.py)."""

    kind = "sample_to_insert_ratio"
    samples_change_state = True
    samples_per_insert: float = 0.0
    min_size_to_sample: int = 1
    error_buffer: float = 0.0

    def __post_init__(self) -> None:
        self._min_size()
        self._real("samples_per_insert", 0.0, expected="finite and >= 0")
        self._real("error_buffer", 0.0, expected="finite and >= 0")
        if self.samples_per_insert > 0 and 2 * self.error_buffer < self.samples_per_insert + 1:
            raise InvalidArgument(
                f"rate_limiter.error_buffer={self.error_buffer} is too small for samples_per_insert="
                f"{self.samples_per_insert}: need 2 * error_buffer >= samples_per_insert + 1, or inserts and "
                "samples could block each other"
            )

    def _field(self, name: str) -> str:
        return f"rate_limiter.{name}"


def sampling_changes_state(remover: RemoverOptions, rate_limiter: RateLimiterOptions) -> bool:
    """Whether a sample changes the buffer (a remover counting draws, a limiter's balance): such buffers are
    sampled by their server alone (no lock-free readers, no sample workers, no retried samples)."""
    return remover.retires or rate_limiter.samples_change_state


# ---------------------------------------------------------------------------------------------- batch modes
@dataclass(frozen=True)
class ModeOptions(Options):
    role = "mode"


@dataclass(frozen=True)
class Transitions(ModeOptions):
    """obs, step fields, next_obs, terminated/truncated and n-step targets (service/modes/transitions.py)."""

    kind = "transitions"
    n_step: int = 1
    gamma: float = 0.99

    def __post_init__(self) -> None:
        self._integer("n_step", 1, MAX_N_STEP)
        self._real("gamma", 0.0, 1.0, expected="in [0, 1]")


@dataclass(frozen=True)
class Geometric(ModeOptions):
    """Observation pairs (t, t + d) with P(d) proportional to discount^(d - 1) (service/modes/geometric.py)."""

    kind = "geometric"
    discount: float

    def __post_init__(self) -> None:
        self._real("discount", 0.0, 1.0, expected="in [0, 1]")


@dataclass(frozen=True)
class States(ModeOptions):
    """The observation fields of sampled steps."""

    kind = "states"


@dataclass(frozen=True)
class Sequences(ModeOptions):
    """Sequences of `burn_in + length` consecutive steps of one episode, for recurrent learners
    (service/modes/sequences.py). `period`: starts only at every period-th step of an episode (1: any step).
    `boundary`: "pad" zero-pads and masks a sequence that reaches its episode's end; "fit" starts only where a
    whole sequence fits. `n_step` >= 1 adds each step's n-step targets (0: none)."""

    kind = "sequences"
    length: int
    burn_in: int = 0
    period: int = 1
    boundary: str = "pad"
    n_step: int = 0
    gamma: float = 0.99

    def __post_init__(self) -> None:
        self._integer("length", 1)
        self._integer("burn_in", 0)
        self._integer("period", 1)
        self._choice("boundary", BOUNDARIES)
        self._integer("n_step", 0, MAX_N_STEP)
        self._real("gamma", 0.0, 1.0, expected="in [0, 1]")

    @property
    def steps(self) -> int:
        """Rows per sequence: burn_in + length."""
        return self.burn_in + self.length


@dataclass(frozen=True)
class Hindsight(ModeOptions):
    """Transitions of goal-conditioned episodes whose desired goal is, with probability `relabel_ratio`, a goal
    achieved later in the same episode (service/modes/hindsight.py). `strategy`: "final", "future", "episode"
    or "geometric" (offsets drawn as in the geometric mode, with `discount`)."""

    kind = "hindsight"
    strategy: str = "future"
    relabel_ratio: float = 0.8
    discount: float = 0.9

    def __post_init__(self) -> None:
        self._choice("strategy", STRATEGIES)
        self._real("relabel_ratio", 0.0, 1.0, expected="in [0, 1]")
        self._real("discount", 0.0, 1.0, expected="in [0, 1]")
