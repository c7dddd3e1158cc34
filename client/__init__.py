"""replayd client library: ReplayClient, ShardedReplayClient (one client over many servers), EpisodeWriter and the
typed options of buffers and batch modes; torch only in client.trainers and the loader."""

from client.episode_writer import EpisodeWriter
from client.replay_client import ReplayClient
from client.sharded import ShardedReplayClient
from service.wire.components import (
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
from service.wire.frame_fields import Frames

__all__ = ["EpisodeWriter", "Fifo", "Frames", "Geometric", "Hindsight", "MaxTimesSampled", "MinSize", "Prioritized",
           "ReplayClient", "SampleToInsertRatio", "Sequences", "ShardedReplayClient", "States", "Transitions",
           "Uniform"]
