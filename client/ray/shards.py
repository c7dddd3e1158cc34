"""Replay shards as Ray actors: one `replayd serve` per shard, placed on the cluster's nodes by a placement group.

    shards = start_shards(3, [BufferSpec("cartpole", 300_000, schema)], checkpoint_dir="/mnt/shared/replayd",
                          checkpoint_every=60, shm_bytes=2 * 2**30)
    client = shards.client()                  # a ShardedReplayClient that follows the shards wherever Ray puts them

Ray does the placing and the restarting; this module only tells each life of a shard how to start:

* Placement: one bundle per shard (its CPUs, and `shm_bytes` of the node resource `shm` that each node declares for
  its /dev/shm), spread over the nodes (`SPREAD`, or `STRICT_SPREAD`: never two shards on one node). Each shard actor
  runs in its bundle; when a node dies, Ray places its bundle on another node and restarts the actor there
  (`max_restarts`).
* Shared memory: a shard's instance name (which names its segments, rpd_<instance>_<buffer>) is the group's name,
  the shard's index and its node's id: `<name>s<k>n<node>`. A life that starts on the node of the previous one finds
  that instance's segments there and reattaches them (`replayd serve --recover`); one placed on another node finds
  none and restores the shard's latest checkpoint (`--restore`), from `checkpoint_dir/<name>/shard-<k>` on storage
  every node reaches. Buffers of `buffers` that neither brings back are created empty, with the shard's share of
  their capacity, so a shard always rejoins with every buffer.
* A server that exits ends its actor's process, so that Ray restarts the shard; the server dies with its actor
  (PR_SET_PDEATHSIG), so a killed actor never leaves a server holding its instance.
* Addresses: every life tells where its server listens (`address()`); clients ask the actors again when a shard
  fails and every second (client/ray/resolver.py), so a shard that moved rejoins the same client.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from replayd.client.ray import STRATEGIES
from replayd.client.ray.resolver import NAMESPACE, ShardAddresses, actor_name, connect_ray, lookup
from replayd.client.replay_client import ReplayClient, Schema
from replayd.client.shard_math import MAX_SHARDS, split_capacity, split_rate_limiter
from replayd.client.sharded import RAY_PREFIX, RAY_RESOLVE_EVERY, ShardedReplayClient
from replayd.server.checkpoint import has_checkpoint
from replayd.server.storage.instance_lock import InstanceLock
from replayd.server.storage.shared_arrays import SHM_DIR, remove_segment, segments
from replayd.wire.components import (
    Fifo,
    MinSize,
    RateLimiterOptions,
    RemoverOptions,
    SamplerOptions,
    Uniform,
)
from replayd.wire.errors import FailedPrecondition

log = logging.getLogger("replayd.ray")

SHM_RESOURCE = "shm"  # the node resource, in bytes, that stands for a node's /dev/shm
_GROUP_NAME = re.compile(r"[A-Za-z0-9]{1,16}")  # with "s<k>n<8 hex digits>", within an instance name's 32 characters
_LISTENING = re.compile(r"listening on (\S+?)(?: \(TLS\))?(?:, HTTPS? on port (\d+))?, (?:token required|no token)$")
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)  # loaded here: a forked child only calls it


@dataclass(frozen=True)
class BufferSpec:
    """A buffer every shard holds: ShardedReplayClient.create_buffer's arguments (`capacity_steps` over all shards,
    split between them, and the rate limiter's sizes too)."""

    name: str
    capacity_steps: int
    schema: Schema
    observation_fields: tuple[str, ...] = ("obs",)
    reward_field: str | None = None
    sampler: SamplerOptions = Uniform()
    remover: RemoverOptions = Fifo()
    rate_limiter: RateLimiterOptions = MinSize()
    goal_fields: tuple[str, str] | None = None


