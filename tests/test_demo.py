"""The main job end to end on loopback with a tiny budget: `make demo`'s processes, and the services of
docker-compose.yml run as local processes (`make compose-check` runs them in containers on a Docker engine)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from replayd.client import ReplayClient
from replayd.client.actor import main as actor_main
from replayd.client.algos import ALGOS
from replayd.client.demo import ActorFailed, actor_processes, baseline_args
from replayd.client.demo import main as demo_main
from replayd.client.envs import CARTPOLE_POMDP
from replayd.client.learner import main as learner_main
from replayd.client.learners import common as learner_common
from replayd.client.learners import dqn as dqn_learner
from replayd.client.learners import ppo as ppo_learner
from replayd.client.learners.common import evaluate_greedy
from replayd.client.local_reader import LocalReader
from replayd.client.polling import wait_until
from replayd.client.status_screenshot import find_chromium
from replayd.client.trainers.dqn import DQNTrainer
from replayd.server.checkpoint import has_checkpoint
from replayd.server.cli import main as cli_main
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def _demo(tmp_path: Path, algo: str, *options: str) -> dict:
    return demo_main(["--algo", algo, "--run-dir", str(tmp_path), "--instance", f"test{os.getpid()}{algo}", *options])


def test_demo_processes_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    summary = _demo(tmp_path, "dqn", "--seconds", "10", "--eval-every", "50")
    assert summary["env_steps"] > 1000  # episodes flowed from the actors into the buffer
    assert summary["learner_steps"] > 0
    assert summary["weights_version"] > 1  # the learner published after training
    assert summary["buffer"]["episodes"] > 0
    assert [report["weights_version"] >= 1 for report in summary["actors"]] == [True, True]
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["curve"] and saved["learner_steps"] == summary["learner_steps"]
    assert saved["actors"] == summary["actors"]  # the run folder's summary has the actors' reports too
    # The status page as the server showed it (the run is shorter than the screenshot's moment: at its end).
    if find_chromium() is None:
        assert not (tmp_path / "status.png").exists()
    else:
        assert (tmp_path / "status.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr()
    assert re.search(r"status page: http://127\.0\.0\.1:\d+/", out.out)
    assert re.search(r"training +\d+%\|.*\| +\d+/10 s, greedy return", out.err)  # the bar
    line = (f"{summary['env_steps']:,} env steps, {summary['learner_steps']:,} learner steps")
    assert line in out.out and "replay ratio" in out.out


def test_sigterm_stops_everything_the_demo_started(tmp_path: Path) -> None:
    """SIGTERM (kill, docker stop) to the demo alone stops its server (with the shared memory) and its actors
    on the way out, as Ctrl-C does, rather than leave them running."""
    import signal

    instance = f"test{os.getpid()}term"
    demo = subprocess.Popen([sys.executable, "-m", "replayd.client.demo", "--seconds", "60", "--instance", instance,
                             "--run-dir", str(tmp_path)], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    def group_alive() -> bool:
        try:
            os.killpg(demo.pid, 0)
        except ProcessLookupError:
            return False
        demo.poll()  # reaps the demo itself once it ended (a zombie still counts in its group)
        return True

    try:
        wait_until(lambda: os.path.exists(f"/dev/shm/rpd_{instance}_cartpole"), time.monotonic() + 120,
                   "the demo's buffer")
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(60) == 128 + signal.SIGTERM
        wait_until(lambda: not group_alive(), time.monotonic() + 60, "the demo's server and actors ending")
        assert [name for name in os.listdir("/dev/shm") if instance in name] == []
    finally:
        if group_alive():
            os.killpg(demo.pid, signal.SIGKILL)
        for name in os.listdir("/dev/shm"):
            if instance in name:
                os.unlink(f"/dev/shm/{name}")


def test_demo_learner_can_sample_shared_memory_directly(tmp_path: Path) -> None:
    # No evaluation within the budget: the learner still evaluates its final policy and counts env steps.
    # The learner also runs the compiled Q-loss (compiled before its clock starts).
    summary = _demo(tmp_path, "dqn", "--seconds", "6", "--eval-every", "1000000", "--local", "--compile-loss")
    assert summary["learner_steps"] > 0 and summary["env_steps"] > 1000
    assert summary["seconds"] < 6 + 5  # the budget, and the final evaluation
    assert len(summary["curve"]) == 1 and summary["final_eval_return"] == summary["curve"][0]["eval_return"]
    # The local reader bypasses the server: the learner's batches are not counted as server samples.
    assert summary["buffer"]["counters"].get("sampled_items", 0) == 0


def test_demo_ppo_rollouts_flow_between_policy_versions(tmp_path: Path) -> None:
    summary = _demo(tmp_path, "ppo", "--seconds", "8", "--eval-every", "1", "--rollout-steps", "32")
    counters = summary["buffer"]["counters"]
    assert summary["rollouts"] >= 2 and counters["rollouts_finished"] >= 2  # >= 2 policy versions completed
    assert summary["learner_steps"] >= 2 * 4 * 4  # epochs x minibatches per rollout
    assert counters["stale_pushes"] == 0 and counters["rejected_pushes"] == 0
    assert summary["env_steps"] == summary["rollouts"] * 32 * 2 * 4
    assert summary["buffer"]["policy_version"] == summary["weights_version"] == summary["rollouts"] + 1
    for report in summary["actors"]:  # every actor acted with weights the learner published after training
        assert report["weights_version"] >= 2 and report["pushed"] >= 2
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["curve"] and saved["curve"][-1]["eval_return"] == summary["final_eval_return"]


def test_demo_allo_learns_from_random_walk_episodes(tmp_path: Path) -> None:
    summary = _demo(tmp_path, "allo", "--seconds", "8", "--eval-every", "50", "--episodes", "100")
    assert summary["buffer"]["episodes"] > 0 and [r["pushed"] for r in summary["actors"]] == [100, 100]
    assert summary["learner_steps"] > 0
    assert summary["buffer"]["counters"]["sampled_items"] >= 3 * 512 * summary["learner_steps"]
    assert len(summary["cosine"]) == 10 and 0 < summary["avg_cosine"] <= 1
    assert (tmp_path / "eigenvectors.png").stat().st_size > 5000
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["cosine"] == summary["cosine"] and saved["curve"][-1]["avg_cosine"] == round(summary["avg_cosine"], 4)


def _check_comparison(tmp_path: Path, summary: dict, labels: tuple[str, str], score: str) -> None:
    """Both runs trained and reported; the run folder holds both curves, both scores, and the baseline's own folder."""
    baseline = summary["baseline"]
    for run in (summary, baseline):
        assert run["learner_steps"] > 0 and run["curve"]
        assert [report["weights_version"] >= 1 for report in run["actors"]] == [True, True]
    assert baseline["config"]["buffer"] != summary["config"]["buffer"]  # its own data, not the algorithm's
    assert baseline["config"]["seconds"] == summary["config"]["seconds"]  # the same budget
    assert summary["scores"] == {labels[0]: summary[score], labels[1]: baseline[score]}
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["scores"] == summary["scores"] and saved["baseline"]["curve"] == baseline["curve"]
    assert json.loads((tmp_path / "baseline" / "summary.json").read_text())["curve"] == baseline["curve"]
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000
    assert (tmp_path / "baseline" / "learning_curve.png").stat().st_size > 1000


