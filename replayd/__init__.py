"""replayd: an experience-replay service for reinforcement learning.

`replayd.server` is the replay server (`replayd serve`), `replayd.client` the client library and the actor and
learner programs, and `replayd.wire` what both share: the gRPC contract, the Arrow codec and the typed options
of buffers and batch modes. The names a program needs first are here:

    from replayd import ReplayClient, EpisodeWriter, Prioritized, Transitions
"""

from importlib.metadata import version

from replayd.client import (
    EpisodeWriter,
    Fifo,
    Frames,
    Geometric,
    Hindsight,
    MaxTimesSampled,
    MinSize,
    Prioritized,
    ReplayClient,
    SampleToInsertRatio,
    Sequences,
    ShardedReplayClient,
    States,
    Transitions,
    Uniform,
)

__version__ = version("replayd")

__all__ = ["EpisodeWriter", "Fifo", "Frames", "Geometric", "Hindsight", "MaxTimesSampled", "MinSize", "Prioritized",
           "ReplayClient", "SampleToInsertRatio", "Sequences", "ShardedReplayClient", "States", "Transitions",
           "Uniform", "__version__"]
