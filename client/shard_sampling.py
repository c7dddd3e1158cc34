"""Sampling over shards: which shards hold a buffer and how much of it (Holder), how a batch is split between them
and made global (Split), and a stream that keeps one server stream per shard in flight (ShardedBatchStream).

Staleness. A split uses the shards' sizes from their last descriptions, at most `refresh_seconds` and one describe's
round trip old (ShardedReplayClient.holders: taken again in the background, so a stream never waits for them), and
taken again at once after a shard fails, comes back, joins or leaves. While no step is
inserted, evicted or reprioritized (the tests' steady state, and a long run's full rings under FIFO eviction for
the uniform sizes) those sizes are the shards' sizes at the draw, so a batch follows one server's law over the
union exactly; otherwise a shard's share lags its size by what changed within the interval. A stream's sub-batches
are drawn when the shard sends them (a few ahead), from the shard's state of that moment.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from replayd.client.batch_stream import BatchStream
from replayd.client.shard_math import Rows, globalize, globalize_rows, merge_rows, split_batch, weight_factor
from replayd.client.shard_set import Shard, ShardSet

log = logging.getLogger("replayd.client")

# A shard's stream ending with these, unless closed by us, is the shard failing: sampling goes on without it.
SHARD_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class Holder:
    """A shard holding a buffer, with the buffer's description there at the last refresh."""

    shard: Shard
    info: Mapping[str, Any]

    @property
    def mass(self) -> float:
        """What the shard's share of a batch is proportional to: its priority mass (prioritized buffers: the sum
        tree's root, sum p^alpha), else its sampleable steps."""
        total = self.info["counters"].get("prioritized.total")
        return float(self.info["sampleable_steps"] if total is None else total)

    @property
    def floor(self) -> float:
        """The smallest positive p^alpha of a prioritized shard (0: none, or a uniform buffer)."""
        return float(self.info["counters"].get("prioritized.min_positive", 0.0))


class Split:
    """How batches of one moment are split between `holders` (those with a positive mass, or the one that will
    say why it cannot be sampled), and how their sub-batches become one batch over the union."""

    def __init__(self, holders: list[Holder]) -> None:
        self.holders = holders
        if len(holders) == 1:  # its batch is the batch: nothing to split, nothing to rescale
            self.shares, self._floor = (1.0,), holders[0].floor
            return
        masses = np.array([holder.mass for holder in holders], dtype=np.float64)
        total = float(masses.sum())
        self.shares = masses / total if total > 0 else np.ones(len(holders))
        floors = [holder.floor for holder in holders if holder.floor > 0]
        self._floor = min(floors, default=0.0)

    def counts(self, batch_size: int, rng: np.random.Generator) -> list[int]:
        """Items per holder of a batch (a multinomial draw over the shares)."""
        if len(self.holders) == 1:
            return [batch_size]
        return split_batch(batch_size, self.shares, rng).tolist()

    @staticmethod
    def order(counts: list[int], rng: np.random.Generator) -> np.ndarray | None:
        """The order a batch of `counts` rows per holder (grouped by holder) is taken in: a random permutation when
        more than one holder gave rows, so that each row, wherever it stands, is an independent draw over the union
        as in one server's batch (grouped, row 0 would come from the first holder); None otherwise."""
        return rng.permutation(sum(counts)) if sum(1 for count in counts if count) > 1 else None

    def _factor(self, k: int, importance_beta: float) -> float:
        floor = self.holders[k].floor
        return weight_factor(importance_beta, floor, self._floor) if floor > 0 and importance_beta else 1.0

    def merge(self, pieces: list[tuple[int, Rows]], order: np.ndarray | None,
              importance_beta: float) -> dict[str, np.ndarray]:
        """Rows of the holders (k, rows) as one batch over the union, taken in `order`: keys tagged with their
        shard, probabilities and importance weights global (client/shard_math.py globalize)."""
        batch = merge_rows([rows for _, rows in pieces], order)
        ks = [k for k, _ in pieces]
        if len(set(ks)) == 1:
            k = ks[0]
            shard_index, share = self.holders[k].shard.index, float(self.shares[k])
            return globalize(batch, shard_index, share, self._factor(k, importance_beta))
        holder = np.repeat(ks, [hi - lo for _, (_, lo, hi) in pieces])
        holder = holder if order is None else holder[order]
        shard_indices = np.array([h.shard.index for h in self.holders], dtype=np.int64)
        factors = np.array([self._factor(k, importance_beta) for k in range(len(self.holders))])
        return globalize_rows(batch, shard_indices[holder], np.asarray(self.shares)[holder], factors[holder])


