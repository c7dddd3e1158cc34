"""An EpisodeWriter's spans over shards: each episode whole on one shard, exactly once.

An episode's shard is chosen when its first span is sent (a stable hash of the writer's id and the episode's id
over the shards up that hold the buffer, see ShardedReplayClient) and kept until its last span is acknowledged.
A send streams each shard's spans to it (one insert stream per shard, concurrently, with the client's
exactly-once retries). When a shard does not answer past its deadline, the spans sent to it are in doubt: it may
have stored them. They are held for that shard alone, and delivered when it is back (it acknowledges what it
already holds without storing it twice), so no episode is ever stored on two shards. New episodes go to the shards
up. An open episode whose shard is down cannot go on there: `stranded` says so (logged and counted), and the writer
goes on with its unsent steps as a new episode, placed on a live shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from replayd.client.replay_client import Span, spans_requests
from replayd.client.shard_set import Shard, ShardError, ShardSet

log = logging.getLogger("replayd.client")

# An insert that ends with these (past its retries) left its spans in doubt on its shard; UNAVAILABLE also says the
# shard is down (DEADLINE_EXCEEDED may be a shard that answers but whose rate limiter held the inserts back).
IN_DOUBT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class ShardedSink:
    """One writer's spans into buffer `buffer` over `shards`. `place(episode_id)` picks a new episode's shard (by
    the writer's id and the episode's); `run_all(calls)` runs calls concurrently and returns each one's result or
    exception."""

    def __init__(self, buffer: str, shards: ShardSet, place: Callable[[int], Shard],
                 run_all: Callable[[Sequence[Callable[[], Any]]], list[Any]], stranded: Counter) -> None:
        self.buffer = buffer
        self._shards, self._place, self._run_all = shards, place, run_all
        self._stranded = stranded
        # episode id -> its shard, from its first span sent until its last one is acknowledged
        self._placed: dict[int, Shard] = {}
        self._held: dict[int, tuple[Shard, list[Span]]] = {}  # shard index -> spans in doubt there, in order

    @staticmethod
    def stranded_counter(registry: CollectorRegistry) -> Counter:
        return Counter("replayd_client_stranded_episodes", "Open episodes whose shard went down: their writers go on "
                       "with new episodes on live shards", ["shard"], registry=registry)

    def stranded(self, episode_id: int) -> bool:
        shard = self._placed.get(episode_id)
        if shard is None or shard.up:
            return False
        del self._placed[episode_id]
        log.warning("%s is down: open episode %d cannot go on there (its sent steps stay there, unavailable until it "
                    "is back); its writer goes on with a new episode on a live shard", shard, episode_id)
        self._stranded.labels(shard.address).inc()
        return True

    def send(self, spans: Sequence[Span]) -> None:
        """Delivers the held spans of shards that are back, then `spans`; holds what a shard failing leaves in doubt
        (and what goes to a shard that still holds spans in doubt, which must land first). Raises a shard's refusal
        of `spans` (nothing of them is held then: the writer sends them again, one episode at a time), or ShardError
        UNAVAILABLE when no shard is up to take a new episode (nothing changed)."""
        new = {span.episode_id for span in spans if span.episode_id not in self._placed}
        placed = {episode_id: self._place(episode_id) for episode_id in new}  # may raise: before any change
        self._placed |= placed
        self._deliver_held()
        groups: dict[int, tuple[Shard, list[Span]]] = {}
        for span in spans:
            shard = self._placed[span.episode_id]
            if shard.up and shard.index not in self._held:
                groups.setdefault(shard.index, (shard, []))[1].append(span)
            else:
                self._hold(shard, [span])
        results = self._deliver(list(groups.values()))
        refusals = [result for result in results if result is not None and result.code() not in IN_DOUBT]
        if refusals:
            raise refusals[0]
        for (shard, group), result in zip(groups.values(), results, strict=True):
            if result is not None:
                self._hold(shard, group)
            else:
                self._delivered(group)

    def _deliver(self, groups: list[tuple[Shard, list[Span]]]) -> list[grpc.RpcError | None]:
        """Streams each group to its shard, concurrently; each group's gRPC error (None: stored). A shard found
        unreachable is reported down."""
        lives = [shard.life for shard, _ in groups]
        results = self._run_all([partial(self._insert, shard, group) for shard, group in groups])
        errors = []
        for (shard, _), life, result in zip(groups, lives, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, grpc.RpcError):
                raise result
            if isinstance(result, grpc.RpcError) and result.code() == grpc.StatusCode.UNAVAILABLE:
                self._shards.failed(shard, result, life)
            errors.append(result)
        return errors

    def _deliver_held(self) -> None:
        """Sends the held spans of shards that are back. A shard that refuses them (it came back without the
        buffer, say) drops them, with an error in the log: nothing else could store them."""
        back = [(index, shard, held) for index, (shard, held) in self._held.items() if shard.up]
        results = self._deliver([(shard, held) for _, shard, held in back])
        for (index, shard, held), result in zip(back, results, strict=True):
            if result is None:
                del self._held[index]
                self._delivered(held)
            elif result.code() not in IN_DOUBT:
                del self._held[index]
                log.error("%s refused %d held span(s) of buffer %r (%s %s): they are dropped", shard, len(held),
                          self.buffer, result.code().name, result.details())

    def _delivered(self, spans: list[Span]) -> None:
        for span in spans:
            if span.ends:
                self._placed.pop(span.episode_id, None)

    def _insert(self, shard: Shard, spans: list[Span]) -> None:
        shard.client.insert(spans_requests(self.buffer, spans, shard.client.max_request_bytes))

    def _hold(self, shard: Shard, spans: list[Span]) -> None:
        self._held.setdefault(shard.index, (shard, []))[1].extend(spans)

    def deliver_held(self) -> None:
        """Delivers the held spans of shards that are back; ShardError UNAVAILABLE while some are still held."""
        self._deliver_held()
        if self._held:
            waiting = {shard.address: sum(span.rows for span in spans) for shard, spans in self._held.values()}
            raise ShardError(grpc.StatusCode.UNAVAILABLE,
                             f"buffer {self.buffer!r}: rows held for shards that are down (delivered by a flush or "
                             f"close once they are back): {waiting}")
