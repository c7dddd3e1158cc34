"""What every learner shares: timing and progress reports, greedy evaluation, waiting for data, and
the run folder (summary.json and a learning curve)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from replayd.client.params import module_to_bytes
from replayd.client.polling import wait_until
from replayd.client.replay_client import ReplayClient
from replayd.client.sharded import connect

REPORT_EVERY = 1.0  # seconds between the reports that keep a progress bar moving between evaluations


@dataclass
class Progress:
    """What a learner reports to whoever drives it (a progress bar): at every curve point, and at least every
    REPORT_EVERY seconds while it trains or waits for data."""

    learner_steps: int = 0
    env_steps: int = 0  # at the last curve point
    steps_per_second: float = 0.0  # learner steps per second since the previous report
    score: float | None = None  # greedy return (DQN, PPO) or average |cosine| (ALLO), at the last curve point
    best_score: float | None = None
    training: bool = False  # the budget's clock runs (the first data is there)
    seconds: float = 0.0  # training seconds so far
    budget_seconds: float = 0.0
    curve: list[dict] = field(default_factory=list)


class Tracker:
    """Times a run against its budget, records curve points and reports the progress (see Progress). `waiting` is
    called at every poll while the learner waits for data: whoever drives the learner can end the wait by raising
    there (the demo does once an actor failed: the learner would otherwise wait out STARTUP_SECONDS, or its
    budget, for data that cannot come)."""

    def __init__(self, seconds: float, score_key: str, report: Callable[[Progress], None],
                 waiting: Callable[[], None]) -> None:
        self.budget = seconds
        self.score_key = score_key
        self.report = report
        self.waiting = waiting
        self.progress = Progress(budget_seconds=seconds)
        self._set_clock()

    def _set_clock(self) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + self.budget
        self._window_start, self._window_steps = self.started, 0

    def start_clock(self) -> None:
        """(Re)starts the budget. Learners call it once the first data is there: the server and the actors
        coming up do not eat the training time (they wait up to STARTUP_SECONDS instead)."""
        self._set_clock()
        self.progress.training = True

    def stepped(self, steps: int = 1) -> None:
        self.progress.learner_steps += steps
        self._window_steps += steps
        self._report_when_due()

    def still_waiting(self) -> bool:
        """wait_until's `stopped` for the learner's waits for data: runs the `waiting` hook at every poll that
        falls short (the hook ends the wait by raising); the learner itself never stops waiting early."""
        self.waiting()
        self._report_when_due()
        return False

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def seconds(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def record(self, score: float, env_steps: int, **extra: float) -> None:
        progress = self.progress
        progress.env_steps, progress.score = env_steps, score
        progress.best_score = score if progress.best_score is None else max(progress.best_score, score)
        progress.curve.append({"seconds": round(time.monotonic() - self.started, 2), "env_steps": env_steps,
                               "learner_steps": progress.learner_steps, **extra, self.score_key: score})
        self._report()

    def _report_when_due(self) -> None:
        if time.monotonic() - self._window_start >= REPORT_EVERY:
            self._report()

    def _report(self) -> None:
        now = time.monotonic()
        progress = self.progress
        progress.steps_per_second = self._window_steps / max(now - self._window_start, 1e-9)
        progress.seconds = now - self.started if progress.training else 0.0
        self.report(progress)
        self._window_start, self._window_steps = time.monotonic(), 0


@torch.no_grad()
def evaluate_greedy(act: Callable[[torch.Tensor], torch.Tensor], env_id: str, episodes: int, seed: int,
                    device: torch.device | str = "cpu") -> float:
    """Mean undiscounted return of a deterministic policy over `episodes` episodes (episode i is reset
    with seed + i); the episodes run side by side, one batched forward per step on `device`."""
    return evaluate_recurrent(lambda obs, state: (act(obs), state), torch.zeros(episodes, 0, device=device), env_id,
                              episodes, seed, device)


@torch.no_grad()
def evaluate_recurrent(act: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                       state: torch.Tensor, env_id: str, episodes: int, seed: int,
                       device: torch.device | str = "cpu") -> float:
    """evaluate_greedy for a policy with a recurrent state: `act(obs (N, *S), states (N, H))` returns the
    actions (N,) and the states after the step; `state` (episodes, H) holds the states the episodes start from."""
    from replayd.client.envs import make

    envs = [make(env_id) for _ in range(episodes)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    returns = np.zeros(episodes)
    state = state.clone()  # (episodes, H), each episode's state, updated in place
    active = list(range(episodes))
    while active:
        batch = torch.as_tensor(np.stack([obs[i] for i in active]), dtype=torch.float32, device=device)
        rows = torch.as_tensor(active, device=state.device)
        actions, state_after = act(batch, state[rows])
        state[rows] = state_after
        still = []
        for i, action in zip(active, actions.tolist(), strict=True):
            obs[i], reward, terminated, truncated, _ = envs[i].step(int(action))
            returns[i] += float(reward)
            if not (terminated or truncated):
                still.append(i)
        active = still
    return float(returns.mean())


def env_spaces(env_id: str) -> tuple[tuple[int, ...], int]:
    """(observation shape, number of actions) of an env with a Box observation and Discrete actions."""
    from replayd.client.envs import make

    env = make(env_id)
    return env.observation_space.shape, int(env.action_space.n)


STARTUP_SECONDS = 120.0  # how long a learner waits for the actors' first data, outside its budget


class BufferMismatch(RuntimeError):
    """The learner's buffer exists on the server, made otherwise than this learner needs it."""


