"""Where the Ray shard actors are now: the addresses a ShardedReplayClient re-resolves through the launcher.

Each shard actor answers `address()` with the address its replay server listens on in its current life; after Ray
restarted it (on its node, or on another one), the same call reaches the new life. A client asks every second and
after a shard fails, in the middle of its calls, so the resolver never waits: it hands back the answers that have
arrived and sends the next questions, and a shard that has not answered (restarting) keeps its last address. The
shards are listed by their index: a shard that moved to another address stays the same shard of the client (its
key bits, and the spans a writer holds for it, which its new life acknowledges or stores: its checkpoint holds its
exactly-once memory).
"""

from __future__ import annotations

import logging
import time

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayError

log = logging.getLogger("replayd.ray")

NAMESPACE = "replayd"  # the Ray namespace of every shard actor, so that drivers in any namespace find them


def actor_name(group: str, index: int) -> str:
    return f"replayd-{group}-{index}"


class ShardAddresses:
    """A ShardedReplayClient's resolver over shard actors: called, it returns their addresses, one per shard in
    shard order, at once. `addresses`: where they are known to listen now."""

    def __init__(self, group: str, handles: list[ActorHandle], addresses: list[str]) -> None:
        if len(handles) != len(addresses):
            raise ValueError(f"expected one address per shard actor ({len(handles)}), got {addresses!r}")
        self.group = group
        self._handles = handles
        self._known = list(addresses)
        self._answered = [time.monotonic()] * len(addresses)  # when each shard's address was last told
        self._asked: list[ray.ObjectRef | None] = [None] * len(handles)

    def __repr__(self) -> str:
        return f"Ray shards {self.group!r}"

    def __call__(self) -> dict[str, str]:
        for index, handle in enumerate(self._handles):
            asked = self._asked[index]
            if asked is not None:
                ready, _ = ray.wait([asked], timeout=0)
                if not ready:
                    continue  # restarting, or placed anew: its last address stands meanwhile
                try:
                    address = ray.get(asked)
                except RayError as exc:  # died for good (restarts used up) or killed: it stays listed, down
                    log.warning("shard %d of %r did not say where it is: %s", index, self.group, exc)
                else:
                    if address != self._known[index]:
                        log.info("shard %d of %r listens on %s", index, self.group, address)
                    self._known[index], self._answered[index] = address, time.monotonic()
            self._asked[index] = handle.address.remote()
        return distinct(self._known, self._answered)


def distinct(addresses: list[str], told_at: list[float]) -> dict[str, str]:
    """The shards (index -> address), each address once: a shard that moved may listen where another one listened
    before it moved too; that address is the shard's that told it last (`told_at`), the other one's is out of date
    (that shard is left out until it tells its new one)."""
    newest: dict[str, int] = {}
    for index, address in enumerate(addresses):
        other = newest.get(address)
        if other is None or told_at[index] > told_at[other]:
            newest[address] = index
    return {str(index): address for index, address in enumerate(addresses) if newest[address] == index}


def connect_ray() -> None:
    """Joins the Ray cluster this process runs in, or the one `RAY_ADDRESS` (else the local running one) names."""
    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False)


def lookup(group: str) -> list[ActorHandle]:
    """The shard actors of `group`, in shard order (ValueError when no such group runs)."""
    connect_ray()
    try:
        first = ray.get_actor(actor_name(group, 0), namespace=NAMESPACE)
    except ValueError:
        raise ValueError(f"no replayd shards named {group!r} run on this Ray cluster (namespace {NAMESPACE!r}): "
                         f"start them with replayd.ray.start_shards(..., name={group!r}) or "
                         f"`replayd ray up --name {group}`") from None
    count = ray.get(first.num_shards.remote())
    return [first, *(ray.get_actor(actor_name(group, k), namespace=NAMESPACE) for k in range(1, count))]


def named_shards(group: str, timeout: float = 60.0) -> ShardAddresses:
    """The resolver of the shards named `group` (a `ray:NAME` address), with their addresses now."""
    handles = lookup(group)
    return ShardAddresses(group, handles, ray.get([handle.address.remote() for handle in handles], timeout=timeout))
