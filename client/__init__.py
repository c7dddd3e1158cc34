"""replayd client library: ReplayClient, EpisodeWriter; torch only in client.trainers and the loader."""

from client.episode_writer import EpisodeWriter
from client.replay_client import ReplayClient

__all__ = ["EpisodeWriter", "ReplayClient"]
