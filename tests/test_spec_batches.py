"""The server's `Sequences` and `Hindsight` batches equal the ones tests/spec_batches.py builds from the same
episodes: the trainers' tests, which feed the builders' batches, read batches as the server sends them."""

from __future__ import annotations

import numpy as np

from replayd.client import Hindsight, ReplayClient, Sequences
from tests.spec_batches import Episode, hindsight_batch, sequence_rows

LENGTH, BURN_IN, N_STEP, GAMMA = 6, 2, 3, 0.9


def numbered_episodes(rng: np.random.Generator, goals: bool) -> list[Episode]:
    """Episodes whose first observation field holds 1000 * episode + step, so a row names its place."""
    episodes = []
    for e, (length, terminated) in enumerate([(3, True), (12, False), (7, True), (20, True), (1, False)]):
        observations = {"obs": (1000 * e + np.arange(length + 1, dtype=np.float32))[:, None]}
        steps = {"action": rng.integers(3, size=length), "reward": rng.normal(size=length).astype(np.float32)}
        if goals:
            observations["achieved_goal"] = rng.normal(size=(length + 1, 2)).astype(np.float32)
            observations["desired_goal"] = np.repeat(rng.normal(size=(1, 2)).astype(np.float32), length + 1, axis=0)
        else:
            steps["h"] = rng.normal(size=(length, 4)).astype(np.float32)
        episodes.append(Episode(observations, steps, terminated))
    return episodes


def insert(client: ReplayClient, buffer: str, episodes: list[Episode], **options: object) -> None:
    first = episodes[0]
    schema = {name: (column.dtype.name, column.shape[1:]) for name, column in
              [*first.observations.items(), *first.steps.items()]}
    client.create_buffer(buffer, 1000, schema, observation_fields=tuple(first.observations), **options)
    for episode in episodes:
        client.insert_episode(buffer, episode.terminated, **episode.observations, **episode.steps)


def test_the_servers_sequences_are_the_builders(client: ReplayClient) -> None:
    episodes = numbered_episodes(np.random.default_rng(0), goals=False)
    insert(client, "seq", episodes)
    batch = client.sample("seq", 256, Sequences(LENGTH, burn_in=BURN_IN, n_step=N_STEP, gamma=GAMMA), seed=1)
    starts = set()
    for i, first in enumerate(batch["obs"][:, 0, 0].astype(int)):  # row 0 is always a step of its episode
        e, start = divmod(int(first), 1000)
        starts.add((e, start))
        expected = sequence_rows(episodes[e], start, BURN_IN + LENGTH, N_STEP, GAMMA)
        for name, values in expected.items():
            np.testing.assert_allclose(batch[name][i], values, rtol=1e-6, err_msg=f"{name} of ({e}, {start})")
    assert len(starts) > 20  # padded, inside and ending sequences of every episode


def test_the_servers_hindsight_transitions_are_the_builders(client: ReplayClient) -> None:
    episodes = numbered_episodes(np.random.default_rng(1), goals=True)
    insert(client, "her", episodes, goal_fields=("achieved_goal", "desired_goal"))
    batch = client.sample("her", 256, Hindsight("future", relabel_ratio=0.5), seed=2)
    picks = [(*divmod(int(obs), 1000), int(k)) for obs, k in zip(batch["obs"][:, 0], batch["goal_offset"],
                                                                   strict=True)]
    expected = hindsight_batch(episodes, picks)
    assert set(expected) <= set(batch)
    for name, values in expected.items():
        np.testing.assert_array_equal(batch[name], values, err_msg=name)
    assert batch["relabeled"].any() and not batch["relabeled"].all()
