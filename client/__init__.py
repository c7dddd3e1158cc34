"""replayd client library: ReplayClient, ShardedReplayClient (one client over many servers), EpisodeWriter and the
typed options of buffers and batch modes; torch only in replayd.client.trainers and the loader."""

from replayd.client.episode_writer import EpisodeWriter
from replayd.client.replay_client import ReplayClient
from replayd.client.sharded import ShardedReplayClient
from replayd.wire.components import (
    Fifo,
    Geometric,
    Hindsight,
    MaxTimesSampled,
    MinSize,
    Prioritized,
    SampleToInsertRatio,
    Sequences,
    States,
    Transitions,
    Uniform,
)
from replayd.wire.frame_fields import Frames

__all__ = ["EpisodeWriter", "Fifo", "Frames", "Geometric", "Hindsight", "MaxTimesSampled", "MinSize", "Prioritized",
           "ReplayClient", "SampleToInsertRatio", "Sequences", "ShardedReplayClient", "States", "Transitions",
           "Uniform"]
