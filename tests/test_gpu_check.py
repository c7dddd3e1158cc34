"""bench/gpu_check.py runs where a GPU is lent, never in CI: its CPU mode keeps every part of it working."""

from bench import gpu_check
from tests.conftest import TEST_INSTANCE


def test_gpu_check_runs_the_loader_and_every_trainer_on_cpu() -> None:
    records = gpu_check.run(steps=3, warmup=1, device="cpu", instance=f"{TEST_INSTANCE}gpu")
    parts = [r.get("trainer") or r.get("part") for r in records]
    assert set(parts) == {"dqn", "double_dqn", "allo", "ppo", "loader", "dqn_learner"}
    assert all(r["device"] == "cpu" for r in records)
    loaders = [r for r in records if r.get("part") == "loader"]
    assert {r["profile"] for r in loaders} == {"cartpole", "atari"}
    assert all(r["landed_on"] == "cpu" and r["batches_per_s"] > 0 and r["MB_per_s"] > 0 for r in loaders)
    assert all(r["steps_per_s"] > 0 for r in records if "steps_per_s" in r)
    allo = [r for r in records if r.get("trainer") == "allo"]
    assert sorted((r["batch"], r["single_call"]) for r in allo) == [(256, False), (256, True), (1024, False),
                                                                     (1024, True)]
