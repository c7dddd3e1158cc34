"""The episodic buffer against a plain reference written here with loops: episode bounds, n-step targets,
eviction and wrap-around, chunked (open) episodes, and all-or-nothing inserts."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from replayd.server.buffers.episodic import EpisodicBuffer, Spans
from replayd.server.kernels import HOLE
from replayd.server.modes.geometric import GeometricMode
from replayd.server.modes.states import StatesMode
from replayd.server.modes.transitions import TransitionsMode
from replayd.server.schema import Field
from replayd.wire.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

FIELDS = [
    Field("obs", "float32", (3,), observation=True),
    Field("t", "int64", (), observation=True),
    Field("action", "int64"),
    Field("reward", "float32"),
]


@dataclass
class RefEpisode:
    episode_id: int
    obs: np.ndarray  # (rows landed, 3)
    reward: np.ndarray  # (rows landed,) reward[t] of step t; the final row's is padding
    action: np.ndarray
    complete: bool = False
    terminated: bool = False
    rows: list = field(default_factory=list)


def make_rows(rng: np.random.Generator, start_t: int, count: int) -> dict[str, np.ndarray]:
    return {
        "obs": rng.normal(size=(count, 3)).astype(np.float32),
        "t": np.arange(start_t, start_t + count, dtype=np.int64),
        "action": rng.integers(0, 5, count),
        "reward": rng.normal(size=count).astype(np.float32),
    }


def new_buffer(capacity: int) -> EpisodicBuffer:
    return EpisodicBuffer("ref", f"test{os.getpid()}", FIELDS, capacity)


def expected_item(episode: RefEpisode, t: int, n: int, gamma: float) -> dict:
    bound = len(episode.obs) - 1  # the last landed row; the final observation once complete
    assert t < bound, "sampled a step without a successor"
    n_eff = min(n, bound - t)
    n_step_return = 0.0
    for k in range(n_eff):
        n_step_return += gamma**k * float(episode.reward[t + k])
    at_final = episode.complete and t + n_eff == bound
    discount = 0.0 if at_final and episode.terminated else gamma**n_eff
    last_step = episode.complete and t + 1 == bound
    return {
        "obs": episode.obs[t],
        "action": episode.action[t],
        "reward": episode.reward[t],
        "next_obs": episode.obs[t + 1],
        "terminated": last_step and episode.terminated,
        "truncated": last_step and not episode.terminated,
        "n_step_return": n_step_return,
        "bootstrap_discount": discount,
        "bootstrap_obs": episode.obs[t + n_eff],
    }


def check_transitions(buffer: EpisodicBuffer, episodes: dict[int, RefEpisode], n: int, gamma: float,
                      rng: np.random.Generator) -> set[int]:
    batch = buffer.sample(128, TransitionsMode(n, gamma), rng, include_keys=True)
    seen = set()
    for i in range(128):
        episode = episodes[int(batch["episode_id"][i])]
        t = int(batch["t"][i])
        want = expected_item(episode, t, n, gamma)
        np.testing.assert_array_equal(batch["obs"][i], want["obs"])
        np.testing.assert_array_equal(batch["next_obs"][i], want["next_obs"])
        np.testing.assert_array_equal(batch["bootstrap_obs"][i], want["bootstrap_obs"])
        assert batch["action"][i] == want["action"]
        assert batch["reward"][i] == want["reward"]
        assert bool(batch["terminated"][i]) == want["terminated"], (t, len(episode.obs))
        assert bool(batch["truncated"][i]) == want["truncated"]
        assert batch["n_step_return"][i] == pytest.approx(want["n_step_return"], rel=1e-5, abs=1e-5)
        assert batch["bootstrap_discount"][i] == pytest.approx(want["bootstrap_discount"], rel=1e-6)
        seen.add(episode.episode_id)
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_whole_episodes_with_wraparound_and_eviction_match_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    capacity = 211
    buffer = new_buffer(capacity)
    episodes: dict[int, RefEpisode] = {}
    order: list[int] = []
    next_id = 1
    try:
        for _ in range(60):
            count = int(rng.integers(1, 5))
            lengths = rng.integers(1, 40, count)
            terminated = rng.random(count) < 0.5
            parts = [make_rows(rng, 0, int(length) + 1) for length in lengths]
            ids = np.arange(next_id, next_id + count, dtype=np.uint64)
            next_id += count
            columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
            buffer.insert(columns, Spans.whole_episodes(lengths, ids, terminated))
            for episode_id, part, term in zip(ids, parts, terminated, strict=True):
                episodes[int(episode_id)] = RefEpisode(int(episode_id), part["obs"], part["reward"], part["action"],
                                                       complete=True, terminated=bool(term))
                order.append(int(episode_id))
            # FIFO of whole episodes: the newest episodes whose rows fit in the ring are alive.
            alive, rows = [], 0
            for episode_id in reversed(order):
                rows += len(episodes[episode_id].obs)
                if rows > capacity:
                    break
                alive.append(episode_id)
            assert buffer.episodes == len(alive)
            assert buffer.sampleable_steps == sum(len(episodes[e].obs) - 1 for e in alive)
            n = int(rng.integers(1, 6))
            seen = check_transitions(buffer, episodes, n, float(rng.uniform(0.5, 1.0)), rng)
            assert seen <= set(alive), "sampled an evicted episode"
    finally:
        buffer.close()


def test_chunked_episodes_interleaved_match_reference() -> None:
    """Several actors stream chunks of long episodes while others insert whole episodes: open episodes
    outgrow their room and move, steps become sampleable once their successor lands."""
    rng = np.random.default_rng(7)
    buffer = new_buffer(500)
    episodes: dict[int, RefEpisode] = {}
    open_ids: list[int] = []
    next_id = 1000
    try:
        for _ in range(300):
            if open_ids and rng.random() < 0.7:
                episode_id = int(rng.choice(open_ids))
                episode = episodes[episode_id]
                chunk = int(rng.integers(1, 12))
                ends = rng.random() < 0.15 or len(episode.obs) + chunk > 120
                part = make_rows(rng, len(episode.obs), chunk)
                terminated = bool(rng.random() < 0.5)
                spans = Spans(np.array([episode_id], np.uint64), np.array([chunk]), np.array([False]),
                              np.array([ends]), np.array([terminated]))
                buffer.insert(part, spans)
                episode.obs = np.concatenate([episode.obs, part["obs"]])
                episode.reward = np.concatenate([episode.reward, part["reward"]])
                episode.action = np.concatenate([episode.action, part["action"]])
                if ends:
                    episode.complete, episode.terminated = True, terminated
                    open_ids.remove(episode_id)
            elif len(open_ids) < 4 and rng.random() < 0.5:
                next_id += 1
                chunk = int(rng.integers(1, 10))
                part = make_rows(rng, 0, chunk)
                spans = Spans(np.array([next_id], np.uint64), np.array([chunk]), np.array([True]),
                              np.array([False]), np.array([False]))
                buffer.insert(part, spans)
                episodes[next_id] = RefEpisode(next_id, part["obs"], part["reward"], part["action"])
                open_ids.append(next_id)
            else:
                next_id += 1
                length = int(rng.integers(1, 30))
                part = make_rows(rng, 0, length + 1)
                terminated = bool(rng.random() < 0.5)
                spans = Spans.whole_episodes(np.array([length]), np.array([next_id]), np.array([terminated]))
                buffer.insert(part, spans)
                episodes[next_id] = RefEpisode(next_id, part["obs"], part["reward"], part["action"], True, terminated)
            # Evicted open episodes are gone for good: their writers get FAILED_PRECONDITION.
            open_ids = [e for e in open_ids if e in buffer.writer.open]
            if buffer.sampleable_steps:
                check_transitions(buffer, episodes, int(rng.integers(1, 5)), 0.9, rng)
        assert buffer.counters["evicted_episodes"] > 0
        assert buffer.counters["moved_open_episodes"] > 0
    finally:
        buffer.close()


def test_open_episode_evicted_by_newer_data_rejects_its_next_chunk() -> None:
    rng = np.random.default_rng(5)
    buffer = new_buffer(50)
    try:
        buffer.insert(make_rows(rng, 0, 4), Spans(np.array([9], np.uint64), np.array([4]), np.array([True]),
                                                   np.array([False]), np.array([False])))
        for episode_id in range(3):  # 3 x 20 rows: the ring (50) wraps past the open episode
            buffer.insert(make_rows(rng, 0, 20), Spans.whole_episodes(np.array([19]), [episode_id], [True]))
        assert buffer.counters["evicted_open_episodes"] == 1 and buffer.open_episodes == 0
        assert buffer.episodes == 2  # the open episode was never counted: its eviction leaves ep 1 and 2
        # Rows 48..67 took ring rows 48, 49, 0..17; the rest of episode 0's rows (18..27) hold no episode now.
        assert (buffer.ring.row_end[18:28] == HOLE).all() and (buffer.ring.row_seq[18:28] == -1).all()
        with pytest.raises(FailedPrecondition, match="continues episode 9, which is not open"):
            buffer.insert(make_rows(rng, 4, 2), Spans(np.array([9], np.uint64), np.array([2]), np.array([False]),
                                                       np.array([True]), np.array([True])))
    finally:
        buffer.close()


def test_open_episode_steps_become_sampleable_when_successor_lands() -> None:
    rng = np.random.default_rng(1)
    buffer = new_buffer(100)
    try:
        part = make_rows(rng, 0, 1)
        buffer.insert(part, Spans(np.array([5], np.uint64), np.array([1]), np.array([True]), np.array([False]),
                                  np.array([False])))
        assert buffer.sampleable_steps == 0
        with pytest.raises(FailedPrecondition, match="no sampleable steps"):
            buffer.sample(4, StatesMode(), rng)
        buffer.insert(make_rows(rng, 1, 1), Spans(np.array([5], np.uint64), np.array([1]), np.array([False]),
                                                   np.array([False]), np.array([False])))
        assert buffer.sampleable_steps == 1
        batch = buffer.sample(16, TransitionsMode(3, 0.5), rng)
        assert set(batch["t"]) == {0}
        assert not batch["terminated"].any() and not batch["truncated"].any()
        np.testing.assert_allclose(batch["bootstrap_discount"], 0.5)  # open: bootstraps from the last landed row
    finally:
        buffer.close()


def snapshot(buffer: EpisodicBuffer) -> dict[str, bytes]:
    return {name: array.tobytes() for name, array in buffer.storage.arrays.items()}


def test_a_mode_the_buffer_cannot_serve_fails_before_waiting_for_data() -> None:
    buffer = EpisodicBuffer("noreward", f"test{os.getpid()}", [f for f in FIELDS if f.name != "reward"], 16)
    try:
        started = time.monotonic()
        with pytest.raises(InvalidArgument, match="n_step > 1 needs a reward field"):
            buffer.sample(4, TransitionsMode(3, 0.9), wait_seconds=30)  # empty: it would wait 30 s first
        assert time.monotonic() - started < 5
    finally:
        buffer.close()


def test_schema_takes_any_numpy_spelling_of_a_dtype_and_names_a_bad_one() -> None:
    instance = f"test{os.getpid()}"
    spelled = [Field("obs", "<f4", (3,), observation=True), Field("action", "i8"), Field("reward", "float32")]
    buffer = EpisodicBuffer("spelled", instance, spelled, 16)
    try:
        assert [(f.name, f.dtype) for f in buffer.fields] == [("obs", "float32"), ("action", "int64"),
                                                              ("reward", "float32")]
        assert buffer.reward_field == "reward"  # "<f4" and "float32" are one dtype
        assert buffer.ring.columns["obs"].dtype == np.float32 and buffer.ring.columns["action"].dtype == np.int64
        rows = {"obs": np.zeros((3, 3), ">f4"), "action": np.zeros(2, np.int64), "reward": np.zeros(2, np.float32)}
        with pytest.raises(InvalidArgument, match="'obs' expected dtype float32, got float32 in non-native byte order"):
            buffer.insert(rows, Spans.whole_episodes(np.array([2]), np.array([7], np.uint64), np.array([True])))
        assert buffer.stored_steps == 0
    finally:
        buffer.close()
    for dtype, message in (("complex64", "dtype complex64 is not supported"), ("floaty", "'floaty' is not a numpy")):
        with pytest.raises(InvalidArgument, match=f"field 'obs': {message}"):
            EpisodicBuffer("bad", instance, [Field("obs", dtype, (3,), observation=True)], 16)
    for shape in ((2.7,), 3):  # not truncated to (2,), nor taken for (3,)
        with pytest.raises(InvalidArgument, match=r"field 'obs': shape .* must be a sequence of integers"):
            EpisodicBuffer("bad", instance, [Field("obs", "float32", shape, observation=True)], 16)
    buffer = EpisodicBuffer("numpy_dims", instance, [Field("obs", "float32", (np.int64(3),), observation=True)], 16)
    try:
        assert buffer.fields[0].shape == (3,)
    finally:
        buffer.close()


# Spelled out, not taken from replayd.server.schema: a name dropped there must fail here.
@pytest.mark.parametrize("name", ["terminated", "truncated", "n_step_return", "bootstrap_discount", "offset", "key",
                                  "episode_id", "probability", "weight", "advantage", "return",
                                  "next_obs", "future_obs", "bootstrap_obs", "bootstrap_value"])
def test_a_field_named_like_a_sampled_column_is_refused_naming_it(name: str) -> None:
    """Samples add these columns (next_obs, bootstrap_obs, n_step_return, ...): a stored field of the same
    name would collide with the sampled column in every batch."""
    fields = [Field("obs", "float32", (3,), observation=True), Field(name, "float32")]
    with pytest.raises(InvalidArgument, match=f"field name '{name}' is reserved for sampled columns"):
        EpisodicBuffer("shadow", f"test{os.getpid()}", fields, 16).close()  # the close: only if it was accepted


@pytest.mark.parametrize("shape", [(0,), (3, 0), (-1,)])
def test_a_field_shape_without_positive_dimensions_is_refused_naming_the_field(shape: tuple[int, ...]) -> None:
    with pytest.raises(InvalidArgument, match=r"field 'obs': shape \[.*\] must have positive dimensions"):
        EpisodicBuffer("empty", f"test{os.getpid()}", [Field("obs", "float32", shape, observation=True)],
                       16).close()  # the close runs only if the shape was wrongly accepted


def test_reward_field_names_a_field_or_defaults_to_reward() -> None:
    instance = f"test{os.getpid()}"
    with pytest.raises(InvalidArgument, match="reward_field 'rewrd' is not a field of the schema"):
        EpisodicBuffer("typo", instance, FIELDS, 16, reward_field="rewrd")
    with pytest.raises(InvalidArgument, match="reward field 'action' must be a scalar float32 or float64"):
        EpisodicBuffer("ints", instance, FIELDS, 16, reward_field="action")
    without_reward = [f for f in FIELDS if f.name != "reward"]
    for fields, expected in ((FIELDS, "reward"), (without_reward, None)):
        buffer = EpisodicBuffer("auto", instance, fields, 16)
        try:
            assert buffer.reward_field == expected
        finally:
            buffer.close()


def test_rejected_inserts_leave_buffer_byte_identical() -> None:
    rng = np.random.default_rng(2)
    buffer = new_buffer(64)
    try:
        good = make_rows(rng, 0, 11)
        buffer.insert(good, Spans.whole_episodes(np.array([10]), np.array([1]), np.array([True])))
        open_part = make_rows(rng, 0, 3)
        buffer.insert(open_part, Spans(np.array([2], np.uint64), np.array([3]), np.array([True]),
                                       np.array([False]), np.array([False])))
        before, counters = snapshot(buffer), buffer.counters.copy()
        bad_cases = [
            ({**good, "obs": good["obs"].astype(np.float64)}, Spans.whole_episodes(np.array([10]), [3], [True]),
             InvalidArgument, "'obs' expected dtype float32, got float64"),
            ({**good, "obs": np.zeros((11, 4), np.float32)}, Spans.whole_episodes(np.array([10]), [3], [True]),
             InvalidArgument, r"'obs' expected row shape \(3,\), got \(4,\)"),
            ({k: v for k, v in good.items() if k != "reward"}, Spans.whole_episodes(np.array([10]), [3], [True]),
             InvalidArgument, "'reward' is missing"),
            ({**good, "reward": good["reward"][:3]}, Spans.whole_episodes(np.array([10]), [3], [True]),
             InvalidArgument, "field 'reward' has 3 rows, other fields have 11"),
            (make_rows(rng, 0, 70), Spans.whole_episodes(np.array([69]), [3], [True]),
             InvalidArgument, "more than capacity_steps=64"),
            # an opening chunk longer than the ring would overwrite its own first rows
            (make_rows(rng, 0, 70), Spans(np.array([5], np.uint64), np.array([70]), np.array([True]),
                                          np.array([False]), np.array([False])),
             InvalidArgument, "chunk of episode 5 has 70 rows, more than capacity_steps=64"),
            (good, Spans.whole_episodes(np.array([9]), [3], [True]), InvalidArgument, "span_rows sum to 10"),
            # a valid whole episode followed by a chunk of an episode that is not open: nothing may land
            (make_rows(rng, 0, 12), Spans(np.array([4, 99], np.uint64), np.array([11, 1]), np.array([True, False]),
                                          np.array([True, False]), np.array([True, False])),
             FailedPrecondition, "continues episode 99, which is not open"),
            (make_rows(rng, 0, 2), Spans(np.array([2], np.uint64), np.array([2]), np.array([True]),
                                         np.array([False]), np.array([False])),
             InvalidArgument, "begins episode 2, which is already open"),
            # open episode 2 ends in span 0, and span 1 would go on with it
            (make_rows(rng, 0, 4), Spans(np.array([2, 2], np.uint64), np.array([2, 2]), np.array([False, False]),
                                         np.array([True, False]), np.array([True, False])),
             InvalidArgument, "span 1 continues episode 2, which span 0 of this request ended"),
            ({**good, "reward": np.where(np.arange(11) == 4, np.inf, good["reward"]).astype(np.float32)},
             Spans.whole_episodes(np.array([10]), [3], [True]), InvalidArgument, "'reward' row 4 is inf"),
            # the request's whole episode evicts open episode 2 before the request's chunk of it would land
            (make_rows(rng, 0, 61), Spans(np.array([7, 2], np.uint64), np.array([60, 1]), np.array([True, False]),
                                          np.array([True, False]), np.array([True, False])),
             ResourceExhausted, "open episode 2 would be overwritten before span 1 lands"),
        ]
        for columns, spans, error, message in bad_cases:
            with pytest.raises(error, match=message):
                buffer.insert(columns, spans)
            assert snapshot(buffer) == before
            assert buffer.counters == counters
    finally:
        buffer.close()


def open_spans(episode_ids: list[int], rows: list[int], begins: list[bool], ends: list[bool]) -> Spans:
    """Spans of open episodes (chunks; those that end are truncated)."""
    return Spans(np.array(episode_ids, np.uint64), np.array(rows), np.array(begins), np.array(ends),
                 np.zeros(len(episode_ids), bool))


@pytest.mark.parametrize("y_rows", [1, 3])  # Y's chunk lands in its extent's room (1) or makes it move (3)
def test_a_chunk_of_an_episode_an_earlier_span_evicted_is_refused_though_the_head_moved_back(y_rows: int) -> None:
    """In one request, X grows its room at the head (which evicts open episode Y), then closes, giving the
    room back (the head moves back), then Y goes on: Y is gone all the same, and nothing may land."""
    rng = np.random.default_rng(3)
    buffer = new_buffer(20)
    try:
        y, x = 1, 2
        buffer.insert(make_rows(rng, 0, 2), open_spans([y], [2], [True], [False]))  # rows 0-1, room 0-3
        buffer.insert(make_rows(rng, 0, 3), open_spans([x], [3], [True], [False]))  # rows 4-6, room 4-9
        before, counters, open_ids = snapshot(buffer), buffer.counters.copy(), sorted(buffer.writer.open)
        with pytest.raises(ResourceExhausted, match=f"open episode {y} would be overwritten before span 2 lands"):
            buffer.insert(make_rows(rng, 0, 8 + y_rows),
                          open_spans([x, x, y], [7, 1, y_rows], [False] * 3, [False, True, False]))
        assert snapshot(buffer) == before
        assert buffer.counters == counters and sorted(buffer.writer.open) == open_ids
    finally:
        buffer.close()


def _each_span_alone(columns: dict[str, np.ndarray], spans: Spans) -> list[tuple[dict[str, np.ndarray], Spans]]:
    """The request as one request per span."""
    ends = np.cumsum(spans.rows)
    return [({name: column[end - rows:end] for name, column in columns.items()},
             Spans(spans.episode_ids[i:i + 1], spans.rows[i:i + 1], spans.begins[i:i + 1], spans.ends[i:i + 1],
                   spans.terminated[i:i + 1]))
            for i, (end, rows) in enumerate(zip(ends, spans.rows, strict=True))]


@pytest.mark.parametrize("case", ["whole episodes outgrow the ring", "an old open episode closes, then is evicted",
                                  "an episode ends, then its id begins a new one"])
def test_a_request_that_evicts_what_it_wrote_equals_its_spans_sent_one_by_one(case: str) -> None:
    """Spans apply in order, each evicting what it needs: a request that outgrows the ring, whose later
    spans evict an episode its earlier ones closed, or that begins an episode under the id of one it ended, is
    stored as its spans sent as separate requests."""
    rng = np.random.default_rng(0)
    before: list[tuple[dict[str, np.ndarray], Spans]] = []
    if case == "whole episodes outgrow the ring":  # 40 + 40 + 10 rows into 64
        columns = make_rows(rng, 0, 90)
        request = Spans.whole_episodes(np.array([39, 39, 9]), [7, 8, 9], [True, False, True])
        survivors = {8, 9}
    elif case == "an episode ends, then its id begins a new one":
        before = [(make_rows(rng, 0, 4), Spans(np.array([1], np.uint64), np.array([4]), np.array([True]),
                                              np.array([False]), np.array([False])))]
        columns = make_rows(rng, 0, 8)  # episode 1 ends (3 more rows), then 1 begins again (5 rows, open)
        request = Spans(np.array([1, 1], np.uint64), np.array([3, 5]), np.array([False, True]),
                        np.array([True, False]), np.array([True, False]))
        survivors = {1}
    else:  # 64 rows: episode 1 opens at the tail (room 8), a whole episode fills the ring up to 50 rows
        before = [(make_rows(rng, 0, 4), Spans(np.array([1], np.uint64), np.array([4]), np.array([True]),
                                              np.array([False]), np.array([False]))),
                  (make_rows(rng, 0, 42), Spans.whole_episodes(np.array([41]), [2], [True]))]
        columns = make_rows(rng, 0, 22)  # close episode 1 (2 rows), then a 20-row episode that evicts it
        request = Spans(np.array([1, 3], np.uint64), np.array([2, 20]), np.array([False, True]),
                        np.array([True, True]), np.array([True, False]))
        survivors = {2, 3}
    together = EpisodicBuffer("together", f"test{os.getpid()}", FIELDS, 64)
    one_by_one = EpisodicBuffer("onebyone", f"test{os.getpid()}", FIELDS, 64)
    try:
        for buffer, requests in ((together, [(columns, request)]), (one_by_one, _each_span_alone(columns, request))):
            for rows, spans in before + requests:
                buffer.insert(rows, spans)
        assert snapshot(together) == snapshot(one_by_one)
        assert {**together.counters, "insert_requests": 0} == {**one_by_one.counters, "insert_requests": 0}
        batch = together.sample(64, TransitionsMode(), rng, include_keys=True)
        assert set(np.unique(batch["episode_id"]).tolist()) == survivors
    finally:
        together.close()
        one_by_one.close()


def _chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("discount", [0.2, 0.9, 0.99, 1.0])
def test_geometric_offsets_follow_truncated_geometric_law(discount: float) -> None:
    """Through the buffer: for each sample, M = steps from its start to the episode's final observation;
    offsets must follow P(d) = g^(d-1) (1-g) / (1-g^M) on 1..M. Randomized PIT values are U(0,1) exactly."""
    rng = np.random.default_rng(3)
    buffer = new_buffer(4000)
    try:
        lengths = rng.integers(1, 60, 60)
        parts = [make_rows(rng, 0, int(n) + 1) for n in lengths]
        columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(60), np.ones(60, bool)))
        length_of = dict(enumerate(lengths))
        pit = []
        for _ in range(40):
            batch = buffer.sample(1000, GeometricMode(discount), rng, include_keys=True)
            horizon = np.array([length_of[int(e)] for e in batch["episode_id"]]) - batch["t"]
            d = batch["offset"]
            assert (d >= 1).all() and (d <= horizon).all()
            np.testing.assert_array_equal(batch["future_t"], batch["t"] + d)
            if discount == 1.0:  # uniform on 1..M
                cdf = lambda k, m: k / m  # noqa: E731
            else:
                cdf = lambda k, m: (1 - discount**k) / (1 - discount**m)  # noqa: E731
            pit.append(cdf(d - 1, horizon) + rng.random(len(d)) * (cdf(d, horizon) - cdf(d - 1, horizon)))
        pit = np.concatenate(pit)
        counts = np.histogram(pit, bins=20, range=(0, 1))[0]
        expected = len(pit) / 20
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < _chi_square_critical(19), chi2
    finally:
        buffer.close()


def test_uniform_sampler_is_uniform_over_sampleable_steps() -> None:
    rng = np.random.default_rng(4)
    buffer = new_buffer(300)
    try:
        lengths = np.array([1, 2, 5, 10, 30])
        parts = [make_rows(rng, 0, int(n) + 1) for n in lengths]
        columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        buffer.insert(columns, Spans.whole_episodes(lengths, np.arange(5), np.ones(5, bool)))
        keys = np.concatenate([buffer.sample(1000, StatesMode(), rng, include_keys=True)["key"] for _ in range(60)])
        values, counts = np.unique(keys, return_counts=True)
        assert len(values) == lengths.sum()  # every step, never a final observation
        expected = len(keys) / lengths.sum()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < _chi_square_critical(len(values) - 1), chi2
    finally:
        buffer.close()


def test_open_episode_at_the_head_grows_in_place() -> None:
    """One writer streaming a long episode in chunks: its room doubles in place, no rows are copied, and
    closing gives the unused room back, so the ring holds no holes."""
    rng = np.random.default_rng(6)
    buffer = new_buffer(1000)
    try:
        buffer.insert(make_rows(rng, 0, 5), Spans(np.array([1], np.uint64), np.array([5]), np.array([True]),
                                                   np.array([False]), np.array([False])))
        landed = 5
        for k in range(12):
            ends = k == 11
            buffer.insert(make_rows(rng, landed, 20), Spans(np.array([1], np.uint64), np.array([20]),
                                                             np.array([False]), np.array([ends]), np.array([True])))
            landed += 20
        assert buffer.counters["moved_open_episodes"] == 0
        assert buffer.head == landed == buffer.stored_steps  # no holes
        batch = buffer.sample(256, TransitionsMode(1, 0.9), rng)
        np.testing.assert_array_equal(batch["next_t"], batch["t"] + 1)
        assert (batch["terminated"] == (batch["t"] == landed - 2)).all()
    finally:
        buffer.close()
