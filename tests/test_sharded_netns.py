"""ShardedReplayClient across real host addresses: K = 3 servers, each in a network namespace of its own joined to
this host by a veth pair, reached by one name that resolves to all three.

The checks of tests/shard_cluster.py (global uniform and prioritized draws, priority routing, a shard SIGKILLed and
restarted with --recover while a writer inserts and a learner samples) run in a child process inside a private
mount namespace (`unshare --mount`) whose /etc/hosts is a file of the test's listing the name three times: the
client resolves it through getaddrinfo as it would a compose service's or a headless Service's records, and no
other process sees the name. The test creates and removes the namespaces, links and processes itself, and is
skipped, naming why, where it cannot create namespaces.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from replayd.server.storage.shared_arrays import segments
from tests.conftest import TEST_INSTANCE

ROOT = Path(__file__).resolve().parents[1]
SHARDS = 3
PORT = 50051  # each namespace has ports of its own


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def why_no_namespaces() -> str | None:
    """Why this host cannot give the test network namespaces (None: it can)."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"missing tools: {missing}"
    probe = f"rpd{os.getpid()}probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "del", probe)
    return None


def free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.0.0/16 no address or route of this host uses (the shards take 10.x.k.0/24)."""
    used = ip("-o", "-4", "addr").stdout + ip("-4", "route").stdout
    for x in [100 + (os.getpid() + k) % 150 for k in range(150)]:
        if f"10.{x}." not in used:
            return ipaddress.ip_network(f"10.{x}.0.0/16")
    raise RuntimeError("no free 10.x.0.0/16 on this host")


@pytest.fixture
def namespaces() -> Iterator[list[tuple[str, str]]]:
    """(namespace, address) of each shard: a namespace with a veth pair to this host, host side 10.x.k.1/24 and the
    namespace's side 10.x.k.2/24. Removed at the end with every process left in them."""
    reason = why_no_namespaces()
    if reason is not None:
        pytest.skip(f"network namespaces are not available here: {reason}")
    subnet, tag = free_subnet(), os.getpid() % 100_000
    made: list[tuple[str, str]] = []
    try:
        for k in range(SHARDS):
            name, host_side, inside = f"rpd{tag}ns{k}", f"rpd{tag}h{k}", f"rpd{tag}n{k}"
            prefix = f"{subnet.network_address.packed[0]}.{subnet.network_address.packed[1]}.{k}"
            ip("netns", "add", name)
            made.append((name, f"{prefix}.2"))
            ip("link", "add", host_side, "type", "veth", "peer", "name", inside)
            ip("link", "set", inside, "netns", name)
            ip("addr", "add", f"{prefix}.1/24", "dev", host_side)
            ip("link", "set", host_side, "up")
            ip("netns", "exec", name, "ip", "addr", "add", f"{prefix}.2/24", "dev", inside)
            ip("netns", "exec", name, "ip", "link", "set", inside, "up")
            ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield made
    finally:
        for name, _ in made:
            for pid in ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for k, (name, _) in enumerate(made):
            ip("link", "del", f"rpd{tag}h{k}", check=False)  # deletes the pair
            ip("netns", "del", name, check=False)


def test_shards_in_their_own_network_namespaces_reached_by_one_name(namespaces: list[tuple[str, str]],
                                                                    tmp_path: Path) -> None:
    name = f"replayd-shards-{os.getpid()}"
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n::1 localhost\n"
                     + "".join(f"{address} {name}\n" for _, address in namespaces))
    instances = [f"{TEST_INSTANCE}ns{k}" for k in range(SHARDS)]
    command = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
               sys.executable, "-m", "tests.shard_cluster", "--name", f"{name}:{PORT}",
               "--hosts", ",".join(address for _, address in namespaces),
               "--netns", ",".join(netns for netns, _ in namespaces), "--instances", ",".join(instances),
               "--token", secrets.token_hex(16)]
    try:
        child = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=500)
    finally:
        for instance in instances:
            for segment in segments(f"rpd_{instance}_"):
                os.unlink(f"/dev/shm/{segment}")
            Path(f"/dev/shm/replayd-{instance}.lock").unlink(missing_ok=True)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-8000:]
    assert "every check passed" in child.stdout
