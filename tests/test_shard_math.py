"""The sharded client's arithmetic without servers: the split of a batch, global probabilities and importance weights
against one server's formulas over the union, shard-tagged keys, merged batches, placement by rendezvous hashing,
and how buffers' sizes and descriptions are divided and merged."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replayd.client.shard_math import (
    globalize,
    keys_by_shard,
    merge_descriptions,
    merge_rows,
    positions,
    rendezvous,
    shard_seed,
    split_batch,
    split_capacity,
    split_rate_limiter,
)
from replayd.client.shard_sampling import Holder, Split
from replayd.client.shard_set import Shard
from replayd.wire.components import MinSize, Prioritized, SampleToInsertRatio
from tests.shard_cluster import chi_square_critical


def test_a_split_draws_each_item_from_a_shard_in_proportion_to_its_mass() -> None:
    masses = [30.0, 60.0, 120.0, 0.0]
    counts = np.sum([split_batch(100, masses, np.random.default_rng(seed)) for seed in range(400)], axis=0)
    assert counts.sum() == 40_000 and counts[3] == 0
    expected = 40_000 * np.array(masses[:3]) / 210
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_critical(2), chi2


@pytest.mark.parametrize("masses", [[], [0.0, 0.0], [1.0, -1.0], [1.0, math.inf], [[1.0]]])
def test_masses_that_give_no_distribution_are_refused(masses: list) -> None:
    with pytest.raises(ValueError, match="masses: expected"):
        split_batch(8, masses, np.random.default_rng(0))


def test_seeds_differ_between_shards_and_repeat_for_one() -> None:
    assert shard_seed(7, 0) != shard_seed(7, 1)
    assert shard_seed(7, 1) == shard_seed(7, 1) < 2**64


def tagged(keys: np.ndarray, shard_index: int) -> np.ndarray:
    return globalize({"key": keys}, shard_index, 1.0, 1.0)["key"]


def test_tagged_keys_name_their_shard_and_position() -> None:
    keys = np.array([0, 5, 2**48 - 1], np.int64)
    tags = np.concatenate([tagged(keys, 0), tagged(keys, 3), tagged(keys, 2**15 - 1)])
    assert (tags >= 0).all()
    np.testing.assert_array_equal(positions(tags), np.tile(keys, 3))
    assert {shard: idx.tolist() for shard, idx in keys_by_shard(tags).items()} == {
        0: [0, 1, 2], 3: [3, 4, 5], 2**15 - 1: [6, 7, 8]}
    assert tagged(keys, 0) is keys  # shard 0's keys are one server's keys


def test_a_position_beyond_the_tag_bits_is_refused() -> None:
    with pytest.raises(ValueError, match=r"key: expected positions below 2\*\*48 from a shard, got 281474976710656"):
        tagged(np.array([2**48], np.int64), 2)


def prioritized_holder(index: int, leaves: np.ndarray) -> Holder:
    counters = {"prioritized.total": float(leaves.sum()), "prioritized.min_positive": float(leaves[leaves > 0].min())}
    return Holder(Shard(index, f"10.0.0.{index}:1", client=None), {"counters": counters, "sampleable_steps": 0})


def server_columns(leaves: np.ndarray, drawn: np.ndarray, beta: float) -> dict[str, np.ndarray]:
    """What one server answers for the drawn leaves (service/samplers/prioritized.py): p / total, (p / min p)^-beta."""
    values = leaves[drawn]
    weight = np.exp(-beta * (np.log(values) - math.log(leaves[leaves > 0].min()))).astype(np.float32)
    return {"key": drawn.astype(np.int64), "probability": values / leaves.sum(), "weight": weight}


def test_shard_probabilities_and_weights_become_one_servers_over_the_union() -> None:
    """Every step of three shards, merged in a random order: each row's probability and weight are those a server
    holding the union gives the same step."""
    rng = np.random.default_rng(0)
    shards = [rng.uniform(0.5, 3.0, 40) ** 0.6, rng.uniform(1e-3, 1.0, 25) ** 0.6, rng.uniform(2.0, 9.0, 10) ** 0.6]
    starts = np.cumsum([0] + [leaves.size for leaves in shards])
    split = Split([prioritized_holder(k, leaves) for k, leaves in enumerate(shards)])
    pieces = [(k, (server_columns(leaves, np.arange(leaves.size), 0.4), 0, leaves.size))
              for k, leaves in enumerate(shards)]
    merged = split.merge(pieces, rng.permutation(starts[-1]), 0.4)
    union = server_columns(np.concatenate(shards), starts[merged["key"] >> 48] + positions(merged["key"]), 0.4)
    np.testing.assert_allclose(merged["probability"], union["probability"], rtol=1e-12)
    np.testing.assert_allclose(merged["weight"], union["weight"], rtol=1e-6)
    assert sorted(merged["key"].tolist()) == sorted(k << 48 | p for k, leaves in enumerate(shards)
                                                    for p in range(leaves.size))
    for k, leaves in enumerate(shards):  # one shard's rows alone come out alike
        alone = split.merge([pieces[k]], None, 0.4)
        reference = server_columns(np.concatenate(shards), starts[k] + np.arange(leaves.size), 0.4)
        np.testing.assert_allclose(alone["probability"], reference["probability"], rtol=1e-12)
        np.testing.assert_allclose(alone["weight"], reference["weight"], rtol=1e-6)


def test_one_shards_batch_is_returned_as_it_came() -> None:
    leaves = np.array([1.0, 2.0])
    split = Split([prioritized_holder(0, leaves)])
    columns = server_columns(leaves, np.array([0, 1, 1]), 0.5)
    merged = split.merge([(0, (columns, 0, 3))], None, 0.5)
    assert all(merged[name] is columns[name] for name in columns)


def test_merged_rows_keep_their_order_and_aliases_as_one_array() -> None:
    first = {"next_obs": np.arange(6.0).reshape(3, 2), "reward": np.arange(3.0)}
    first["bootstrap_obs"] = first["next_obs"]
    merged = merge_rows([(first, 0, 3), (first, 1, 3)])
    np.testing.assert_array_equal(merged["reward"], [0.0, 1.0, 2.0, 1.0, 2.0])
    assert merged["bootstrap_obs"] is merged["next_obs"] and merged["next_obs"].shape == (5, 2)
    np.testing.assert_array_equal(merge_rows([(first, 1, 3)], np.array([1, 0]))["reward"], [2.0, 1.0])


def test_every_row_of_a_merged_batch_is_a_draw_over_the_union_wherever_it_stands() -> None:
    """Sub-batches arrive grouped by shard; the merged batch takes them in a random order, so that its first row, as
    any other, comes from a shard with the shard's share."""
    split = Split([Holder(Shard(k, f"10.0.0.{k}:1", client=None), {"counters": {}, "sampleable_steps": steps})
                   for k, steps in enumerate((10, 30))])
    rng = np.random.default_rng(3)
    first_rows = []
    for _ in range(2000):
        counts = split.counts(8, rng)
        pieces = [({"shard": np.full(count, k)}, 0, count) for k, count in enumerate(counts)]
        first_rows.append(int(merge_rows(pieces, split.order(counts, rng))["shard"][0]))
    observed = np.bincount(first_rows, minlength=2)
    expected = 2000 * np.array([0.25, 0.75])
    assert float(((observed - expected) ** 2 / expected).sum()) < chi_square_critical(1), observed
    assert split.order([8, 0], rng) is None  # rows of one shard are in the order it drew them