def create_or_reuse(client: ReplayClient, name: str, create: Callable[[], object], kind: str,
                    capacity_steps: int, fields: Mapping[str, tuple[str, tuple[int, ...]]],
                    settings: Mapping[str, object] | None = None) -> bool:
    """Creates the learner's buffer, or reuses one an earlier learner left on the server (a learner started
    again goes on with its data) when it is alike: same kind, capacity and `fields` (name -> dtype, shape;
    fields it has beyond these, such as a rollout buffer's own, do not count), and the `settings` (describe's
    keys -> values, e.g. a rollout buffer's num_steps, num_envs, gamma and gae_lambda). Returns whether it
    reused one; BufferMismatch naming the differences otherwise."""
    try:
        create()
        return False
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        try:
            info = client.describe(name)
        except grpc.RpcError:
            raise exc from None  # refused for another reason than an existing buffer
    differences = []
    if info["kind"] != kind:
        differences.append(f"kind {info['kind']} (needs {kind})")
    if info["capacity_steps"] != capacity_steps:
        differences.append(f"capacity {info['capacity_steps']} steps (needs {capacity_steps})")
    for field_name, (dtype, shape) in fields.items():
        have = info["fields"].get(field_name)
        if have is None:
            differences.append(f"no field {field_name!r}")
        elif (have[0], tuple(have[1])) != (np.dtype(dtype).name, tuple(shape)):
            differences.append(f"field {field_name!r} {have[0]}{list(have[1])} (needs {np.dtype(dtype).name}"
                               f"{list(shape)})")
    if info["kind"] == kind:
        differences += [f"{key} {info.get(key)} (needs {value})" for key, value in (settings or {}).items()
                        if info.get(key) != value]
    if differences:
        raise BufferMismatch(f"buffer {name!r} already exists on the server with {', '.join(differences)}: delete it "
                             "(ReplayClient.delete_buffer) or restart the server")
    return True


def wait_for_steps(client: ReplayClient, buffer: str, steps: int, tracker: Tracker) -> None:
    """Polls until `buffer` holds `steps` sampleable steps (TimeoutError after STARTUP_SECONDS), telling
    `tracker` at every poll that falls short."""
    wait_until(lambda: client.describe(buffer)["sampleable_steps"] >= steps, time.monotonic() + STARTUP_SECONDS,
               f"buffer {buffer!r} reaching {steps} sampleable steps", tracker.still_waiting, delay=0.02,
               max_delay=0.25)


@dataclass(frozen=True)
class CurvePlot:
    y: str  # curve key on the y axis
    ylabel: str
    title: str
    target: float | None = None
    x: str = "env_steps"
    xlabel: str = "environment steps"


def write_run(run_dir: Path, summary: dict, plot: CurvePlot) -> None:
    """summary.json and learning_curve.png into `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_summary(run_dir, summary)
    write_curves(run_dir / "learning_curve.png", [("", summary["curve"])], plot)


def write_curves(path: Path, curves: Sequence[tuple[str, list[dict]]], plot: CurvePlot) -> None:
    """A PNG of one or more learning curves, each (legend label, curve points), and the target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for label, curve in curves:
        axis.plot([p[plot.x] for p in curve], [p[plot.y] for p in curve], marker="o", label=label or None)
    if plot.target is not None:
        axis.axhline(plot.target, color="gray", linestyle="--", label="target")
    if plot.target is not None or any(label for label, _ in curves):
        axis.legend()
    axis.set_xlabel(plot.xlabel)
    axis.set_ylabel(plot.ylabel)
    axis.set_title(plot.title)
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)