def test_demo_drqn_trains_on_stored_state_sequences_beside_plain_dqn(tmp_path: Path) -> None:
    summary = _demo(tmp_path, "drqn", "--seconds", "5", "--eval-every", "50")
    _check_comparison(tmp_path, summary, ("DRQN", "DQN (no memory)"), "final_eval_return")
    assert summary["buffer"]["fields"]["h"][1] == (summary["config"]["hidden"],)  # the actors' stored states
    assert summary["buffer"]["counters"]["sampled_items"] >= 32 * summary["learner_steps"]  # sequences
    assert summary["baseline"]["config"]["env_id"] == summary["config"]["env_id"] == CARTPOLE_POMDP
    assert summary["baseline"]["buffer"]["fields"]["obs"][1] == (2,)  # the POMDP's observation


def test_demo_her_trains_on_relabeled_goals_beside_dqn_without_relabeling(tmp_path: Path) -> None:
    summary = _demo(tmp_path, "her", "--seconds", "5", "--eval-every", "50")
    _check_comparison(tmp_path, summary, ("DQN + HER", "DQN (no relabeling)"), "final_success_rate")
    assert tuple(summary["buffer"]["goal_fields"]) == ("achieved_goal", "desired_goal")
    assert summary["config"]["relabel_ratio"] == 0.8 and summary["baseline"]["config"]["relabel_ratio"] == 0.0


