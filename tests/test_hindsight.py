"""Hindsight relabeling against the inserted episodes: relabeled goals are goals achieved later in the same
episode, offsets follow each strategy's law, nothing stored is rewritten, and bad requests are refused
naming the field."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from replayd.client import Hindsight, ReplayClient, Transitions
from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.modes.hindsight import HindsightMode
from replayd.server.schema import Field
from replayd.wire.errors import InvalidArgument
from tests.conftest import rpc_status
from tests.test_episodic_buffer import _chi_square_critical

FIELDS = [
    Field("obs", "float32", (2,), observation=True),
    Field("achieved", "float32", (2,), observation=True),  # (episode id, step) of the state
    Field("goal", "float32", (2,), observation=True),  # the episode's goal: (episode id, -1)
    Field("action", "int64"),
    Field("reward", "float32"),
]
GOALS = ("achieved", "goal")


def new_buffer(capacity: int = 2000) -> EpisodicBuffer:
    return EpisodicBuffer("her", f"test{os.getpid()}", FIELDS, capacity, goal_fields=GOALS)


def episode_rows(episode_id: int, steps: int) -> dict[str, np.ndarray]:
    rows = steps + 1
    t = np.arange(rows, dtype=np.float32)
    ids = np.full(rows, episode_id, np.float32)
    return {"obs": np.stack([ids, t], 1), "achieved": np.stack([ids, t], 1),
            "goal": np.stack([ids, np.full(rows, -1, np.float32)], 1), "action": np.zeros(rows, np.int64),
            "reward": np.full(rows, -1, np.float32)}


def insert(buffer: EpisodicBuffer, lengths: list[int], first_id: int = 0) -> None:
    parts = [episode_rows(first_id + i, n) for i, n in enumerate(lengths)]
    columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    ids = np.arange(first_id, first_id + len(lengths))
    buffer.insert(columns, Spans.whole_episodes(np.array(lengths), ids, np.zeros(len(lengths), bool)))


@pytest.mark.parametrize("strategy", ["final", "future", "episode", "geometric"])
def test_relabeled_goals_are_goals_the_same_episode_achieved(strategy: str) -> None:
    lengths = [3, 9, 17, 30]
    buffer = new_buffer()
    try:
        insert(buffer, lengths)
        stored = {name: array.copy() for name, array in buffer.storage.arrays.items()}
        batch = buffer.sample(4096, HindsightMode(strategy, relabel_ratio=0.6), np.random.default_rng(0),
                              include_keys=True)
        episode, t = batch["obs"][:, 0], batch["obs"][:, 1]
        steps = np.array(lengths)[episode.astype(int)]
        relabeled, offset, goal = batch["relabeled"], batch["goal_offset"], batch["goal"]
        np.testing.assert_array_equal(goal[:, 0], episode)  # never another episode's goal
        np.testing.assert_array_equal(goal[relabeled, 1], t[relabeled] + offset[relabeled])
        assert np.all(goal[~relabeled, 1] == -1) and np.all(offset[~relabeled] == 0)
        np.testing.assert_array_equal(batch["next_achieved"][:, 1], t + 1)
        assert "next_goal" not in batch  # the transition's goal is one column
        low = -t if strategy == "episode" else np.where(strategy == "final", steps - t, 1)
        assert np.all(offset[relabeled] >= low[relabeled]) and np.all(t + offset <= steps)
        assert abs(relabeled.mean() - 0.6) < 4 * np.sqrt(0.24 / relabeled.size)
        for name, array in buffer.storage.arrays.items():  # nothing stored was rewritten
            np.testing.assert_array_equal(array, stored[name], err_msg=name)
    finally:
        buffer.close()


def offset_law(strategy: str, t: int, steps: int, discount: float) -> dict[int, float]:
    """P(k) for a transition at step t of an episode of `steps` steps."""
    if strategy == "final":
        return {steps - t: 1.0}
    if strategy == "future":
        return {k: 1 / (steps - t) for k in range(1, steps - t + 1)}
    if strategy == "episode":
        return {q - t: 1 / (steps + 1) for q in range(steps + 1)}
    weights = {k: discount ** (k - 1) for k in range(1, steps - t + 1)}
    total = sum(weights.values())
    return {k: w / total for k, w in weights.items()}


@pytest.mark.parametrize(("strategy", "discount"), [("future", 0.9), ("episode", 0.9), ("geometric", 0.7),
                                                    ("geometric", 1.0), ("final", 0.9)])
def test_goal_offsets_follow_the_strategys_law(strategy: str, discount: float) -> None:
    """One episode of 12 steps; the draw is uniform over its steps t, so (t, k) has probability
    P(k | t) / 12: a chi-square over every (t, k) cell."""
    steps = 12
    buffer = new_buffer()
    try:
        insert(buffer, [steps])
        rng = np.random.default_rng(5)
        mode = HindsightMode(strategy, relabel_ratio=1.0, discount=discount)
        batches = [buffer.sample(4000, mode, rng) for _ in range(10)]
        t = np.concatenate([b["obs"][:, 1] for b in batches]).astype(int)
        k = np.concatenate([b["goal_offset"] for b in batches])
        cells = [(tt, kk, p / steps) for tt in range(steps)
                 for kk, p in offset_law(strategy, tt, steps, discount).items()]
        counts = {(tt, kk): 0 for tt, kk, _ in cells}
        for pair in zip(t.tolist(), k.tolist(), strict=True):
            assert pair in counts, f"offset {pair[1]} at step {pair[0]} is outside the {strategy} strategy's support"
            counts[pair] += 1
        observed = np.array([counts[(tt, kk)] for tt, kk, _ in cells])
        expected = t.size * np.array([p for _, _, p in cells])
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < _chi_square_critical(len(cells) - 1), chi2
    finally:
        buffer.close()


@pytest.mark.parametrize(("options", "message"), [
    ({"strategy": "past"}, "hindsight.strategy must be one of 'final', 'future', 'episode', 'geometric', got 'past'"),
    ({"relabel_ratio": 1.5}, "hindsight.relabel_ratio must be in [0, 1], got 1.5"),
    ({"relabel_ratio": -0.1}, "hindsight.relabel_ratio must be in [0, 1], got -0.1"),
    ({"discount": float("nan")}, "hindsight.discount must be in [0, 1], got nan"),
])
def test_bad_options_are_refused_naming_the_field(options: dict, message: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        Hindsight(**options)
    assert str(refused.value) == message


@pytest.mark.parametrize(("goal_fields", "message"), [
    (("achieved", "achieved"), "goal_fields: expected two distinct field names"),
    (("achieved", "action"), "goal_fields: the desired goal 'action' is not an observation field"),
    (("missing", "goal"), "goal_fields: the achieved goal 'missing' is not an observation field"),
    (("achieved", "obs3"), "goal_fields: expected one dtype and shape"),
])
def test_goal_fields_must_be_two_observation_fields_alike(goal_fields: tuple[str, str], message: str) -> None:
    fields = [*FIELDS, Field("obs3", "float32", (3,), observation=True)]
    with pytest.raises(InvalidArgument, match=message):
        EpisodicBuffer("her", f"test{os.getpid()}", fields, 100, goal_fields=goal_fields)


def test_hindsight_over_grpc_and_its_refusals(client: ReplayClient) -> None:
    schema = {f.name: (f.dtype, f.shape) for f in FIELDS}
    observed = ("obs", "achieved", "goal")
    client.create_buffer("plain", 100, schema, observation_fields=observed)
    code, details = rpc_status(client.sample, "plain", 4, Hindsight())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "has no goal fields" in details
    client.create_buffer("her", 500, schema, observation_fields=observed, goal_fields=GOALS)
    assert client.describe("her")["goal_fields"] == GOALS
    episode = episode_rows(3, 20)
    client.insert_episode("her", terminated=False, **{name: episode[name] if name in observed else episode[name][:-1]
                                                     for name in episode})
    batch = client.sample("her", 256, Hindsight("final", relabel_ratio=1.0), seed=1)
    np.testing.assert_array_equal(batch["goal"][:, 1], 20)  # the episode's final achieved goal
    assert batch["relabeled"].all() and set(batch) >= {"next_obs", "next_achieved", "terminated", "reward"}
    assert client.sample("her", 8, Transitions())["goal"].shape == (8, 2)  # other modes are unaffected
