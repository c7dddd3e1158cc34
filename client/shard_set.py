"""The servers (shards) of a ShardedReplayClient: from a list of addresses, from one DNS name whose A/AAAA
records are the shards (a compose service scaled to K replicas, a Kubernetes headless Service), or from a function
that lists them (the Ray launcher's, client/ray/resolver.py), the last two asked again at an interval and when a
shard fails. Each shard has its own ReplayClient; a shard that fails is down until its
channel connects again (gRPC's reconnects, 0.1-1 s apart), and both events are logged and counted."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from replayd.client.replay_client import ReplayClient
from replayd.client.shard_math import MAX_SHARDS

log = logging.getLogger("replayd.client")

# After a shard fails, the name is resolved again (its replacement may listen elsewhere), at most this often.
_RESOLVE_AFTER_FAILURE = 1.0
# A shard found down stays down at least this long. A call can fail on a broken connection (a server killed) while
# the channel still reads READY, before gRPC has noticed: a comeback that soon is looked at again once this passes.
_HOLD_DOWN = 1.0


def split_host_port(target: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6 address]:port"."""
    host, colon, port = target.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(f"address: expected host:port, got {target!r}")
    return host.strip("[]"), int(port)


def resolve(target: str) -> list[str]:
    """Every address "ip:port" ("[ip]:port" for IPv6) that the name of `target` ("name:port") resolves to: its
    A and AAAA records (or hosts-file entries), sorted."""
    host, port = split_host_port(target)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = set()
    for family, _, _, _, sockaddr in infos:
        ip = str(ipaddress.ip_address(sockaddr[0]))
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)