@pytest.mark.parametrize("algo", ["drqn", "her"])
def test_a_baseline_gets_the_budget_the_algorithms_learner_had(algo: str) -> None:
    """Without --seconds each learner takes its own default (drqn 600 s, dqn 300 s): the baseline takes the
    algorithm's, and runs in a folder of its own inside the algorithm's."""
    learner = ALGOS[algo].learner_config(address="unused")
    summary = {"config": {"seconds": learner.seconds, "run_dir": "runs/x"}}
    args = baseline_args(ALGOS[algo].baseline, {"seconds": None, "run_dir": "runs/x", "actors": 2}, summary)
    assert args["seconds"] == learner.seconds and args["run_dir"] == str(Path("runs/x") / "baseline")
    assert args["buffer"] != learner.buffer and args["weights"] != learner.weights


def _interpolate(text: str, env: dict[str, str]) -> str:
    """docker compose's ${VAR:-default} (unset or empty) and ${VAR-default} (unset) interpolation, nested defaults
    included (innermost first), and $$ for a literal $."""
    innermost = re.compile(r"\$\{(\w+)(?:(:?)-([^${}]*))?\}")

    def value(match: re.Match) -> str:
        name, colon, default = match.group(1), match.group(2), match.group(3) or ""
        if name in env and (env[name] or not colon):
            return env[name]
        return default

    text = text.replace("$$", "\0")
    while (expanded := innermost.sub(value, text)) != text:
        text = expanded
    return text.replace("\0", "$")


