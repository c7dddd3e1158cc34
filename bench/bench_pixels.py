"""Pixel replay on real Atari frames: memory per stored transition, sample streams and inserts, four layouts.

    .venv/bin/python -m bench.bench_pixels [--quick]      # JSON lines on stdout

Frames: Pong and Breakout through gymnasium's AtariPreprocessing (84x84 grayscale, frame_skip 4) and
FrameStackObservation(4), played by a random policy (ale-py ships the ROMs). The layouts, each measured beside
the first in the same run:

    stacked   obs uint8 (4, 84, 84) per row: the stack the wrapper gives, stored as it is
    stack4    Frames(stack=4, stack_axis=0): one frame per row, stacked at sample time
    zstd      the same, compression="zstd" (level 3)
    lz4       the same, compression="lz4" (level 9: LZ4 HC)

1. Shared-memory bytes per stored transition: an in-process buffer filled past wrap-around with the game's
   episodes (cycled, under new ids), its segment's bytes over the transitions it holds then (per-row offsets,
   lengths and the arena's slack included). The compressed buffers are sized by capacity_bytes alone.
2. Batch-32 transition streams (n_step=1) over gRPC from a server subprocess: transitions/s as the client decodes
   them; compressed ones with decompress="server" and, through the learner's Loader (CPU tensors, its prefetch
   thread decompressing), with decompress="client", beside the Loader over the uncompressed layouts; and the
   bytes a batch's message carries on the wire.
3. Inserts of whole episodes (insert_episodes: client compression included), steps/s.
The passes of sections 2 and 3 run in rounds, each round every pass once in a new order (medians reported):
the machine is shared, and load that comes and goes then weighs on every layout alike.

Targets: memory at least 4x less than stacked with stack4, 50x with zstd, 40x with lz4; stack4's stream at
least 0.8x stacked's; the Loader over zstd and lz4 with decompress="client" at least 0.7x the batches/s of the
faster uncompressed layout, with at least 30x fewer bytes on the wire than stack4's batches.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import ale_py
import gymnasium as gym
import numpy as np
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

from bench.bench_replay import ServerProcess, batch_nbytes
from replayd.client import Frames, ReplayClient, Transitions
from replayd.client.loader import Loader
from replayd.client.replay_client import compress_columns
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.schema import Field
from replayd.wire import replay_pb2 as pb

gym.register_envs(ale_py)
GAMES = ("Pong", "Breakout")
FRAME = (84, 84)
BATCH = 32
MAX_EPISODE_STEPS = 2000  # episodes a random policy plays longer are truncated


@dataclass(frozen=True)
class Layout:
    name: str
    frames: Frames | None  # None: the stack stored as it is

    def schema(self) -> dict:
        obs = ("uint8", (4, *FRAME)) if self.frames is None else ("uint8", FRAME, self.frames)
        return {"obs": obs, "action": ("int64", ()), "reward": ("float32", ())}

    def fields(self) -> list[Field]:
        frames = self.frames or Frames()
        shape = (4, *FRAME) if self.frames is None else FRAME
        return [Field("obs", "uint8", shape, True, frames.stack, frames.stack_axis, frames.compression,
                      frames.compression_level), Field("action", "int64"), Field("reward", "float32")]

    @property
    def compressed(self) -> bool:
        return self.frames is not None and self.frames.compression is not None


LAYOUTS = [Layout("stacked", None), Layout("stack4", Frames(4, 0)), Layout("zstd", Frames(4, 0, "zstd", 3)),
           Layout("lz4", Frames(4, 0, "lz4", 9))]


def record(case: str, metric: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0,
           speedup: float = 0.0) -> dict:
    return {"bench": "pixels", "case": case, "metric": metric, "value": float(value), "unit": unit,
            "baseline": baseline, "baseline_value": float(baseline_value), "speedup": float(speedup)}


# ---------------------------------------------------------------------- frames
@dataclass
class Episode:
    frames: np.ndarray  # uint8 (L + 1, 84, 84): the newest frame of each state's stack
    action: np.ndarray  # int64 (L,)
    reward: np.ndarray  # float32 (L,)
    terminated: bool

    def columns(self, layout: Layout) -> dict[str, np.ndarray]:
        """The episode as insert_episodes takes it for `layout` (the stacks themselves for `stacked`)."""
        if layout.frames is not None:
            return {"obs": self.frames, "action": self.action, "reward": self.reward}
        back = np.maximum(np.arange(len(self.frames))[:, None] + np.arange(-3, 1), 0)  # (L + 1, 4)
        return {"obs": self.frames[back], "action": self.action, "reward": self.reward}


def play(game: str, steps: int) -> list[Episode]:
    """Episodes of a random policy, `steps` steps in all: the frames FrameStackObservation(4) stacks."""
    env = FrameStackObservation(AtariPreprocessing(gym.make(f"ALE/{game}-v5", frameskip=1), frame_skip=4,
                                                   screen_size=84, grayscale_obs=True), 4, padding_type="reset")
    env.action_space.seed(0)
    episodes, played = [], 0
    obs, _ = env.reset(seed=0)
    frames, actions, rewards = [obs[-1]], [], []
    while played < steps:
        action = int(env.action_space.sample())
        obs, reward, terminated, truncated, _ = env.step(action)
        frames.append(obs[-1])
        actions.append(action)
        rewards.append(reward)
        played += 1
        if terminated or truncated or len(actions) == MAX_EPISODE_STEPS or played == steps:
            episodes.append(Episode(np.stack(frames), np.array(actions, np.int64), np.array(rewards, np.float32),
                                    bool(terminated)))
            obs, _ = env.reset()
            frames, actions, rewards = [obs[-1]], [], []
    env.close()
    return episodes


def cycled(episodes: list[Episode]) -> Iterator[tuple[int, Episode]]:
    """The episodes over and over, each time under new ids."""
    episode_id = 0
    while True:
        for episode in episodes:
            yield episode_id, episode
            episode_id += 1


# ---------------------------------------------------------------------- 1. memory
def bytes_per_transition(layout: Layout, episodes: list[Episode], quick: bool) -> float:
    """Shared memory over stored transitions of an in-process buffer filled past wrap-around."""
    if layout.compressed:
        sizing = {"capacity_steps": 0, "capacity_bytes": (4 if quick else 32) * 2**20}
    else:
        sizing = {"capacity_steps": 1000 if quick else 4000}
    buffer = EpisodicBuffer("pixels", f"px{uuid.uuid4().hex[:8]}", layout.fields(), sizing["capacity_steps"],
                            capacity_bytes=sizing.get("capacity_bytes", 0))
    frames = {"obs": layout.frames} if layout.compressed else {}
    try:
        for episode_id, episode in cycled(episodes):
            columns = episode.columns(layout)
            rows = {name: np.concatenate([column, np.zeros((1, *column.shape[1:]), column.dtype)])
                    if name != "obs" else column for name, column in columns.items()}
            length = len(episode.action)
            buffer.insert(compress_columns(rows, frames), Spans.whole_episodes(
                np.array([length]), np.array([episode_id]), np.array([episode.terminated])))
            if buffer.counters["evicted_episodes"] >= 5:
                return buffer.storage.nbytes / buffer.sampleable_steps
    finally:
        buffer.close()
    raise AssertionError("unreachable: episodes are cycled until the buffer evicts")


def memory_records(game: str, episodes: list[Episode], quick: bool) -> list[dict]:
    figures = {layout.name: bytes_per_transition(layout, episodes, quick) for layout in LAYOUTS}
    targets = {"stack4": 4, "zstd": 50, "lz4": 40}
    return [record(f"{game}: shared-memory bytes per stored transition, {name} (target: >= {targets[name]}x less)",
                   "bytes_per_transition", figures[name], "bytes", "stacked (the stack stored per row)",
                   figures["stacked"], figures["stacked"] / figures[name]) for name in targets]


# ---------------------------------------------------------------------- 2. and 3. over gRPC
def interleaved(passes: dict[tuple, Callable[[], float]], rounds: int) -> dict[tuple, float]:
    """The median of each pass's figure over `rounds` rounds, every round running each pass once in a new order:
    the machine is shared, and load that comes and goes then weighs on every pass alike."""
    figures: dict[tuple, list[float]] = {key: [] for key in passes}
    order = np.random.default_rng(0)
    for _ in range(rounds):
        for index in order.permutation(len(passes)):
            key = list(passes)[index]
            figures[key].append(passes[key]())
    return {key: float(np.median(values)) for key, values in figures.items()}


def insert_pass(client: ReplayClient, name: str, layout: Layout, episodes: list[Episode], ids: Iterator[int]
                ) -> float:
    """Steps/s of insert_episodes of every episode, in writer batches of about 4,000 rows."""
    steps, start = 0, time.perf_counter()
    batch: list[Episode] = []
    for episode in episodes:
        batch.append(episode)
        if sum(len(e.frames) for e in batch) >= 4000 or episode is episodes[-1]:
            client.insert_episodes(name, [e.columns(layout) for e in batch], [e.terminated for e in batch],
                                   [next(ids) for _ in batch])
            steps += sum(len(e.action) for e in batch)
            batch = []
    return steps / (time.perf_counter() - start)


def stream_pass(client: ReplayClient, name: str, batches: int, decompress: str, loader: bool) -> float:
    """Batches/s of one stream: decoded by the client, or turned into tensors by a Loader (which decompresses on
    its prefetch thread for decompress="client")."""
    stream = client.sample_stream(name, BATCH, Transitions(), num_batches=batches, decompress=decompress)
    start = time.perf_counter()
    if loader:
        with Loader(stream, prefetch=4) as tensors:
            seen = sum(1 for _ in tensors)
    else:
        seen = sum(batch_nbytes(batch) > 0 for batch in stream)
    return seen / (time.perf_counter() - start)


def wire_bytes(client: ReplayClient, name: str, decompress: str, batches: int = 20) -> float:
    """Mean bytes of a stream's messages, as they arrive (before any decoding)."""
    call = client._channel.unary_stream("/replayd.v1.Replay/SampleStream",
                                        request_serializer=pb.SampleStreamRequest.SerializeToString)
    request = pb.SampleStreamRequest(request=client.sample_request(name, BATCH, Transitions(), decompress=decompress),
                                     num_batches=batches)
    return float(np.mean([len(message) for message in call(request, timeout=120)]))