def test_rendezvous_spreads_keys_evenly_and_moves_only_a_leaving_candidates_keys() -> None:
    candidates = [f"10.0.0.{k}:50051" for k in range(4)]
    chosen = [rendezvous(f"writer|{episode}", candidates) for episode in range(4000)]
    counts = np.bincount(chosen, minlength=4)
    chi2 = float(((counts - 1000) ** 2 / 1000).sum())
    assert chi2 < chi_square_critical(3), counts
    without = candidates[:2] + candidates[3:]
    for episode, k in enumerate(chosen):
        moved = without[rendezvous(f"writer|{episode}", without)]
        assert k == 2 or moved == candidates[k]
    with pytest.raises(ValueError, match="candidates: expected at least one"):
        rendezvous("x", [])


def test_capacity_and_rate_limiters_are_divided_between_shards() -> None:
    assert split_capacity(1000, 3) == [334, 333, 333]
    with pytest.raises(ValueError, match=r"capacity_steps: expected at least one row per shard \(3\), got 2"):
        split_capacity(2, 3)
    assert split_rate_limiter(MinSize(10), 3) == MinSize(4)
    assert split_rate_limiter(MinSize(1), 3) == MinSize(1)
    # a shard keeps the error buffer its ratio needs: 2 * error_buffer >= samples_per_insert + 1
    assert split_rate_limiter(SampleToInsertRatio(4.0, 100, 9.0), 3) == SampleToInsertRatio(4.0, 34, 3.0)
    assert split_rate_limiter(SampleToInsertRatio(4.0, 100, 3.0), 3) == SampleToInsertRatio(4.0, 34, 2.5)