def _compose(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_compose_ports_follow_their_variables() -> None:
    """One variable moves a port everywhere: the server's flag, the healthcheck, the clients' shard name, and the
    host ports docker-compose.publish.yml publishes for one shard."""
    services = _compose()["services"]
    env = {"REPLAYD_PORT": "6000", "REPLAYD_HTTP_PORT": "7000"}
    server = _interpolate(services["server"]["command"], env)
    assert "--port 6000" in server and "--http-port 7000" in server
    assert "127.0.0.1:7000/readyz" in _interpolate(" ".join(services["server"]["healthcheck"]["test"]), env)
    for name in ("actor", "learner"):
        assert "--address shards:server:6000" in _interpolate(services[name]["command"], env)
        assert _interpolate(services[name]["environment"]["REPLAYD_ADDRESS"], env) == "shards:server:6000"
    assert "--address shards:server:50051" in _interpolate(services["actor"]["command"], {})
    published = _compose("docker-compose.publish.yml")["services"]["server"]["ports"]
    assert [_interpolate(p, env) for p in published] == ["127.0.0.1:6000:6000", "127.0.0.1:7000:7000"]


def test_the_replay_tier_scales_and_clients_find_its_shards_by_the_service_name() -> None:
    """`--scale server=N`: no replica publishes a host port (N replicas cannot share one), each checkpoints into a
    folder of its own and restores it on start (--recover with --checkpoint-dir), and clients resolve the service
    name to every replica."""
    services = _compose()["services"]
    server = services["server"]
    assert "ports" not in server and "container_name" not in server
    command = _interpolate(server["command"], {})
    assert command.startswith("sh -c 'exec replayd serve ") and command.endswith("'")
    assert "--checkpoint-dir /checkpoints/server/$HOSTNAME " in command and " --recover " in command
    for name in ("actor", "learner"):
        assert _interpolate(services[name]["environment"]["REPLAYD_ADDRESS"], {}) == "shards:server:50051"


def test_compose_builds_one_dockerfile_and_actors_share_the_learners_image() -> None:
    """Every build argument compose passes is an ARG of the Dockerfile and every ARG can be set from compose (a GPU
    learner needs both a CUDA base image and torch's CUDA wheel index); the server and client images are targets of
    one build, and the actors run the image the learner builds (built once)."""
    services = _compose()["services"]
    dockerfile = (ROOT / services["server"]["build"]["context"] / services["server"]["build"]["dockerfile"]).read_text()
    declared = set(re.findall(r"^ARG (\w+)", dockerfile, re.M))
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M))
    built = {name: service["build"] for name, service in services.items() if "build" in service}
    assert set(built) == {"server", "learner"}
    for name, build in built.items():
        assert set(build["args"]) == declared, name
        assert build["target"] in stages, name
    assert services["actor"]["image"] == services["learner"]["image"] != services["server"]["image"]
    cuda_wheels = "https://download.pytorch.org/whl/cu126"
    args = built["learner"]["args"]
    assert _interpolate(args["TORCH_INDEX_URL"], {"TORCH_INDEX_URL": cuda_wheels}) == cuda_wheels
    assert _interpolate(args["TORCH_INDEX_URL"], {"TORCH_INDEX_URL": ""}) == ""  # none: torch from docker/wheels/
    assert _interpolate(args["TORCH_INDEX_URL"], {}) == "https://download.pytorch.org/whl/cpu"


def _local_command(command: str, env: dict[str, str]) -> list[str]:
    words = shlex.split(_interpolate(command, env))
    assert words[0] == "replayd"
    return [sys.executable, "-m", "replayd.server.cli", *words[1:]]