@dataclass(frozen=True)
class ShardSpec:
    """What every life of one shard actor starts from (its constructor's argument, kept by Ray across restarts)."""

    group: str
    index: int
    num_shards: int
    buffers: tuple[BufferSpec, ...] = ()
    host: str | None = None  # None: the node's IP address
    port: int = 0
    http_port: int = 0
    checkpoint_dir: str | None = None  # the group's; the shard's own is checkpoint_dir/<group>/shard-<index>
    checkpoint_every: float | None = None
    checkpoint_keep: int = 3
    token: str | None = field(default=None, repr=False)
    insecure_bind_all: bool = False
    serve_args: tuple[str, ...] = ()
    start_timeout: float = 120.0

    def shard_checkpoint_dir(self) -> str | None:
        if self.checkpoint_dir is None:
            return None
        return str(Path(self.checkpoint_dir) / self.group / f"shard-{self.index}")


def instance_name(group: str, index: int, node_id: str) -> str:
    """The instance (shared-memory names) of shard `index` of `group` on the node `node_id`."""
    return f"{group}s{index}n{node_id[:8]}"


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL when the actor's process dies, however it dies."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ShardServer:
    """One shard: a Ray actor whose process runs `replayd serve` on its node for as long as it lives (see the module's
    docstring for how each life starts)."""

    def __init__(self, spec: ShardSpec) -> None:
        context = ray.get_runtime_context()
        self.spec = spec
        self.node_id = context.get_node_id()
        self.restarted = context.was_current_actor_reconstructed
        self.instance = instance_name(spec.group, spec.index, self.node_id)
        self.checkpoint_dir = spec.shard_checkpoint_dir()
        self._stopping = threading.Event()
        self._serving = threading.Event()
        host = spec.host or ray.util.get_node_ip_address()
        # The previous life on this node may still be going down (its server dies with its process).
        InstanceLock(self.instance, wait_seconds=30).release()
        command = [sys.executable, "-m", "replayd.server.cli", "serve", "--host", host, "--port", str(spec.port),
                   "--http-port", str(spec.http_port), "--instance", self.instance]
        if segments(f"rpd_{self.instance}_"):
            self.started_from = "recovered"
            command.append("--recover")
        elif self.checkpoint_dir is not None and has_checkpoint(self.checkpoint_dir):
            self.started_from = "restored"
            command += ["--restore", self.checkpoint_dir]
        else:
            self.started_from = "empty"
        if self.checkpoint_dir is not None:
            Path(self.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            command += ["--checkpoint-dir", self.checkpoint_dir, "--checkpoint-keep", str(spec.checkpoint_keep)]
            if spec.checkpoint_every is not None:
                command += ["--checkpoint-every", str(spec.checkpoint_every)]
        if spec.insecure_bind_all:
            command.append("--insecure-bind-all")
        command += list(spec.serve_args)
        env = dict(os.environ)
        if spec.token:
            env["REPLAYD_TOKEN"] = spec.token  # not on the command line, where every user of the node can read it
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         env=env, preexec_fn=_die_with_parent)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._forward_output, name="replayd-shard-output", daemon=True).start()
        try:
            self._address, self.http_port = self._wait_listening(time.monotonic() + spec.start_timeout)
            self._serving.set()
            self._create_missing_buffers()
            self._remove_stale_lives()
        except BaseException:  # the actor dies with this error: its server goes first, unlinking its shared memory
            self._stop_server(timeout=60)
            raise
        print(f"shard {spec.index} of {spec.group!r} ({self.started_from}, instance {self.instance}) serves on "
              f"{self._address}", flush=True)

    # ------------------------------------------------------------------ the server's process
    def _forward_output(self) -> None:
        """Copies the server's output into the actor's (Ray's logs); when the server exits unasked after it served,
        ends this process so that Ray restarts the shard."""
        for line in self._process.stdout:
            print(line, end="", flush=True)
            if not self._serving.is_set():
                self._lines.put(line.rstrip("\n"))
        code = self._process.wait()
        self._lines.put(None)
        if self._serving.is_set() and not self._stopping.is_set():
            print(f"replayd server of shard {self.spec.index} exited (code {code}): the shard's actor exits, so that "
                  "Ray restarts it", flush=True)
            os._exit(1)

    def _wait_listening(self, deadline: float) -> tuple[str, int | None]:
        """The server's address and HTTP port, from its "listening on" line; RuntimeError with its output when it
        exits first or does not serve in time."""
        output: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise RuntimeError(f"replayd server of shard {self.spec.index} did not serve within "
                                   f"{self.spec.start_timeout:g} s: {' | '.join(output[-20:])}") from None
            if line is None:
                raise RuntimeError(f"replayd server of shard {self.spec.index} exited with code "
                                   f"{self._process.returncode} before serving: {' | '.join(output[-20:])}")
            output.append(line)
            found = _LISTENING.search(line)
            if found is not None:
                return found[1], None if found[2] is None else int(found[2])

    def _create_missing_buffers(self) -> None:
        """Creates each buffer of the spec that the server does not hold (a first start, or a shard that came back
        with nothing to recover or restore), with this shard's share of its capacity and rate limiter."""
        spec = self.spec
        with ReplayClient(self._address, timeout=30, token=spec.token) as client:
            held = {info["name"] for info in client.list_buffers()}
            for buffer in spec.buffers:
                if buffer.name in held:
                    continue
                client.create_buffer(buffer.name, split_capacity(buffer.capacity_steps, spec.num_shards)[spec.index],
                                     buffer.schema, buffer.observation_fields, buffer.reward_field, buffer.sampler,
                                     buffer.remover, split_rate_limiter(buffer.rate_limiter, spec.num_shards),
                                     buffer.goal_fields)

    def _remove_stale_lives(self) -> list[str]:
        """Removes what earlier lives of this shard on other nodes of this host left in its /dev/shm (nodes that
        share a host; a node that died and whose shard restored elsewhere). Instances still served are kept."""
        own = re.compile(rf"{re.escape(self.spec.group)}s{self.spec.index}n[0-9a-f]{{8}}")
        names = {name.split("_")[1] for name in segments(f"rpd_{self.spec.group}s{self.spec.index}n")}
        names |= {name[len("replayd-"):-len(".lock")] for name in os.listdir(SHM_DIR)
                  if name.startswith("replayd-") and name.endswith(".lock")}
        removed = []
        for instance in sorted(name for name in names if own.fullmatch(name) and name != self.instance):
            try:
                lock = InstanceLock(instance, wait_seconds=0)
            except FailedPrecondition:  # served by a live server (its node shares this host)
                continue
            for name in segments(f"rpd_{instance}_"):
                remove_segment(name)
            lock.release()  # unlinks its lock file
            removed.append(instance)
        if removed:
            print(f"shard {self.spec.index}: removed the shared memory of earlier lives on other nodes: {removed}",
                  flush=True)
        return removed

    # ------------------------------------------------------------------ what drivers and clients ask
    def address(self) -> str:
        return self._address

    def num_shards(self) -> int:
        return self.spec.num_shards

    def info(self) -> dict[str, Any]:
        return {"index": self.spec.index, "address": self._address, "http_port": self.http_port,
                "node_id": self.node_id, "instance": self.instance, "started_from": self.started_from,
                "restarted": self.restarted, "server_pid": self._process.pid, "checkpoint_dir": self.checkpoint_dir}

    def placement_group(self) -> PlacementGroup | None:
        return ray.util.get_current_placement_group()

    def stop(self, timeout: float = 60.0) -> int:
        """Stops the server (SIGTERM: it unlinks its shared memory) and removes what earlier lives left on this host;
        the server's exit code."""
        code = self._stop_server(timeout)
        self._remove_stale_lives()
        return code

    def _stop_server(self, timeout: float) -> int:
        self._stopping.set()
        self._process.terminate()
        try:
            return self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # a server that hangs: its shared memory stays for the next --recover
            self._process.kill()
            return self._process.wait()