def measure(client: ReplayClient, game: str, episodes: list[Episode], quick: bool) -> tuple[dict, dict]:
    """(figures of the insert and stream passes by (what, layout[, decompress]), wire bytes by (layout,
    decompress)) of one server holding a buffer per layout."""
    names = {layout.name: f"{game.lower()}_{layout.name}" for layout in LAYOUTS}
    for layout in LAYOUTS:
        sizing = {"capacity_bytes": 64 * 2**20} if layout.compressed else {}
        client.create_buffer(names[layout.name], 2000 if quick else 10_000, layout.schema(), **sizing)
    ids = iter(range(2**40))
    for layout in LAYOUTS:  # a first pass faults in the shared memory
        insert_pass(client, names[layout.name], layout, episodes, ids)
    passes = {("insert", layout.name): functools.partial(insert_pass, client, names[layout.name], layout, episodes,
                                                         ids) for layout in LAYOUTS}
    figures = interleaved(passes, 2 if quick else 3)
    batches = 60 if quick else 300
    passes = {("stream", layout.name): functools.partial(stream_pass, client, names[layout.name], batches, "server",
                                                         False) for layout in LAYOUTS}
    for layout in LAYOUTS:
        for decompress in ("server", "client") if layout.compressed else ("server",):
            passes["loader", layout.name, decompress] = functools.partial(
                stream_pass, client, names[layout.name], batches, decompress, True)
    for run in passes.values():  # warm-up: each stream's layout learned, each codec's contexts made
        run()
    figures |= interleaved(passes, 3 if quick else 5)
    wire = {(layout.name, decompress): wire_bytes(client, names[layout.name], decompress)
            for layout in LAYOUTS for decompress in (("server", "client") if layout.compressed else ("server",))}
    return figures, wire