class ShardError(grpc.RpcError):
    """A call over the shards that failed as a whole (no shard up, none holding the data in time): a gRPC error
    with a code (UNAVAILABLE, DEADLINE_EXCEEDED), so callers treat it as one server's error of that code."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Shard:
    """One server: its address, its ReplayClient, its index (the bits its keys carry) and whether it is up."""

    def __init__(self, index: int, address: str, client: ReplayClient) -> None:
        self.index = index
        self.address = address
        self.client = client
        self.up = True
        self.life = 0  # grows each time the shard comes back: what a failed call of an earlier life reports is old
        self._back: grpc.Future | None = None  # while down: resolves when the channel connects again
        self._down_since = 0.0  # time.monotonic() when it was last found down
        self._look_again: threading.Timer | None = None  # while down: a comeback seen too soon, looked at again

    def __repr__(self) -> str:
        return f"shard {self.index} ({self.address})"


# What lists the shards now, each call: their addresses ("host:port"), or a mapping from a name of each shard to its
# address, for shards that keep who they are when they move (a shard restarted at another address is the same
# shard: its index, its keys and the spans held for it stay its own). It raises OSError when it cannot tell now.
Resolver = Callable[[], Sequence[str] | Mapping[str, str]]


class ShardSet:
    """The current shards. `target`: one "name:port" (resolved to every record), or a resolver (see Resolver):
    either is asked again every `resolve_every` seconds and after a failure; or a sequence of addresses (fixed).
    `connect(address)` makes a shard's client.

    `generation` grows at every change (a shard failing, coming back, joining or leaving), so that what callers
    derive from the shards (which hold a buffer, their sizes) is derived again."""

    def __init__(self, target: str | Resolver | Sequence[str], connect: Callable[[str], ReplayClient],
                 resolve_every: float, registry: CollectorRegistry) -> None:
        if not resolve_every > 0:
            raise ValueError(f"resolve_every: expected seconds > 0, got {resolve_every!r}")
        self._name = target if isinstance(target, str) or callable(target) else None  # asked again; None: fixed
        self._connect = connect
        self._resolve_every = resolve_every
        self._lock = threading.Lock()
        self._known: dict[str, Shard] = {}  # every shard ever listed, by name: one listed again keeps its index
        self._retired: list[ReplayClient] = []  # the clients of addresses that shards moved away from
        self._members: list[Shard] = []
        self._closed = False  # calls failing on closed channels say nothing about the shards
        self.generation = 0
        self._failures = Counter("replayd_client_shard_failures", "Shards found down by a call (log line each)",
                                 ["shard"], registry=registry)
        self._rejoins = Counter("replayd_client_shard_rejoins", "Shards that answered again after failing",
                                ["shard"], registry=registry)
        self._up = Gauge("replayd_client_shard_up", "1 while a shard is up, 0 while down", ["shard"],
                         registry=registry)
        listed = self._lookup() if self._name is not None else named(target)
        if not listed or len(set(listed.values())) != len(listed):
            raise ValueError(f"shards: expected distinct addresses, got {list(listed.values())!r} for {target!r}")
        self._set_members(listed)
        self._resolved_at = time.monotonic()

    def _set_members(self, listed: Mapping[str, str]) -> list[Shard]:
        """Makes the shards `listed` (name -> address) the members; returns those that moved to another address
        (down until their new address answers: the caller watches for that once it holds no lock)."""
        members, moved = [], []
        for name, address in listed.items():
            shard = self._known.get(name)
            if shard is None:
                if len(self._known) == MAX_SHARDS:
                    raise ValueError(f"shards: a client tags keys with at most {MAX_SHARDS} shards, got one more: "
                                     f"{address}")
                split_host_port(address)
                shard = self._known[name] = Shard(len(self._known), address, self._connect(address))
                self._up.labels(address).set(1)
            elif shard.address != address:
                split_host_port(address)
                self._retired.append(shard.client)  # closed with this set: calls of the old address may still run
                if shard._back is not None:
                    shard._back.cancel()
                shard.address, shard.client, shard.up = address, self._connect(address), False
                shard._back = shard.client.ready_future()
                moved.append(shard)
            members.append(shard)
        self._members = members
        self.generation += 1
        return moved

    def _watch_moved(self, moved: list[Shard]) -> None:
        for shard in moved:
            log.warning("%s moved: it rejoins the shards once it answers at its new address", shard)
            self._up.labels(shard.address).set(0)
            shard._back.add_done_callback(lambda future, shard=shard: self._came_back(shard, future))

    def members(self) -> list[Shard]:
        """The shards now listed (resolving the name again when it is due)."""
        if self._name is not None and time.monotonic() - self._resolved_at > self._resolve_every:
            self._resolve_again()
        return list(self._members)

    def up(self) -> list[Shard]:
        return [shard for shard in self.members() if shard.up]

    def by_index(self, index: int) -> Shard | None:
        """The shard of that index, listed now or earlier (None: no shard ever had it)."""
        with self._lock:
            return next((shard for shard in self._known.values() if shard.index == index), None)

    def _lookup(self) -> dict[str, str]:
        """The shards (name -> address) the name resolves to, or the resolver lists, now."""
        return named(resolve(self._name) if isinstance(self._name, str) else self._name())

    def _resolve_again(self) -> None:
        with self._lock:
            self._resolved_at = time.monotonic()
        try:
            listed = self._lookup()
        except OSError as exc:  # the name does not resolve now: the shards known stay
            log.warning("shards: resolving %s failed (%s); keeping %d shard(s)", self._name, exc, len(self._members))
            return
        moved = []
        with self._lock:
            members = {name: shard.address for name, shard in self._known.items() if shard in self._members}
            if listed and listed != members:
                log.info("shards: %s resolves to %s", self._name, ", ".join(listed.values()))
                moved = self._set_members(listed)
        self._watch_moved(moved)

    def failed(self, shard: Shard, error: grpc.RpcError | str, life: int | None = None) -> None:
        """`shard` did not answer (`error`): it is down until its channel connects again, and for at least
        _HOLD_DOWN. Logged and counted.
        `life`: the shard's life the failed call began in (None: now); a failure of an earlier life is old news."""
        with self._lock:
            if self._closed or not shard.up or (life is not None and life != shard.life):
                return
            shard.up = False
            shard._down_since = time.monotonic()
            self.generation += 1
            shard._back = shard.client.ready_future()
        detail = error if isinstance(error, str) else f"{error.code().name} {error.details()}"
        log.warning("%s is down (%s): sampling and new episodes go to the other shards; what it holds is "
                    "unavailable until it is back", shard, detail)
        self._failures.labels(shard.address).inc()
        self._up.labels(shard.address).set(0)
        shard._back.add_done_callback(lambda future: self._came_back(shard, future))
        if self._name is not None and time.monotonic() - self._resolved_at > _RESOLVE_AFTER_FAILURE:
            self._resolve_again()

    def _came_back(self, shard: Shard, future: grpc.Future) -> None:
        if future.cancelled():
            return
        hold = shard._down_since + _HOLD_DOWN - time.monotonic()
        if hold > 0:  # the channel may not have noticed the broken connection yet: look again after the hold-down
            with self._lock:
                if self._closed or shard.up:
                    return
                shard._look_again = threading.Timer(hold, self._watch, (shard,))
                shard._look_again.daemon = True
                shard._look_again.start()
            return
        with self._lock:
            shard.up = True
            shard.life += 1
            shard._back = None
            self.generation += 1
            listed = shard in self._members
        log.warning("%s answers again: it rejoins the shards", shard)
        self._rejoins.labels(shard.address).inc()
        self._up.labels(shard.address).set(1)
        if self._name is not None and not listed:
            # Its record left the name while it was down (a stopped container's, say) and is back with it: the name
            # is resolved now rather than at the next interval, so that the shard takes part again at once.
            self._resolve_again()

    def _watch(self, shard: Shard) -> None:
        """Waits for the down shard's channel to connect again (after a comeback seen within the hold-down)."""
        with self._lock:
            if self._closed or shard.up:
                return
            shard._look_again = None
            shard._back = shard.client.ready_future()
        shard._back.add_done_callback(lambda future: self._came_back(shard, future))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            shards = list(self._known.values())
        for shard in shards:
            if shard._look_again is not None:
                shard._look_again.cancel()
            if shard._back is not None:
                shard._back.cancel()
            shard.client.close()
        for client in self._retired:
            client.close()


def named(listed: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """Shards as name -> address: a mapping as it is, and a list of addresses each named by its address."""
    return dict(listed) if isinstance(listed, Mapping) else {address: address for address in listed}