def description(address: str, steps: int, counters: dict[str, float], limiter: MinSize = MinSize(1)) -> tuple:
    return address, {"name": "b", "kind": "episodic", "fields": {"obs": ("float32", (2,), True)},
                     "sampler": Prioritized(0.6), "remover": None, "rate_limiter": limiter, "bytes": 10 * steps,
                     "stored_steps": steps, "sampleable_steps": steps - 1, "episodes": 1, "capacity_steps": 100,
                     "capacity_bytes": 0, "frames": {}, "missing_steps": 0, "counters": counters,
                     "shm_name": f"rpd_{address}_b", "host": address,
                     "sample_endpoints": []}


def test_descriptions_merge_into_totals_and_a_list_of_shards() -> None:
    merged = merge_descriptions([
        description("a:1", 11, {"sampled_items": 5, "prioritized.alpha": 0.6, "prioritized.max_priority": 2.0,
                                "prioritized.total": 3.0, "prioritized.min_positive": 0.5}, MinSize(2)),
        description("b:1", 21, {"sampled_items": 7, "prioritized.alpha": 0.6, "prioritized.max_priority": 4.0,
                                "prioritized.total": 1.0, "prioritized.min_positive": 0.0}, MinSize(2)),
    ])
    assert (merged["stored_steps"], merged["sampleable_steps"], merged["capacity_steps"]) == (32, 30, 200)
    assert merged["counters"] == {"sampled_items": 12, "prioritized.alpha": 0.6, "prioritized.max_priority": 4.0,
                                  "prioritized.total": 4.0, "prioritized.min_positive": 0.5}
    assert merged["rate_limiter"] == MinSize(4)
    assert [shard["address"] for shard in merged["shards"]] == ["a:1", "b:1"]
    assert merged["shards"][1]["stored_steps"] == 21 and merged["shm_name"] == ""


def test_a_compressed_fields_ratio_is_over_every_shards_stored_frames() -> None:
    merged = merge_descriptions([
        description("a:1", 11, {"frames.obs.stored_bytes": 100.0, "frames.obs.compression_ratio": 40.0}),
        description("b:1", 21, {"frames.obs.stored_bytes": 300.0, "frames.obs.compression_ratio": 20.0}),
    ])
    assert merged["counters"]["frames.obs.stored_bytes"] == 400.0
    assert merged["counters"]["frames.obs.compression_ratio"] == (40 * 100 + 20 * 300) / 400


def test_shards_holding_a_buffer_made_otherwise_are_named() -> None:
    other = description("b:1", 5, {})
    other[1]["sampler"] = Prioritized(0.7)
    with pytest.raises(ValueError, match="buffer 'b': sampler differs between shards"):
        merge_descriptions([description("a:1", 5, {}), other])