class _ShardFailed(Exception):
    def __init__(self, shard: Shard, life: int, error: grpc.RpcError | str) -> None:
        super().__init__(str(error))
        self.shard, self.life, self.error = shard, life, error


class _ShardQueue:
    """One shard's server stream and the rows of its current batch not taken yet (every row an independent draw
    from the shard, so a merged batch may take any of them)."""

    def __init__(self, shard: Shard, stream: BatchStream) -> None:
        self.shard, self.stream = shard, stream
        self.life = shard.life  # the shard's life the stream belongs to (it ends when the shard fails)
        self._batch: dict[str, np.ndarray] = {}
        self._cursor = self._rows = 0

    def take(self, count: int) -> list[Rows]:
        """`count` rows, as ranges of the batches they are in."""
        pieces = []
        while count:
            if self._cursor == self._rows:
                self._next_batch()
            rows = min(count, self._rows - self._cursor)
            pieces.append((self._batch, self._cursor, self._cursor + rows))
            self._cursor += rows
            count -= rows
        return pieces

    def _next_batch(self) -> None:
        try:
            self._batch = next(self.stream)
        except StopIteration:
            raise _ShardFailed(self.shard, self.life, "its stream ended") from None
        except grpc.RpcError as exc:
            if exc.code() in SHARD_DOWN:
                raise _ShardFailed(self.shard, self.life, exc) from exc
            raise
        self._cursor, self._rows = 0, len(next(iter(self._batch.values())))


class ShardedBatchStream:
    """Batches over the union of the shards, from one server stream per shard (each of the full batch size, so a
    shard's stream sends a batch about every 1/share merged batches and nothing is drawn in vain but the rows left
    at the end). Each batch's split is drawn from the shards' sizes of that moment (`split(remaining seconds)`).

    A shard whose stream fails (UNAVAILABLE, or it ends) is reported to the shard set (log line and metric), and
    the batch is split again between the others; it rejoins the split when it answers again. `close()` cancels
    every shard's stream, from any thread."""

    def __init__(self, split: Callable[[], Split], open_stream: Callable[[Shard], BatchStream], shards: ShardSet,
                 batch_size: int, num_batches: int, rng: np.random.Generator, importance_beta: float) -> None:
        self._split, self._open_stream, self._shards = split, open_stream, shards
        self._batch_size, self._num_batches = batch_size, num_batches
        self._rng, self._beta = rng, importance_beta
        self._queues: dict[int, _ShardQueue] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._served = 0

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            if self._closed or (self._num_batches and self._served == self._num_batches):
                self.close()
                raise StopIteration
            split = self._split()
            counts = split.counts(self._batch_size, self._rng)
            try:
                pieces = [(k, rows) for k, count in enumerate(counts) if count
                          for rows in self._queue(split.holders[k].shard).take(count)]
            except _ShardFailed as failure:
                if self._closed:
                    raise StopIteration from None
                self._drop(failure.shard)
                self._shards.failed(failure.shard, failure.error, failure.life)
                continue
            self._served += 1
            return split.merge(pieces, split.order(counts, self._rng), self._beta)

    def _queue(self, shard: Shard) -> _ShardQueue:
        """The shard's queue; a stream of an earlier life of the shard (it failed and came back since) is
        replaced."""
        queue = self._queues.get(shard.index)
        if queue is not None and queue.life == shard.life:
            return queue
        self._drop(shard)
        life = shard.life
        try:
            stream = self._open_stream(shard)
        except grpc.RpcError as exc:
            if exc.code() in SHARD_DOWN:
                raise _ShardFailed(shard, life, exc) from exc
            raise
        with self._lock:
            if self._closed:
                stream.close()
                raise _ShardFailed(shard, life, "the stream was closed")
            queue = self._queues[shard.index] = _ShardQueue(shard, stream)
        return queue

    def _drop(self, shard: Shard) -> None:
        with self._lock:
            queue = self._queues.pop(shard.index, None)
        if queue is not None:
            queue.stream.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queues, self._queues = list(self._queues.values()), {}
        for queue in queues:
            queue.stream.close()
