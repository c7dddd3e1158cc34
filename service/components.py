"""The server's component classes by option class: what `build` makes of a buffer's typed options.

Each option kind registered in proto/components.py has one implementation here, and `build` is
the only place a component is made from options (a create request, a shared-memory header, a checkpoint,
a sample request): adding a sampler, remover, rate limiter or batch mode is its class, its options class
and its wire message, plus its entry in IMPLEMENTATIONS.
"""

from __future__ import annotations

from typing import TypeVar

from replayd.server.configured import Configured
from replayd.server.limiters import MinSizeLimiter, RateLimiter, SampleToInsertRatioLimiter
from replayd.server.modes.base import BatchMode
from replayd.server.modes.geometric import GeometricMode
from replayd.server.modes.hindsight import HindsightMode
from replayd.server.modes.sequences import SequencesMode
from replayd.server.modes.states import StatesMode
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.removers import FifoRemover, MaxTimesSampledRemover, Remover
from replayd.server.samplers.base import Sampler
from replayd.server.samplers.prioritized import PrioritizedSampler
from replayd.server.samplers.uniform import UniformSampler
from replayd.wire import components as options
from replayd.wire.components import Options

IMPLEMENTATIONS: dict[type[Options], type[Configured]] = {
    options.Uniform: UniformSampler,
    options.Prioritized: PrioritizedSampler,
    options.Fifo: FifoRemover,
    options.MaxTimesSampled: MaxTimesSampledRemover,
    options.MinSize: MinSizeLimiter,
    options.SampleToInsertRatio: SampleToInsertRatioLimiter,
    options.Transitions: TransitionsMode,
    options.Geometric: GeometricMode,
    options.States: StatesMode,
    options.Sequences: SequencesMode,
    options.Hindsight: HindsightMode,
}
ROLES: dict[str, type[Configured]] = {"sampler": Sampler, "remover": Remover, "rate_limiter": RateLimiter,
                                      "mode": BatchMode}

C = TypeVar("C", bound=Configured)


def build(chosen: Options) -> Configured:
    """A new component object configured by `chosen`."""
    return IMPLEMENTATIONS[type(chosen)].from_options(chosen)


def from_config(role: str, config: dict) -> Configured:
    """A new component object from its configuration dict (a header's or a checkpoint's)."""
    return build(options.from_config(role, config))