ShardActor = ray.remote(ShardServer)


class RayShards:
    """The shard actors of one group: where they listen, a client that follows them, and stopping them. Picklable:
    Ray tasks and actors can be handed it."""

    def __init__(self, name: str, handles: list[ActorHandle], token: str | None = None,
                 group: PlacementGroup | None = None) -> None:
        self.name, self.handles, self.token, self._group = name, handles, token, group
        self.stopped = False

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "handles": self.handles, "token": self.token, "group": self._group}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return f"RayShards({self.name!r}, {len(self.handles)} shards)"

    @property
    def address(self) -> str:
        """The address command lines take for these shards (`replayd learn --address ray:NAME`)."""
        return RAY_PREFIX + self.name

    def info(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Each shard's address, node, instance, how its life started and whether Ray restarted it."""
        return ray.get([handle.info.remote() for handle in self.handles], timeout=timeout)

    def addresses(self, timeout: float = 60.0) -> list[str]:
        """Where the shards listen now (waiting for shards that Ray is restarting)."""
        return ray.get([handle.address.remote() for handle in self.handles], timeout=timeout)

    def resolver(self, timeout: float = 60.0) -> ShardAddresses:
        """For ShardedReplayClient(target=...): the shards' addresses, asked again at each call without waiting."""
        return ShardAddresses(self.name, self.handles, self.addresses(timeout))

    def client(self, **options: Any) -> ShardedReplayClient:
        """A ShardedReplayClient over these shards that asks them where they are every second and after a failure.
        `options`: ShardedReplayClient's (timeout, retries, ...)."""
        options.setdefault("resolve_every", RAY_RESOLVE_EVERY)
        options.setdefault("token", self.token)
        return ShardedReplayClient(self.resolver(), **options)

    def stop(self, timeout: float = 60.0) -> None:
        """Stops every shard's server (its shared memory unlinked), ends the actors and removes the placement group."""
        self.stopped = True
        group = self._group
        if group is None:
            group = next((found for found in self._ask_each("placement_group", timeout) if found is not None), None)
        self._ask_each("stop", timeout)
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        if group is not None:
            remove_placement_group(group)

    def _stop_at_exit(self) -> None:
        """At the exit of the driver that started them (not detached): Ray would end the actors, and their servers
        with SIGKILL, leaving their shared memory behind."""
        if not self.stopped and ray.is_initialized():
            self.stop(timeout=30)

    def _ask_each(self, method: str, timeout: float) -> list[Any]:
        """Each shard's answer to `method` (None from a shard that is gone)."""
        refs = [getattr(handle, method).remote() for handle in self.handles]
        answers = []
        for index, ref in enumerate(refs):
            try:
                answers.append(ray.get(ref, timeout=timeout))
            except (RayError, GetTimeoutError) as exc:
                log.warning("shard %d of %r did not answer %s(): %s", index, self.name, method, exc)
                answers.append(None)
        return answers


def find_shards(name: str = "replayd") -> RayShards:
    """The shards a driver started under `name` (on this Ray cluster, from any driver)."""
    return RayShards(name, lookup(name), os.environ.get("REPLAYD_TOKEN") or None)


def stop_shards(name: str = "replayd", timeout: float = 60.0) -> None:
    find_shards(name).stop(timeout)


def _check_options(num_shards: int, name: str, strategy: str, port: int, shm_bytes: int | None,
                   checkpoint_dir: str | None, checkpoint_every: float | None) -> None:
    if not 1 <= num_shards <= MAX_SHARDS:
        raise ValueError(f"num_shards: expected 1..{MAX_SHARDS}, got {num_shards}")
    if not _GROUP_NAME.fullmatch(name):
        raise ValueError(f"name: expected 1 to 16 letters and digits (it names the shards' shared memory), "
                         f"got {name!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    if port and strategy != "STRICT_SPREAD":
        raise ValueError(f"port {port}: a fixed port needs strategy='STRICT_SPREAD' (two shards on one node would "
                         "both take it); port=0 takes a free one")
    if shm_bytes is not None and not shm_bytes > 0:
        raise ValueError(f"shm_bytes: expected bytes > 0, got {shm_bytes!r}")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ValueError("checkpoint_every needs a checkpoint_dir")
    if checkpoint_dir is not None and not Path(checkpoint_dir).is_absolute():
        raise ValueError(f"checkpoint_dir: expected an absolute path that every node reaches, got {checkpoint_dir!r}")


def _exists(name: str) -> bool:
    try:
        ray.get_actor(actor_name(name, 0), namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def start_shards(num_shards: int, buffers: Sequence[BufferSpec] = (), *, name: str = "replayd",
                 strategy: str = "SPREAD", cpus_per_shard: float = 1.0, shm_bytes: int | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: float | None = None, checkpoint_keep: int = 3,
                 detached: bool = False, max_restarts: int = -1, port: int = 0, http_port: int = 0,
                 host: str | None = None, token: str | None = None, insecure_bind_all: bool = False,
                 serve_args: Sequence[str] = (), timeout: float = 120.0) -> RayShards:
    """Starts `num_shards` replay servers as Ray actors on the cluster this driver is connected to (`ray.init()`;
    without one, the local cluster `ray start` runs), one per bundle of a placement group of `strategy`, and creates
    `buffers` on them. Returns their handle once every server serves.

    `shm_bytes`: /dev/shm each shard reserves, as the node resource `shm` (declare it per node:
    `ray start --resources='{"shm": 8589934592}'`); None reserves none. `checkpoint_dir`: storage every node reaches
    (each shard writes under `<dir>/<name>/shard-<k>`), `checkpoint_every` seconds between periodic checkpoints:
    what a shard restarted on another node comes back with. `detached`: the actors and their placement group outlive
    this driver (stop them with `stop_shards(name)` or `replayd ray down`). `max_restarts`: Ray's restarts of each
    shard (-1: always). `port`/`http_port`: 0 takes free ones (a fixed gRPC port needs STRICT_SPREAD); `http_port`
    -1 serves no status page. `host`: the bind address (default: the node's IP address); an address other than
    loopback needs `token` (default $REPLAYD_TOKEN) or `insecure_bind_all`. `serve_args`: more `replayd serve`
    options (e.g. "--max-buffer-gb", "4")."""
    _check_options(num_shards, name, strategy, port, shm_bytes, checkpoint_dir, checkpoint_every)
    token = token if token is not None else os.environ.get("REPLAYD_TOKEN") or None
    connect_ray()
    if _exists(name):
        raise ValueError(f"replayd shards named {name!r} already run on this cluster: connect with "
                         f"replayd.ray.find_shards({name!r}) or stop them first (stop_shards, `replayd ray down`)")
    resources = {SHM_RESOURCE: float(shm_bytes)} if shm_bytes is not None else {}
    bundle = {"CPU": cpus_per_shard, **resources}
    lifetime = "detached" if detached else None
    group = placement_group([bundle] * num_shards, strategy=strategy, name=f"replayd-{name}", lifetime=lifetime)
    try:
        ray.get(group.ready(), timeout=timeout)
    except GetTimeoutError:
        remove_placement_group(group)
        raise TimeoutError(f"Ray could not place {num_shards} shard(s) of {bundle} each ({strategy}) within "
                           f"{timeout:g} s; the cluster has {ray.available_resources()} available") from None
    spec = ShardSpec(name, 0, num_shards, tuple(buffers), host, port, http_port, checkpoint_dir, checkpoint_every,
                     checkpoint_keep, token, insecure_bind_all, tuple(serve_args), timeout)
    handles = []
    for index in range(num_shards):
        handles.append(ShardActor.options(
            name=actor_name(name, index), namespace=NAMESPACE, lifetime=lifetime, max_restarts=max_restarts,
            max_task_retries=-1, num_cpus=cpus_per_shard, resources=resources,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote(replace(spec, index=index)))
    started = RayShards(name, handles, token, group)
    try:
        started.info(timeout)
    except BaseException:
        started.stop(timeout=30)
        raise
    if not detached:
        atexit.register(started._stop_at_exit)
    return started