def test_compose_services_run_as_local_processes(tmp_path: Path) -> None:
    """The services' commands and environments as local processes: two server replicas (the server's command run
    by sh, as in its container, each with its own hostname, port and shared-memory instance), an actor and a
    learner that address both as shards."""
    services = _compose()["services"]
    assert set(services) == {"server", "actor", "learner"}
    assert services["server"]["shm_size"] and "/readyz" in " ".join(services["server"]["healthcheck"]["test"])
    ports = [free_port(), free_port()]
    env = {
        "REPLAYD_HOST": "127.0.0.1",
        "REPLAYD_HTTP_PORT": "0",
        "REPLAYD_ADDRESS": ",".join(f"127.0.0.1:{port}" for port in ports),
        "REPLAYD_SECONDS": "10",
        "REPLAYD_RUN_DIR": str(tmp_path / "run"),
        "REPLAYD_CHECKPOINT_DIR": str(tmp_path / "server"),
        "REPLAYD_EVAL_EVERY": "50",
    }
    process_env = {**os.environ, **{k: _interpolate(str(v), env) for k, v in
                                    (services["learner"].get("environment") or {}).items()}}
    bin_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # the replayd command
    processes = []
    try:
        for index, port in enumerate(ports):
            replica = {**env, "REPLAYD_PORT": str(port), "REPLAYD_INSTANCE": f"test{os.getpid()}compose{index}"}
            command = shlex.split(_interpolate(services["server"]["command"], replica))
            assert command[:2] == ["sh", "-c"]
            processes.append(subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PATH": bin_path,
                                                                      "HOSTNAME": f"replica{index}"}))
        for port in ports:
            with ReplayClient(f"127.0.0.1:{port}") as probe:
                probe.wait_ready(timeout=60)
        # The actor's own budget is far longer than the learner's: it stops because the learner finished.
        actor_command = _local_command(services["actor"]["command"], {**env, "REPLAYD_SECONDS": "600"})
        actor = subprocess.Popen(actor_command, cwd=ROOT, env=process_env, stdout=subprocess.PIPE, text=True)
        learner = subprocess.Popen(_local_command(services["learner"]["command"], env), cwd=ROOT, env=process_env,
                                   stdout=subprocess.PIPE, text=True)
        processes += [actor, learner]
        learner_out, _ = learner.communicate(timeout=180)
        actor_out, _ = actor.communicate(timeout=60)
        assert learner.returncode == 0 and actor.returncode == 0
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["env_steps"] > 0
        assert sorted(shard["address"] for shard in summary["buffer"]["shards"]) == sorted(
            env["REPLAYD_ADDRESS"].split(","))
        # One summary line at the end (the progress bar goes to stderr).
        assert re.fullmatch(rf"(solved in \d+ s|budget of 10 s spent): greedy return [\d.]+ \(best [\d.]+\), "
                            rf"{summary['env_steps']:,} env steps, {summary['learner_steps']:,} learner steps "
                            r"\(\d+/s\), replay ratio [\d.]+", learner_out.strip())
        version = int(re.search(r"weights version (\d+)", actor_out).group(1))
        for index, port in enumerate(ports):
            with ReplayClient(f"127.0.0.1:{port}") as client:
                stored = client.fetch_weights("q")
                manifest = client.checkpoint()  # into the replica's own folder of the --checkpoint-dir volume
            assert stored.final and version == stored.version  # the actor fetched the learner's final weights
            assert Path(manifest).is_relative_to(tmp_path / "server" / f"replica{index}")
            assert has_checkpoint(tmp_path / "server" / f"replica{index}")
        assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "learning_curve.png").exists()
    finally:
        for process in processes:
            process.terminate()
        deadline = time.monotonic() + 30
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))


def _crashing_actor(config: object, stop: object) -> None:
    raise RuntimeError("the actor crashed")


def test_actor_processes_return_soon_when_actors_die_without_reporting() -> None:
    before = set(multiprocessing.active_children())
    with actor_processes(_crashing_actor, [None, None]) as actors:
        # Each child imports this module (torch included) before it crashes, which can take the whole 20 s on
        # a loaded machine: the clock starts once both died, so it times the wait for their reports alone.
        wait_until(lambda: not set(multiprocessing.active_children()) - before, time.monotonic() + 120,
                   "the actors crashing")
        started = time.monotonic()
    assert actors.reports == [None, None]
    assert actors.failed() == ["actor 0 (exit code 1)", "actor 1 (exit code 1)"]
    assert time.monotonic() - started < 20  # not the 30 s wait for reports that never come


def _second_actor_crashing(config: object, stop: object) -> object:
    if config.seed == 1000:  # actor 1 (the demo seeds actor i with 1000 i)
        raise RuntimeError("actor 1 crashed")
    return ALGOS["dqn"].actor(config, stop)


def test_a_demo_whose_actor_fails_says_so_and_exits_non_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo ends naming the failed actor and exits non-zero, rather than go on with the other actor and
    exit 0 with the failed actor's report None in its summary."""
    monkeypatch.setitem(ALGOS, "dqn", dataclasses.replace(ALGOS["dqn"], actor=_second_actor_crashing))
    with pytest.raises(SystemExit, match=r"demo: actor 1 \(exit code 1\) failed \(see above\)"):
        _demo(tmp_path, "dqn", "--seconds", "60", "--eval-every", "50")