def grpc_records(game: str, episodes: list[Episode], quick: bool) -> list[dict]:
    server = ServerProcess()
    client = ReplayClient(server.address, timeout=600, use_sample_workers=False)
    try:
        client.wait_ready(30)
        figures, wire = measure(client, game, episodes, quick)
    finally:
        client.close()
        server.stop()
    records, base = [], "stacked (the stack stored per row)"
    for name in ("stack4", "zstd", "lz4"):
        target = " (target: >= 0.8x)" if name == "stack4" else " (decompress='server')"
        stream, baseline = figures["stream", name], figures["stream", "stacked"]
        records.append(record(f"{game}: batch-{BATCH} sample stream, {name}{target}", "transitions_per_s",
                              stream * BATCH, "transitions/s", base, baseline * BATCH, stream / baseline))
        records.append(record(f"{game}: insert, whole episodes, {name} (client compression included)",
                              "insert_steps_per_s", figures["insert", name], "steps/s", base,
                              figures["insert", "stacked"], figures["insert", name] / figures["insert", "stacked"]))
    uncompressed = max(("stacked", "stack4"), key=lambda name: figures["loader", name, "server"])
    baseline = figures["loader", uncompressed, "server"]
    for name in ("zstd", "lz4"):
        client_side, server_side = figures["loader", name, "client"], figures["loader", name, "server"]
        records += [
            record(f"{game}: Loader over a batch-{BATCH} stream, {name} with decompress='client' (target: >= 0.7x)",
                   "loader_batches_per_s", client_side, "batches/s", f"{uncompressed} (the faster uncompressed "
                   "layout)", baseline, client_side / baseline),
            record(f"{game}: Loader over a batch-{BATCH} stream, {name} with decompress='server'",
                   "loader_batches_per_s", server_side, "batches/s", f"{uncompressed} (the faster uncompressed layout)",
                   baseline, server_side / baseline),
            record(f"{game}: wire bytes per batch-{BATCH} message, {name} with decompress='client' (target: >= 30x "
                   "fewer)", "wire_bytes_per_batch", wire[name, "client"], "bytes", "stack4 (frames decompressed "
                   "on the server)", wire["stack4", "server"], wire["stack4", "server"] / wire[name, "client"]),
        ]
    return records


def run(quick: bool = False) -> list[dict]:
    records = []
    for game in GAMES:
        start = time.perf_counter()
        episodes = play(game, 1500 if quick else 8000)
        print(f"  {game}: {sum(len(e.action) for e in episodes)} steps in {len(episodes)} episodes played in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        records += memory_records(game, episodes, quick)
        records += grpc_records(game, episodes, quick)
    return records


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller buffers, fewer batches")
    for row in run(quick=parser.parse_args().quick):
        print(json.dumps(row), flush=True)
