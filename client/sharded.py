"""ShardedReplayClient: one client over many replay servers (shards), with ReplayClient's methods and batch format.

    rc = ShardedReplayClient("replayd:50051")                 # every A/AAAA record of the name is a shard
    rc = ShardedReplayClient(["10.0.0.1:50051", "10.0.0.2:50051"])
    rc = start_shards(3).client()                             # shards as Ray actors (client/ray): asked where they are

A buffer is created on every shard, its capacity split between them. A writer keeps each episode whole on one
shard (client/shard_sink.py). Batches follow one server's law over the union of the shards (client/shard_math.py,
client/shard_sampling.py); keys carry their shard, so update_priorities reaches the shard that served each key. A
rollout buffer lives on one shard; weights go to every shard and come from any that is up. A shard that fails is
left out (log line, `metrics` counter) until its channel connects again.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, Counter

from replayd.client.batch_stream import BatchStream
from replayd.client.polling import wait_until
from replayd.client.replay_client import (
    FetchedWeights,
    ReplayClient,
    Schema,
    _give_up,
    _int64_keys,
    _left,
    new_episode_id,
)
from replayd.client.shard_math import (
    keys_by_shard,
    merge_descriptions,
    positions,
    rendezvous,
    shard_seed,
    split_capacity,
    split_rate_limiter,
)
from replayd.client.shard_sampling import SHARD_DOWN, Holder, ShardedBatchStream, Split
from replayd.client.shard_set import Resolver, Shard, ShardError, ShardSet
from replayd.client.shard_sink import ShardedSink
from replayd.wire.components import (
    Fifo,
    MinSize,
    ModeOptions,
    RateLimiterOptions,
    RemoverOptions,
    SamplerOptions,
    Transitions,
    Uniform,
)

log = logging.getLogger("replayd.client")
T = TypeVar("T")


SHARDS_PREFIX = "shards:"
RAY_PREFIX = "ray:"
RAY_RESOLVE_EVERY = 1.0  # seconds: asking the shard actors where they are costs no wait (client/ray/resolver.py)


def connect(address: str, timeout: float = 30.0) -> ReplayClient | ShardedReplayClient:
    """A client for an address as command lines take it: "host:port" is one server (ReplayClient); "shards:name:port"
    every server the name resolves to, "host:port,host:port,..." those servers, and "ray:NAME" the shards that
    `replayd.ray.start_shards(name=NAME)` runs as Ray actors, wherever Ray has placed them (ShardedReplayClient)."""
    if address.startswith(SHARDS_PREFIX):
        return ShardedReplayClient(address.removeprefix(SHARDS_PREFIX), timeout=timeout)
    if address.startswith(RAY_PREFIX):
        from replayd.client.ray.resolver import named_shards  # ray is imported only for these addresses

        return ShardedReplayClient(named_shards(address.removeprefix(RAY_PREFIX)), timeout=timeout,
                                   resolve_every=RAY_RESOLVE_EVERY)
    if "," in address:
        return ShardedReplayClient(address.split(","), timeout=timeout)
    return ReplayClient(address, timeout=timeout)


class ShardedReplayClient:
    """ReplayClient's methods over shards. `target`: "name:port" (every A/AAAA record of the name is a shard,
    resolved again every `resolve_every` seconds and when a shard fails), a function that returns the addresses
    now (asked as often; the Ray launcher's, client/ray/resolver.py) or a sequence of "host:port" addresses.
    `refresh_seconds`: how old the shards' sizes a batch is split by may be (see client/shard_sampling.py). The
    other options are each shard's ReplayClient's. `metrics`: this client's Prometheus registry (shards failing,
    coming back, stranded episodes, priority updates for shards that are down)."""

    def __init__(self, target: str | Resolver | Sequence[str], timeout: float = 30.0, retries: int = 5,
                 token: str | None = None, root_certificates: bytes | None = None, resolve_every: float = 30.0,
                 refresh_seconds: float = 0.1, **client_options: Any) -> None:
        if not refresh_seconds >= 0:
            raise ValueError(f"refresh_seconds: expected seconds >= 0, got {refresh_seconds!r}")
        self.timeout = timeout
        self.refresh_seconds = refresh_seconds
        self.writer_id = secrets.token_hex(8)  # what episodes inserted by this client are placed by
        self.metrics = CollectorRegistry()
        self._dropped_updates = Counter("replayd_client_dropped_priority_updates", "Keys of priority updates "
                                        "whose shard is down (counted as ignored)", ["shard"], registry=self.metrics)
        self._stranded = ShardedSink.stranded_counter(self.metrics)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="replayd-shards")
        self._holders: dict[str, tuple[float, int, list[Holder]]] = {}  # buffer -> (time, generation, holders)
        self._rollout_homes: dict[str, Shard] = {}
        self._unseeded = np.random.default_rng()
        self._refreshing: set[str] = set()  # buffers described again in the background now
        self._lock = threading.Lock()

        def shard_client(address: str) -> ReplayClient:
            return ReplayClient(address, timeout=timeout, retries=retries, token=token,
                                root_certificates=root_certificates, **client_options)

        self.shards = ShardSet(target, shard_client, resolve_every, self.metrics)

    # ---------------------------------------------------------------- plumbing
    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def run_all(self, calls: Sequence[Callable[[], T]]) -> list[T | BaseException]:
        """Runs the calls concurrently (the first in this thread); each one's result, or the exception it raised."""
        futures = [self._pool.submit(call) for call in calls[1:]]
        results: list[T | BaseException] = []
        for call in calls[:1]:
            try:
                results.append(call())
            except Exception as exc:
                results.append(exc)
        for future in futures:
            exc = future.exception()
            results.append(future.result() if exc is None else exc)
        return results

    def _up(self) -> list[Shard]:
        shards = self.shards.up()
        if not shards:
            raise ShardError(grpc.StatusCode.UNAVAILABLE, f"no shard is up ({len(self.shards.members())} known: "
                             f"{', '.join(s.address for s in self.shards.members())})")
        return shards

    def _on_up_shards(self, call: Callable[[Shard], T], shards: list[Shard] | None = None
                      ) -> list[tuple[Shard, T | grpc.RpcError]]:
        """`call(shard)` on every shard up (or `shards`), concurrently: each shard's result or gRPC error. Shards
        that do not answer are reported down. Other exceptions are raised."""
        shards = self._up() if shards is None else shards
        lives = [shard.life for shard in shards]
        results = self.run_all([partial(call, shard) for shard in shards])
        out = []
        for shard, life, result in zip(shards, lives, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, grpc.RpcError):
                raise result
            if isinstance(result, grpc.RpcError) and result.code() in SHARD_DOWN:
                self.shards.failed(shard, result, life)
            out.append((shard, result))
        return out

    @staticmethod
    def _first_error(results: list[tuple[Shard, Any]]) -> grpc.RpcError | None:
        return next((result for _, result in results if isinstance(result, grpc.RpcError)), None)

    # ---------------------------------------------------------------- which shards hold a buffer
    def _describe_all(self, name: str, timeout: float | None) -> list[Holder]:
        """Every shard up that holds `name`, with its description now. The NOT_FOUND of the shards when none holds
        it; ShardError UNAVAILABLE when none answers."""
        generation = self.shards.generation  # a change of the shards while they answer makes these old at once
        results = self._on_up_shards(lambda shard: shard.client.describe(name, timeout))
        holders = [Holder(shard, info) for shard, info in results if not isinstance(info, grpc.RpcError)]
        errors = [error for _, error in results if isinstance(error, grpc.RpcError)]
        unexpected = [e for e in errors if e.code() not in (*SHARD_DOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                            grpc.StatusCode.NOT_FOUND)]
        if unexpected:
            raise unexpected[0]
        if not holders:
            for code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED):  # as one server would say
                if any(error.code() == code for error in errors):
                    raise next(error for error in errors if error.code() == code)
            raise ShardError(grpc.StatusCode.UNAVAILABLE, f"buffer {name!r}: no shard answered ({errors[0].details()})")
        with self._lock:
            self._holders[name] = (time.monotonic(), generation, holders)
        return holders

    def holders(self, name: str, timeout: float | None = None) -> list[Holder]:
        """The shards up that hold `name`, with their descriptions: described again at once after a change of the
        shards (one failing, coming back, joining or leaving); otherwise, once `refresh_seconds` old, described
        again in the background while the last ones serve, so that a stream never waits for it (they are then at
        most `refresh_seconds` and one describe's round trip old)."""
        cached = self._holders.get(name)
        if cached is None or cached[1] != self.shards.generation:
            return self._describe_all(name, self._deadline(timeout))
        if time.monotonic() - cached[0] > self.refresh_seconds:
            with self._lock:
                due = name not in self._refreshing
                self._refreshing.add(name)
            if due:
                self._pool.submit(self._refresh, name)
        return cached[2]

    def _refresh(self, name: str) -> None:
        try:
            self._describe_all(name, self.timeout)
        except grpc.RpcError as exc:  # the last descriptions serve on; shards that failed are marked down
            log.warning("buffer %r: describing its shards again failed (%s %s)", name, exc.code().name, exc.details())
        finally:
            with self._lock:
                self._refreshing.discard(name)

    # ---------------------------------------------------------------- buffers
    def create_buffer(self, name: str, capacity_steps: int, schema: Schema,
                      observation_fields: Sequence[str] = ("obs",), reward_field: str | None = None,
                      sampler: SamplerOptions = Uniform(), remover: RemoverOptions = Fifo(),
                      rate_limiter: RateLimiterOptions = MinSize(),
                      goal_fields: tuple[str, str] | None = None, capacity_bytes: int = 0) -> dict[str, Any]:
        """Creates the buffer on every shard up, `capacity_steps` and `capacity_bytes` (0: not given) split
        between them (an episode must fit one shard's part), and the rate limiter's sizes too
        (client/shard_math.py split_rate_limiter); a shard's remover and limiter act on its own steps. Raises the
        first shard's refusal (the others keep theirs)."""
        shards = self._up()
        capacities = split_capacity(capacity_steps, len(shards)) if capacity_steps else [0] * len(shards)
        budgets = split_capacity(capacity_bytes, len(shards)) if capacity_bytes else [0] * len(shards)
        limiter = split_rate_limiter(rate_limiter, len(shards))
        results = self._on_up_shards(
            lambda shard: shard.client.create_buffer(name, capacities[shards.index(shard)], schema, observation_fields,
                                                     reward_field, sampler, remover, limiter, goal_fields,
                                                     budgets[shards.index(shard)]), shards)
        error = self._first_error(results)
        if error is not None:
            raise error
        self._holders.pop(name, None)
        return merge_descriptions([(shard.address, info) for shard, info in results])

    def create_rollout_buffer(self, name: str, num_steps: int, num_envs: int, schema: Schema, gamma: float = 0.99,
                              gae_lambda: float = 0.95) -> dict[str, Any]:
        """Creates a PPO rollout buffer on one shard: the one a stable hash of `name` ranks first among the shards
        up. Its pushes, minibatches and versions go there."""
        shards = self._up()
        home = shards[rendezvous(name, [shard.address for shard in shards])]
        info = home.client.create_rollout_buffer(name, num_steps, num_envs, schema, gamma, gae_lambda)
        self._rollout_homes[name] = home
        return merge_descriptions([(home.address, info)])

    def _rollout_home(self, name: str) -> ReplayClient:
        home = self._rollout_homes.get(name)
        if home is None:
            home = self._rollout_homes[name] = self._describe_all(name, self.timeout)[0].shard
        return home.client

    def describe(self, name: str, timeout: float | None = None) -> dict[str, Any]:
        """The buffer's description merged over the shards that hold it (client/shard_math.py merge_descriptions):
        totals, and `shards`, each one's own description with its address."""
        holders = self._describe_all(name, self._deadline(timeout))
        return merge_descriptions([(holder.shard.address, dict(holder.info)) for holder in holders])

    def list_buffers(self) -> list[dict[str, Any]]:
        results = self._on_up_shards(lambda shard: shard.client.list_buffers())
        if all(isinstance(result, grpc.RpcError) for _, result in results):
            raise self._first_error(results)
        by_name: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for shard, infos in results:
            for info in [] if isinstance(infos, grpc.RpcError) else infos:
                by_name.setdefault(info["name"], []).append((shard.address, info))
        return [merge_descriptions(described) for _, described in sorted(by_name.items())]

    def delete_buffer(self, name: str) -> None:
        """Deletes the buffer on every shard up that holds it; NOT_FOUND when none does."""
        results = self._on_up_shards(lambda shard: shard.client.delete_buffer(name))
        self._holders.pop(name, None)
        self._rollout_homes.pop(name, None)
        errors = [result for _, result in results if isinstance(result, grpc.RpcError)]
        unexpected = [e for e in errors if e.code() != grpc.StatusCode.NOT_FOUND]
        if unexpected:
            raise unexpected[0]
        if len(errors) == len(results):
            raise errors[0]

    def observation_fields(self, buffer: str) -> tuple[str, ...]:
        return self.holders(buffer)[0].shard.client.observation_fields(buffer)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until every shard listed accepts connections (grpc.FutureTimeoutError naming those that do not)."""
        give_up = time.monotonic() + timeout
        for shard in self.shards.members():
            try:
                shard.client.wait_ready(max(give_up - time.monotonic(), 0.0))
            except grpc.FutureTimeoutError:
                raise grpc.FutureTimeoutError(f"{shard} did not accept connections within {timeout} s") from None

    def checkpoint(self, directory: str = "", timeout: float | None = None) -> list[str]:
        """Has every shard up write a checkpoint (ReplayClient.checkpoint); their manifest paths, one per shard."""
        results = self._on_up_shards(lambda shard: shard.client.checkpoint(directory, timeout))
        error = self._first_error(results)
        if error is not None:
            raise error
        return [path for _, path in results]

    def close(self) -> None:
        """Closes every shard's channel, once the calls running on this client's threads (a background describe,
        say) have ended."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.shards.close()

    def __enter__(self) -> ShardedReplayClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- inserting
    def _place(self, buffer: str, writer_id: str, episode_id: int) -> Shard:
        """The shard a new episode goes to: the one a stable hash of (writer, episode) ranks first among the shards
        up that hold the buffer."""
        shards = [holder.shard for holder in self.holders(buffer) if holder.shard.up]
        if not shards:
            raise ShardError(grpc.StatusCode.UNAVAILABLE, f"buffer {buffer!r}: no shard holding it is up")
        return shards[rendezvous(f"{writer_id}|{episode_id}", [shard.address for shard in shards])]

    def span_sink(self, buffer: str) -> ShardedSink:
        """Where an EpisodeWriter's spans go: each episode whole on one shard (client/shard_sink.py)."""
        writer_id = secrets.token_hex(8)
        return ShardedSink(buffer, self.shards, partial(self._place, buffer, writer_id), self.run_all, self._stranded)

    def insert_episode(self, buffer: str, terminated: bool, episode_id: int | None = None,
                       **columns: np.ndarray) -> int:
        """Inserts one whole episode on its shard (see insert_episodes)."""
        episode_id = new_episode_id() if episode_id is None else episode_id
        self.insert_episodes(buffer, [columns], [terminated], [episode_id])
        return episode_id

    def insert_episodes(self, buffer: str, episodes: Sequence[dict[str, np.ndarray]], terminated: Sequence[bool],
                        episode_ids: Sequence[int] | None = None) -> None:
        """Inserts whole episodes, each on the shard its id is placed on (one stream per shard, concurrently, with
        each shard's exactly-once retries). A shard that fails past its deadline is reported down and its error
        raised after the other shards' inserts: a retry of the same call places the episodes on the shards up, so
        a failed episode may then be stored twice once the failed shard comes back (EpisodeWriter holds such
        episodes for their shard instead)."""
        if len(episodes) != len(terminated):
            raise ValueError(f"{len(episodes)} episodes but {len(terminated)} terminated flags")
        ids = list(episode_ids) if episode_ids is not None else [None] * len(episodes)
        if len(ids) != len(episodes):
            raise ValueError(f"{len(episodes)} episodes but {len(ids)} episode_ids")
        groups: dict[int, tuple[Shard, list[int]]] = {}
        for k, episode_id in enumerate(ids):
            ids[k] = new_episode_id() if episode_id is None else episode_id
            shard = self._place(buffer, self.writer_id, ids[k])
            groups.setdefault(shard.index, (shard, []))[1].append(k)
        shards = [shard for shard, _ in groups.values()]

        def insert(shard: Shard) -> None:
            chosen = groups[shard.index][1]
            shard.client.insert_episodes(buffer, [episodes[k] for k in chosen], [terminated[k] for k in chosen],
                                         [ids[k] for k in chosen])

        error = self._first_error(self._on_up_shards(insert, shards))
        if error is not None:
            raise error

    # ---------------------------------------------------------------- sampling
    def _split(self, buffer: str, wait: bool, give_up: float | None) -> Split:
        """How a batch is split now: between the holders with a positive mass. With none, a holder with wait=False
        (the server says why it cannot be sampled), or, with wait, the wait for one until `give_up`. While no shard
        is up, the wait for one lasts until `give_up` or this client's `timeout`, whichever comes first."""
        deadline = math.inf if give_up is None else give_up
        unavailable_until = min(deadline, time.monotonic() + (math.inf if self.timeout is None else self.timeout))

        def ready() -> Split | None:
            try:
                holders = self.holders(buffer, _left(give_up))
            except ShardError:
                if time.monotonic() > unavailable_until:
                    raise
                return None
            positive = [holder for holder in holders if holder.mass > 0]
            if positive:
                return Split(positive)
            return None if wait else Split(holders[:1])

        try:
            return wait_until(ready, deadline, f"a shard of buffer {buffer!r} with a sampleable step", retry_codes=())
        except TimeoutError as exc:
            raise ShardError(grpc.StatusCode.DEADLINE_EXCEEDED, f"buffer {buffer!r}: {exc}") from exc

    def _rng(self, seed: int | None) -> np.random.Generator:
        """What splits a request's batches: its own generator when it is seeded, else this client's (numpy's
        generators lock their state: threads may share it)."""
        return self._unseeded if seed is None else np.random.default_rng(seed)

    @staticmethod
    def _shard_options(shard: Shard, request_options: dict[str, Any]) -> dict[str, Any]:
        seed = request_options.get("seed")
        return request_options | ({} if seed is None else {"seed": shard_seed(seed, shard.index)})

    def sample(self, buffer: str, batch_size: int, mode: ModeOptions = Transitions(), *, timeout: float | None = None,
               **request_options: Any) -> dict[str, np.ndarray]:
        """One batch over the union of the shards: split by a multinomial draw over their masses, the sub-batches
        fetched concurrently and merged one array per column (one shard's batch is returned as it came). A shard
        that fails is left out and the batch drawn again from the others, within `timeout`."""
        give_up = _give_up(self._deadline(timeout))
        rng = self._rng(request_options.get("seed"))
        beta = request_options.get("importance_beta", 0.0)
        while True:
            split = self._split(buffer, request_options.get("wait", False), give_up)
            drawn = split.counts(batch_size, rng)
            counts = {split.holders[k].shard.index: (k, count) for k, count in enumerate(drawn) if count}

            def sub_batch(shard: Shard, counts: dict[int, tuple[int, int]] = counts) -> dict[str, np.ndarray]:
                return shard.client.sample(buffer, counts[shard.index][1], mode, timeout=_left(give_up),
                                           **self._shard_options(shard, request_options))

            results = self._on_up_shards(sub_batch, [holder.shard for holder in split.holders
                                                     if holder.shard.index in counts])
            errors = [result for _, result in results if isinstance(result, grpc.RpcError)]
            if any(error.code() not in SHARD_DOWN for error in errors):
                raise next(error for error in errors if error.code() not in SHARD_DOWN)
            if not errors:  # else the shards that failed are down now: the batch is drawn again without them
                pieces = [(counts[shard.index][0], (batch, 0, counts[shard.index][1])) for shard, batch in results]
                return split.merge(pieces, split.order(drawn, rng), beta)

    def sample_stream(self, buffer: str, batch_size: int, mode: ModeOptions = Transitions(), num_batches: int = 0, *,
                      timeout: float | None = None, **request_options: Any) -> ShardedBatchStream:
        """Batches over the union from one server stream per shard (client/shard_sampling.py ShardedBatchStream);
        `num_batches=0` streams until closed. A shard that fails is left out of the split (log line and metric)
        until it answers again; `timeout` bounds the whole stream, and the wait for a shard while none is up."""
        ReplayClient.sample_request(buffer, batch_size, mode, **request_options)  # refused here, not at the first batch
        give_up = _give_up(timeout)
        wait = request_options.get("wait", False)

        def open_stream(shard: Shard) -> BatchStream:
            return shard.client.sample_stream(buffer, batch_size, mode, 0, timeout=_left(give_up),
                                              **self._shard_options(shard, request_options))

        return ShardedBatchStream(lambda: self._split(buffer, wait, give_up), open_stream, self.shards, batch_size,
                                  num_batches, self._rng(request_options.get("seed")),
                                  request_options.get("importance_beta", 0.0))

    def update_priorities(self, buffer: str, keys: Sequence[int] | np.ndarray,
                          priorities: Sequence[float] | np.ndarray, timeout: float | None = None) -> tuple[int, int]:
        """Sends each key's priority to the shard that served the key (its index is in the key's bits 48..62), the
        shards concurrently; returns (applied, ignored_stale) summed. Keys of a shard that is down are counted as
        ignored (logged, and counted in `metrics`)."""
        keys = _int64_keys(keys)
        priorities = np.asarray(priorities, dtype=np.float64)
        if priorities.shape != keys.shape:
            raise ValueError(f"priorities: expected one per key ({keys.size}), got shape {priorities.shape}")
        parts = keys_by_shard(keys)
        shards = {index: self.shards.by_index(index) for index in parts}
        unknown = [index for index, shard in shards.items() if shard is None]
        if unknown:
            raise ValueError(f"keys: shard index {unknown[0]} (key bits 48..62) is no shard of this client")
        results = self._on_up_shards(
            lambda shard: shard.client.update_priorities(buffer, positions(keys[parts[shard.index]]),
                                                         priorities[parts[shard.index]], timeout),
            [shard for shard in shards.values() if shard.up])
        applied = ignored = 0
        for _, result in results:
            if isinstance(result, grpc.RpcError) and result.code() not in SHARD_DOWN:
                raise result
            if not isinstance(result, grpc.RpcError):
                applied, ignored = applied + result[0], ignored + result[1]
        answered = {shard.index for shard, result in results if not isinstance(result, grpc.RpcError)}
        for index, shard in shards.items():
            if index not in answered:
                count = int(parts[index].size)
                ignored += count
                log.warning("%s is down: %d priority update(s) of buffer %r dropped", shard, count, buffer)
                self._dropped_updates.labels(shard.address).inc(count)
        return applied, ignored

    # ---------------------------------------------------------------- rollouts (PPO): on the buffer's shard
    def push_rollout(self, buffer: str, policy_version: int, env_start: int, step_start: int,
                     bootstrap_value: np.ndarray | None = None, **columns: np.ndarray) -> dict[str, Any]:
        return self._rollout_home(buffer).push_rollout(buffer, policy_version, env_start, step_start, bootstrap_value,
                                                       **columns)

    def rollout_minibatches(self, buffer: str, minibatch_size: int, epochs: int = 1, normalize_advantages: bool = True,
                            drop_last: bool = False, seed: int | None = None,
                            timeout: float | None = None) -> BatchStream:
        return self._rollout_home(buffer).rollout_minibatches(buffer, minibatch_size, epochs, normalize_advantages,
                                                              drop_last, seed, timeout)

    def finish_rollout(self, buffer: str, next_version: int) -> dict[str, Any]:
        return self._rollout_home(buffer).finish_rollout(buffer, next_version)

    # ---------------------------------------------------------------- weights: on every shard
    def publish_weights(self, name: str, version: int, safetensors: bytes, final: bool = False) -> bool:
        """Publishes to every shard up, concurrently; True when one took it as new (False: every shard had this
        version or a newer one). A shard that comes back later has the weights published after it is back."""
        results = self._on_up_shards(lambda shard: shard.client.publish_weights(name, version, safetensors, final))
        answers = [result for _, result in results if not isinstance(result, grpc.RpcError)]
        if not answers:
            raise self._first_error(results)
        return any(answers)

    def fetch_weights(self, name: str, newer_than: int = 0) -> FetchedWeights:
        """From the shard up that a stable hash of `name` ranks first (the next one when it does not answer)."""
        while True:
            shards = self._up()
            shard = shards[rendezvous(name, [s.address for s in shards])]
            life = shard.life
            try:
                return shard.client.fetch_weights(name, newer_than)
            except grpc.RpcError as exc:
                if exc.code() not in SHARD_DOWN:
                    raise
                self.shards.failed(shard, exc, life)
