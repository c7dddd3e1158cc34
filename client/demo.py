"""`make demo`: the whole system on one machine: a replay server, actors and a learner, until the
learner reaches its target or the budget runs out. `--algo` picks what runs:

* dqn (default): 2 epsilon-greedy actors and a DQN learner on CartPole-v1, until the greedy policy's
  mean return over 20 episodes reaches 475;
* ppo: 2 actors x 4 CartPole envs pushing on-policy rollouts, a PPO learner owning the policy versions,
  until the deterministic policy's mean return over 20 episodes reaches 475;
* allo: 2 random-walk actors in four rooms and an ALLO learner, until the learned Laplacian
  representation's average |cosine| with the exact eigenvectors reaches 0.9;
* drqn: 2 epsilon-greedy recurrent actors on CartPole without velocities and a DRQN learner on prioritized
  sequences with stored states, until the greedy policy's mean return over 20 episodes reaches 475; then,
  as its baseline, plain DQN on the same task with the same budget;
* her: 2 epsilon-greedy actors on 15-bit flipping and a DQN learner on hindsight-relabeled transitions, until
  the greedy policy succeeds in 95 of 100 episodes; then, as its baseline, the same learner without
  relabeling with the same budget.

Every part is its own process talking gRPC on loopback, as it would across machines. A progress bar runs
over the training budget; the run folder gets a learning curve (PNG), a JSON summary, a screenshot of the
server's status page taken mid-run (status.png, where Chromium is installed) and, for allo, eigenvector
heatmaps; a run with a baseline draws both learning curves in one PNG, gives both final scores in its summary
(`scores`) and leaves the baseline's own run folder in `baseline/`. The server unlinks its shared memory on exit.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from replayd.client.algos import (
    ALGOS,
    Algo,
    Baseline,
    add_common_options,
    at_least,
    build,
    refuse_compile_loss_off_cpu,
    refuse_foreign_options,
)
from replayd.client.learners.common import CurvePlot, Progress, write_curves, write_summary
from replayd.client.progress_bar import ProgressBar
from replayd.client.replay_client import ReplayClient
from replayd.client.status_screenshot import MidRunScreenshot


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def local_server(instance: str | None = None) -> Iterator[tuple[str, str]]:
    """A `replayd serve` subprocess on free loopback ports; yields its gRPC address and its status page's URL,
    stops it on exit (the server unlinks its shared memory, named after `instance`, when it stops)."""
    port, http_port = free_port(), free_port()
    command = [sys.executable, "-m", "replayd.server.cli", "serve", "--port", str(port), "--instance",
               instance or f"demo{port}", "--http-port", str(http_port), "--log-level", "WARNING"]
    server = subprocess.Popen(command)
    try:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}/"
    finally:
        server.terminate()
        server.wait(timeout=30)


def _actor_entry(target: Callable[..., Any], config: Any, stop: Any, results: Any, index: int) -> None:
    results.put((index, asdict(target(config, stop))))


class ActorFailed(RuntimeError):
    """An actor process of the run ended with an error."""


class ActorRun:
    """The actor processes of a run: `reports` (each actor's, filled when the run ends; None for one that
    sent none), and which of them failed so far."""

    def __init__(self, processes: Sequence[mp.process.BaseProcess]) -> None:
        self.processes = processes
        self.reports: list[dict | None] = [None] * len(processes)

    def failed(self) -> list[str]:
        return [f"actor {index} (exit code {process.exitcode})" for index, process in enumerate(self.processes)
                if process.exitcode not in (None, 0)]

    def failure(self) -> str | None:
        """What failed, as a message; None while every actor is running or ended well."""
        failed = self.failed()
        return f"{', '.join(failed)} failed (see above)" if failed else None

    def check(self) -> None:
        """ActorFailed if an actor failed: a learner would otherwise train on until its budget ran out."""
        failure = self.failure()
        if failure is not None:
            raise ActorFailed(failure)


@contextmanager
def actor_processes(target: Callable[..., Any], configs: Sequence[Any]) -> Iterator[ActorRun]:
    """One spawned process per config running `target(config, stop)`. On exit the stop event is set and
    each actor's report (or None for one that did not report within 30 s) fills the run's reports."""
    context = mp.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    processes = [context.Process(target=_actor_entry, args=(target, config, stop, results, index), daemon=True)
                 for index, config in enumerate(configs)]
    run = ActorRun(processes)
    try:
        for process in processes:
            process.start()
        yield run
    finally:
        stop.set()
        deadline = time.monotonic() + 30
        pending = len(processes)
        # Drain the queue before joining (a child exits once its report is sent); a child that died
        # without reporting (a crash, Ctrl-C) ends the wait instead of the 30 s deadline.
        while pending and time.monotonic() < deadline:
            try:
                index, report = results.get(timeout=0.2)
            except queue.Empty:
                if not any(process.is_alive() for process in processes) and results.empty():
                    break
                continue
            run.reports[index] = report
            pending -= 1
        for process in processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    add_common_options(parser)
    parser.add_argument("--actors", type=at_least(1), default=2)
    parser.add_argument("--run-dir", help="default runs/demo (dqn) or runs/demo-<algo>")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eval-every", type=at_least(1),
                        help="dqn/drqn/her/allo: learner steps, ppo: versions between evaluations")
    parser.add_argument("--instance", help="names the server's shared memory (rpd_<instance>_...)")
    parser.add_argument("--local", action="store_true", default=None,
                        help="dqn: the learner samples the server's shared memory directly instead of over gRPC")
    parser.add_argument("--compile-loss", action="store_true", default=None,
                        help="dqn: compile the Q-loss ahead with inductor (CPU; needs a C++ compiler; "
                        "a 1.4-1.9x faster loss step)")
    args = vars(parser.parse_args(argv))
    algo_name, instance = args.pop("algo"), args.pop("instance")
    algo = ALGOS[algo_name]
    refuse_foreign_options(parser, algo_name, args, (algo.learner_config, algo.actor_config), own=("actors",))
    refuse_compile_loss_off_cpu(parser, args)
    args["run_dir"] = args["run_dir"] or ("runs/demo" if algo_name == "dqn" else f"runs/demo-{algo_name}")
    torch.set_num_threads(1)

    with local_server(instance) as (address, status_url):
        print(f"status page: {status_url}")
        screenshot = MidRunScreenshot(status_url, Path(args["run_dir"]) / "status.png")
        summary, bar = run_algo(algo, args, address, algo.label, screenshot)
        if algo.baseline is not None:  # the same task and budget without the algorithm's idea, to compare with
            summary["baseline"], baseline_bar = run_algo(ALGOS[algo.baseline.algo],
                                                         baseline_args(algo.baseline, args, summary), address,
                                                         algo.baseline.label, baseline=True)
    runs = [summary]
    print(bar.summary_line(summary))
    if algo.baseline is not None:
        runs.append(summary["baseline"])
        print(f"baseline, {baseline_bar.summary_line(summary['baseline'])}")
        write_comparison(algo, summary)
    for run in runs:
        write_summary(Path(run["config"]["run_dir"]), run)  # again, with the actors' reports
    outputs = (*algo.outputs, "status.png") if screenshot.saved else algo.outputs
    print(f"run folder: {args['run_dir']} ({', '.join(outputs)})")
    for run, which in zip(runs, ("", "baseline "), strict=False):
        silent = [index for index, report in enumerate(run["actors"]) if report is None]
        if silent:
            raise SystemExit(f"demo: {which}actor(s) {silent} ended without a report (failed or stuck; see above)")
    return summary


def run_algo(algo: Algo, args: dict[str, Any], address: str, label: str,
             screenshot: MidRunScreenshot | None = None, baseline: bool = False) -> tuple[dict, ProgressBar]:
    """One algorithm's actors and learner against the server at `address`, with a progress bar (its score named
    after `label`) and the status page's screenshot; the learner's summary with the actors' reports, and the
    bar. An actor's failure ends the demo, naming the baseline's actors as such."""
    learner_config = build(algo.learner_config, address=address, **args)
    actor_seconds = learner_config.seconds + 60
    # 1000 apart: a vector-env actor seeds its sub-envs seed + j, which must not overlap another actor's
    actor_configs = [build(algo.actor_config, **{**args, "seconds": actor_seconds}, address=address,
                           seed=1000 * i, actor_index=i) for i in range(args["actors"])]
    with actor_processes(algo.actor, actor_configs) as actors:
        monitor = ReplayClient(address)
        bar = ProgressBar(monitor, learner_config.buffer, algo.counters, f"{label} {algo.score_label}".strip(),
                          learner_config.seconds, actors.check)

        def report(progress: Progress) -> None:
            bar(progress)
            if screenshot is not None:
                screenshot(progress)

        try:
            summary = algo.learn(learner_config, report, actors.check)
            actors.check()  # an actor may fail while the learner, fed by the others, still finishes
            if screenshot is not None:
                screenshot.finish()  # a run shorter than the screenshot's moment: the server as the run ends
        except Exception as exc:  # the learner's error may only be what a failed actor left it (no data)
            failure = actors.failure()
            if failure is not None:
                raise SystemExit(f"demo: {'baseline ' if baseline else ''}{failure}") from exc
            raise
        finally:
            bar.close()
            monitor.close()
    summary["actors"] = actors.reports
    return summary, bar


def baseline_args(baseline: Baseline, args: dict[str, Any], summary: dict) -> dict[str, Any]:
    """The baseline's options: the demo's, its own (`baseline.options`), the budget the algorithm's learner had
    (given or its default, which the baseline's learner may not share), and a run folder inside the algorithm's."""
    return {**args, **baseline.options, "seconds": summary["config"]["seconds"],
            "run_dir": str(Path(summary["config"]["run_dir"]) / "baseline")}


def write_comparison(algo: Algo, summary: dict) -> None:
    """The run folder's learning curve with the baseline's beside the algorithm's (against training time: the
    budget they share), and each one's final score into the summary (`scores`)."""
    baseline = summary["baseline"]
    summary["scores"] = {algo.label: summary[algo.score], algo.baseline.label: baseline[algo.score]}
    plot = CurvePlot(algo.curve, algo.score_label, f"{algo.label} vs {algo.baseline.label} on "
                     f"{summary['config']['env_id']}", summary[algo.target], x="seconds", xlabel="training seconds")
    write_curves(Path(summary["config"]["run_dir"]) / "learning_curve.png",
                 [(algo.label, summary["curve"]), (algo.baseline.label, baseline["curve"])], plot)


if __name__ == "__main__":
    # SIGTERM (kill, docker stop) ends the demo as Ctrl-C does: what it started (the server and its shared
    # memory, the actors) is stopped on the way out. By default it ended the process alone.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    main()
