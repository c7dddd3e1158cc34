"""The dqn, ppo and allo learners' loops against a test server, with their batches, trainers and scoring stubbed:
when they score (a final score is never stale, never taken twice) and what they ask the server for."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import replayd.client.learners.allo as allo
import replayd.client.learners.common as common
import replayd.client.learners.dqn as dqn
import replayd.client.learners.ppo as ppo
from replayd.client import ReplayClient
from replayd.client.learners.common import Progress


class FakeLoader:
    """Stands for a Loader over `stream`: `batches` stand-in batches, then the end; closing it closes the stream."""

    batches = 0

    def __init__(self, stream, **options) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[None]:
        return iter([None] * self.batches)

    def close(self) -> None:
        self.stream.close()


def use_fake_loader(monkeypatch: pytest.MonkeyPatch, module, batches: int) -> None:
    monkeypatch.setattr(FakeLoader, "batches", batches)
    monkeypatch.setattr(module, "Loader", FakeLoader)
    monkeypatch.setattr(common, "write_run", lambda run_dir, summary, plot: None)


def scores(values: list[float]):
    """An evaluate_greedy stand-in answering `values` in turn (then the last one again)."""
    answers = iter(values)
    last = [0.0]

    def evaluate(*args, **kwargs) -> float:
        last[0] = next(answers, last[0])
        return last[0]

    return evaluate


class FakeDQNTrainer:
    def __init__(self, *args, **kwargs) -> None:
        self.online = torch.nn.Linear(4, 2)
        self.device = "cpu"

    def step(self, batch) -> None:
        pass


@pytest.mark.parametrize(("batches", "scored_at"), [(5, [2, 4, 5]), (4, [2, 4])])
def test_the_dqn_learner_scores_its_final_policy_once(
        client: ReplayClient, tmp_path, monkeypatch: pytest.MonkeyPatch, batches: int, scored_at: list[int]) -> None:
    """The last steps since the last evaluation are scored once more (final_eval_return is the final policy's);
    a run that ended on an evaluation is not scored twice."""
    use_fake_loader(monkeypatch, dqn, batches)
    monkeypatch.setattr(dqn, "DQNTrainer", FakeDQNTrainer)
    monkeypatch.setattr(dqn, "evaluate_greedy", scores([10.0, 20.0, 30.0, 40.0]))
    config = dqn.DQNLearnerConfig(address=client.address, run_dir=str(tmp_path), learning_starts=0, eval_every=2,
                                  seconds=60)
    summary = dqn.learn_dqn(config)
    assert [point["learner_steps"] for point in summary["curve"]] == scored_at
    assert summary["final_eval_return"] == 10.0 * len(scored_at)


class FakePPOTrainer:
    def __init__(self, *args, **kwargs) -> None:
        self.model = torch.nn.Linear(4, 2)
        self.device = "cpu"


def test_the_ppo_learner_asks_for_minibatches_of_the_whole_rollout_shuffled_anew_each_version(
        client: ReplayClient, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_loader(monkeypatch, ppo, 0)
    monkeypatch.setattr(ppo, "PPOTrainer", FakePPOTrainer)
    monkeypatch.setattr(ppo, "wait_until", lambda *args, **kwargs: True)  # every rollout complete at once
    monkeypatch.setattr(ppo, "evaluate_greedy", scores([0.0, 500.0]))  # solved at the second evaluation
    asked: list[tuple[int, int | None]] = []
    minibatches = ReplayClient.rollout_minibatches

    def rollout_minibatches(self, buffer, minibatch_size, **options):
        asked.append((minibatch_size, options.get("seed")))
        return minibatches(self, buffer, minibatch_size, **options)

    monkeypatch.setattr(ReplayClient, "rollout_minibatches", rollout_minibatches)
    config = ppo.PPOLearnerConfig(address=client.address, run_dir=str(tmp_path), actors=3, num_envs=2,
                                  rollout_steps=8, minibatches=4, eval_every=1, seed=10, seconds=60)
    summary = ppo.learn_ppo(config)
    assert summary["rollouts"] == 2
    # 8 steps x (3 actors x 2 envs) cells in 4 minibatches; each rollout (policy version) shuffled otherwise.
    assert [size for size, _ in asked] == [12, 12]
    assert asked[0][1] != asked[1][1]


class FakeAlloTrainer:
    def __init__(self, obs_dim: int, d: int, **options) -> None:
        self.d = d

    def step(self, pairs, u1, u2) -> None:
        pass

    def encode(self, states: torch.Tensor) -> torch.Tensor:
        return torch.ones(len(states), self.d)


@pytest.mark.parametrize(("batches", "scored_at"), [(5, [2, 4, 5]), (4, [2, 4])])
def test_the_allo_learner_scores_its_final_encoder_once(
        client: ReplayClient, tmp_path, monkeypatch: pytest.MonkeyPatch, batches: int, scored_at: list[int]) -> None:
    use_fake_loader(monkeypatch, allo, batches)
    monkeypatch.setattr(allo, "AlloTrainer", FakeAlloTrainer)
    monkeypatch.setattr(allo, "plot_eigenvectors", lambda *args: None)
    reported: list[int] = []

    def report(progress: Progress) -> None:
        if len(progress.curve) > len(reported):  # a curve point (the other reports keep a progress bar moving)
            reported.append(progress.learner_steps)

    config = allo.AlloLearnerConfig(address=client.address, run_dir=str(tmp_path), learning_starts=0, eval_every=2,
                                    d=3, seconds=60)
    summary = allo.learn_allo(config, report)
    assert [point["learner_steps"] for point in summary["curve"]] == scored_at
    assert reported == scored_at


@pytest.mark.parametrize(("made", "message"), [
    ({}, None),  # alike: reused, and the learner goes on to wait for its actors
    ({"gamma": 0.9}, r"gamma 0\.9 \(needs 0\.99\)"),
    ({"gae_lambda": 0.5}, r"gae_lambda 0\.5 \(needs 0\.95\)"),
    ({"num_steps": 16, "num_envs": 3}, r"num_steps 16 \(needs 8\), num_envs 3 \(needs 6\)"),  # 48 cells either way
])
def test_the_ppo_learner_does_not_reuse_a_rollout_buffer_made_with_other_gae_settings(
        client: ReplayClient, tmp_path, monkeypatch: pytest.MonkeyPatch, made: dict, message: str | None) -> None:
    """An earlier learner's rollout buffer alike in cells and fields but not in γ, λ or its (steps, envs) split
    would have GAE run with the other settings (or the actors' parts refused): the learner names what differs."""
    monkeypatch.setattr(ppo, "PPOTrainer", FakePPOTrainer)

    def no_actors(*args, **kwargs):
        raise TimeoutError("no actors in this test")

    monkeypatch.setattr(ppo, "wait_until", no_actors)
    settings = {"num_steps": 8, "num_envs": 6, "gamma": 0.99, "gae_lambda": 0.95, **made}
    client.create_rollout_buffer(ppo.BUFFER, settings["num_steps"], settings["num_envs"],
                                 {"obs": ("float32", (4,)), "action": ("int64", ()), "log_prob": ("float32", ())},
                                 settings["gamma"], settings["gae_lambda"])
    config = ppo.PPOLearnerConfig(address=client.address, run_dir=str(tmp_path), actors=3, num_envs=2,
                                  rollout_steps=8, seconds=60)
    with pytest.raises(common.BufferMismatch if message else TimeoutError, match=message or "no actors"):
        ppo.learn_ppo(config)


def record_the_end(monkeypatch: pytest.MonkeyPatch, events: list[str], fail_writing: bool = False) -> None:
    """Records when the run folder is written and when weights are published final."""
    publish = common.WeightsPublisher.publish

    def write_run(run_dir, summary, plot) -> None:
        if fail_writing:
            raise OSError("no space left on device")
        events.append("run folder")

    def recording_publish(self, module, final=False, version=None) -> int:
        published = publish(self, module, final=final, version=version)
        if final:
            events.append(f"final weights {published}")
        return published

    monkeypatch.setattr(common, "write_run", write_run)
    monkeypatch.setattr(common.WeightsPublisher, "publish", recording_publish)


@pytest.mark.parametrize("algo", ["dqn", "ppo"])
def test_the_final_weights_that_stop_the_actors_come_after_the_run_folder_and_the_summary_line(
        client: ReplayClient, tmp_path, monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    """The actors stop on the final weights, and a stack that ends when a process exits (compose's --exit-code-from
    learner) stopped the learner while it was still evaluating and writing its summary: it published them first."""
    events: list[str] = []
    if algo == "dqn":
        use_fake_loader(monkeypatch, dqn, 3)
        monkeypatch.setattr(dqn, "DQNTrainer", FakeDQNTrainer)
        monkeypatch.setattr(dqn, "evaluate_greedy", scores([10.0]))
        record_the_end(monkeypatch, events)
        config = dqn.DQNLearnerConfig(address=client.address, run_dir=str(tmp_path), learning_starts=0, seconds=60)
        summary = dqn.learn_dqn(config, finished=lambda summary: events.append("summary line"))
    else:
        use_fake_loader(monkeypatch, ppo, 0)
        monkeypatch.setattr(ppo, "PPOTrainer", FakePPOTrainer)
        monkeypatch.setattr(ppo, "wait_until", lambda *args, **kwargs: True)
        monkeypatch.setattr(ppo, "evaluate_greedy", scores([500.0]))
        record_the_end(monkeypatch, events)
        config = ppo.PPOLearnerConfig(address=client.address, run_dir=str(tmp_path), actors=1, num_envs=1,
                                      rollout_steps=8, minibatches=1, seconds=60)
        summary = ppo.learn_ppo(config, finished=lambda summary: events.append("summary line"))
    final = client.fetch_weights(config.weights)
    assert final.final and events == ["run folder", "summary line", f"final weights {final.version}"]
    if algo == "dqn":
        assert summary["weights_version"] == final.version


def test_final_weights_stop_the_actors_even_when_the_run_folder_cannot_be_written(
        client: ReplayClient, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    use_fake_loader(monkeypatch, dqn, 3)
    monkeypatch.setattr(dqn, "DQNTrainer", FakeDQNTrainer)
    monkeypatch.setattr(dqn, "evaluate_greedy", scores([10.0]))
    record_the_end(monkeypatch, events, fail_writing=True)
    config = dqn.DQNLearnerConfig(address=client.address, run_dir=str(tmp_path), learning_starts=0, seconds=60)
    with pytest.raises(OSError, match="no space left"):
        dqn.learn_dqn(config, finished=lambda summary: events.append("summary line"))
    assert client.fetch_weights("q").final and events == [f"final weights {client.fetch_weights('q').version}"]