@pytest.mark.parametrize("algo", ["dqn", "ppo"])
def test_a_demo_whose_actors_all_fail_before_any_data_ends_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    algo: str) -> None:
    """The learner waited STARTUP_SECONDS (120 s) for data no actor would send before the demo said why. With
    that wait made longer than the test's timeout, only a learner that reports while it waits lets the demo
    end the run as its actors die."""
    monkeypatch.setitem(ALGOS, algo, dataclasses.replace(ALGOS[algo], actor=_crashing_actor))
    monkeypatch.setattr(learner_common, "STARTUP_SECONDS", 3600.0)
    monkeypatch.setattr(ppo_learner, "STARTUP_SECONDS", 3600.0)
    with pytest.raises(SystemExit, match=r"demo: actor [01] \(exit code 1\)") as ended:
        _demo(tmp_path, algo, "--seconds", "60")
    assert isinstance(ended.value.__cause__, ActorFailed)  # the learner's wait ended on the actors' failure


def test_greedy_evaluation_runs_the_policy_on_its_device() -> None:
    seen = []

    def act(obs: torch.Tensor) -> torch.Tensor:
        seen.append(obs.device)
        return torch.zeros(len(obs), dtype=torch.int64)

    evaluate_greedy(act, "CartPole-v1", 2, 0, device="meta")  # "meta" stands for a GPU here
    assert seen and set(seen) == {torch.device("meta")}


@pytest.mark.parametrize(("command", "argv", "refused"), [
    (demo_main, ["--algo", "ppo", "--local"], "--local"),
    (demo_main, ["--algo", "allo", "--envs", "3", "--compile-loss"], "--envs, --compile-loss"),
    (demo_main, ["--algo", "drqn", "--local"], "--local"),
    (learner_main, ["--algo", "her", "--address", "127.0.0.1:1", "--compile-loss"], "--compile-loss"),
    (learner_main, ["--algo", "ppo", "--address", "127.0.0.1:1", "--learning-starts", "5"], "--learning-starts"),
    (actor_main, ["--algo", "dqn", "--address", "127.0.0.1:1", "--envs", "2"], "--envs"),
])
def test_command_lines_refuse_options_the_algorithm_does_not_take(command, argv, refused, capsys) -> None:
    """An option the chosen algorithm has no use for is a usage error, not silently dropped."""
    with pytest.raises(SystemExit) as exited:
        command(argv)
    assert exited.value.code == 2
    assert f"--algo {argv[1]} does not take {refused}" in capsys.readouterr().err