def write_summary(run_dir: Path, summary: dict) -> None:
    """summary.json; a buffer's component options are written as their configuration dicts."""
    text = json.dumps(summary, indent=2, default=lambda value: value.to_config())
    _replace_atomically(run_dir / "summary.json", lambda file: file.write(text.encode()))


def save_figure(figure: Any, path: Path) -> None:
    _replace_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))


def _replace_atomically(path: Path, write: Callable[[Any], object]) -> None:
    """A run folder never holds a half-written file, whenever the run is interrupted."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as file:
        write(file)
    os.replace(tmp, path)


class WeightsPublisher:
    """A learner's weights under one name, in versions above any stored there (an earlier run on the same
    server would have its lower versions refused, and its final weights would stop new actors at once)."""

    def __init__(self, client: ReplayClient, name: str) -> None:
        self.client, self.name = client, name
        self.version = client.fetch_weights(name).version  # 0: none stored

    def publish(self, module: torch.nn.Module, final: bool = False, version: int | None = None) -> int:
        """Publishes `module` as the next version (or `version`); raises if the server refuses it."""
        self.version = self.version + 1 if version is None else version
        if not self.client.publish_weights(self.name, self.version, module_to_bytes(module), final=final):
            raise RuntimeError(f"weights {self.name!r} version {self.version} were refused: another learner "
                               "publishes under that name")
        return self.version

    def publish_then_create(self, module: torch.nn.Module, create: Callable[[], object]) -> int:
        """Publishes `module`'s first version, then runs `create` (the learner's buffer: actors wait for it, then
        fetch the weights); if `create` fails, publishes them as final, so that the actors waiting stop. Returns
        the version published."""
        version = self.publish(module)
        try:
            create()
        except BaseException:
            self.publish(module, final=True)
            raise
        return version

    def final_later(self, module: torch.nn.Module) -> tuple[int, Callable[[], int]]:
        """The version the final weights will have, and the call that publishes them as that version (once the
        run folder is written, see finish_learner)."""
        version = self.version + 1
        return version, lambda: self.publish(module, final=True, version=version)


def start_learner(config: Any, score_key: str, report: Callable[[Progress], None],
                  waiting: Callable[[], None]) -> tuple[Tracker, ReplayClient]:
    """Seeds torch, makes the `config.seconds` tracker, connects to `config.address`."""
    torch.manual_seed(config.seed)
    tracker = Tracker(config.seconds, score_key, report, waiting)
    client = connect(config.address, timeout=30)
    client.wait_ready(timeout=60)
    return tracker, client


def env_steps(buffer_info: dict) -> int:
    """Environment steps an episodic buffer was given: its inserted rows less each ended episode's final
    observation (an open episode's first row still counts: off by at most the number of actors' envs)."""
    counters = buffer_info["counters"]
    return int(counters.get("inserted_rows", 0) - counters.get("inserted_episodes", 0))


def finish_learner(config: Any, client: ReplayClient, tracker: Tracker, plot: CurvePlot, results: dict,
                   finished: Callable[[dict], None] = lambda summary: None,
                   final_weights: Callable[[], object] | None = None) -> dict:
    """The summary (timing, counts, `results`, the buffer's final state, config, curve), written into
    `config.run_dir` with the learning curve; then `finished(summary)` (the command line prints its summary line);
    then `final_weights()` publishes the last weights as final, which stops the actors; closes the client.

    The actors stop last: a stack that ends as soon as a process exits (compose's --exit-code-from learner, a
    supervisor stopping the learner with its actors) finds the run folder and the summary line complete. The final
    weights are published even when writing the run folder fails, so that the actors stop all the same."""
    progress = tracker.progress
    buffer = client.describe(config.buffer)
    # Counted now, not at the last evaluation: a learner stopped before its first one still reports them.
    summary = {"seconds": tracker.seconds(), "learner_steps": progress.learner_steps, "env_steps": env_steps(buffer),
               **results, "buffer": buffer, "config": asdict(config), "curve": progress.curve}
    try:
        write_run(Path(config.run_dir), summary, plot)
        finished(summary)
    finally:
        try:
            if final_weights is not None:
                final_weights()
        finally:
            client.close()
    return summary