@pytest.mark.parametrize(("command", "argv", "message"), [
    (demo_main, ["--seconds", "nan"], "argument --seconds: expected a number of seconds > 0, got nan"),  # forever
    (demo_main, ["--seconds", "-5"], "argument --seconds: expected a number of seconds > 0, got -5"),  # at once
    (actor_main, ["--address", "127.0.0.1:1", "--seconds", "inf"], "expected a number of seconds > 0, got inf"),
    (learner_main, ["--address", "127.0.0.1:1", "--seconds", "0"], "expected a number of seconds > 0, got 0"),
    (demo_main, ["--eval-every", "-5"], "argument --eval-every: expected an integer >= 1, got -5"),  # acted as 5
    (learner_main, ["--address", "127.0.0.1:1", "--eval-every", "0"],
     "argument --eval-every: expected an integer >= 1, got 0"),  # a ZeroDivisionError
    (learner_main, ["--address", "127.0.0.1:1", "--eval-every", "1.5"], "argument --eval-every: invalid int value"),
    (learner_main, ["--address", "127.0.0.1:1", "--learning-starts", "-1"],
     "argument --learning-starts: expected an integer >= 0, got -1"),  # acted as 0
    (learner_main, ["--algo", "ppo", "--address", "127.0.0.1:1", "--actors", "0"],
     "argument --actors: expected an integer >= 1, got 0"),
    (demo_main, ["--actors", "-1"], "argument --actors: expected an integer >= 1, got -1"),  # ran no actors
    (actor_main, ["--algo", "ppo", "--address", "127.0.0.1:1", "--actor-index", "-1"],
     "argument --actor-index: expected an integer >= 0, got -1"),
    (actor_main, ["--algo", "ppo", "--address", "127.0.0.1:1", "--envs", "0"],
     "argument --envs: expected an integer >= 1, got 0"),
    (demo_main, ["--algo", "ppo", "--rollout-steps", "-2"],
     "argument --rollout-steps: expected an integer >= 1, got -2"),
    (actor_main, ["--algo", "allo", "--address", "127.0.0.1:1", "--episodes", "-5"],
     "argument --episodes: expected an integer >= 1, got -5"),  # ended at once
])
def test_command_lines_refuse_bad_numbers(command, argv, message, capsys, monkeypatch) -> None:
    """Usage errors at parse time, before a server, buffer or actor is started."""
    def started(*args: object, **kwargs: object) -> None:
        pytest.fail(f"{argv} were accepted: the command started")

    monkeypatch.setattr("replayd.client.demo.local_server", started)
    for name, algo in ALGOS.items():
        monkeypatch.setitem(ALGOS, name, dataclasses.replace(algo, actor=started, learn=started))
    with pytest.raises(SystemExit) as exited:
        command(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("command", "argv"), [
    (demo_main, ["--algo", "dqn", "--device", "cuda", "--compile-loss"]),
    (learner_main, ["--algo", "dqn", "--address", "127.0.0.1:1", "--device", "cuda:0", "--compile-loss"]),
])
def test_compile_loss_off_the_cpu_is_a_usage_error_before_anything_starts(command, argv, capsys) -> None:
    """Refused at parse time: the demo would otherwise start a server and actors first (it picks cuda when
    there is one), and the learner would create its buffer."""
    with pytest.raises(SystemExit) as exited:
        command(argv)
    assert exited.value.code == 2
    assert "--compile-loss runs on the CPU only" in capsys.readouterr().err


@pytest.mark.parametrize("local", [False, True])
def test_a_failed_compile_closes_the_learners_stream_and_reader(server, tmp_path: Path, monkeypatch, local) -> None:
    """compile_for raising (no C++ compiler, say) runs the learner's cleanup: no loader thread, gRPC stream
    or shared-memory reader stays open."""
    def insert_instead_of_waiting(client: ReplayClient, buffer: str, steps: int, tracker: object) -> None:
        client.insert_episode(buffer, True, obs=np.zeros((51, 4), np.float32), action=np.zeros(50, np.int64),
                              reward=np.ones(50, np.float32))

    def no_compiler(trainer: DQNTrainer, batch: dict) -> None:
        raise RuntimeError("no C++ compiler")

    closed_readers = []
    close_reader = LocalReader.close
    monkeypatch.setattr(dqn_learner, "wait_for_steps", insert_instead_of_waiting)
    monkeypatch.setattr(DQNTrainer, "compile_for", no_compiler)
    monkeypatch.setattr(LocalReader, "close", lambda reader: (closed_readers.append(reader), close_reader(reader)))
    config = dqn_learner.DQNLearnerConfig(address=server.address, run_dir=str(tmp_path), compile_loss=True,
                                          local=local, seconds=30)
    with pytest.raises(RuntimeError, match="no C"):
        dqn_learner.learn_dqn(config)
    wait_until(lambda: not any(t.name == "replayd-loader" for t in threading.enumerate()), time.monotonic() + 10,
               "the loader thread ending")
    assert len(closed_readers) == (1 if local else 0)


@pytest.mark.parametrize("command", ["actor", "learn"])
def test_usage_lines_name_the_replayd_subcommand(command, capsys) -> None:
    with pytest.raises(SystemExit):
        cli_main([command, "--algo", "ppo", "--local", "--address", "127.0.0.1:1"])
    assert f"usage: replayd {command} [-h]" in capsys.readouterr().err
