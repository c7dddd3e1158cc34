"""EpisodeWriter: an actor appends steps; whole episodes are batched into few requests, and long
episodes go out as chunks so their steps become sampleable before the episode ends."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from replayd.client.polling import RECONNECT
from replayd.client.replay_client import ReplayClient, Span, SpanSink, compress_columns, is_int, new_episode_id
from replayd.wire.frame_fields import Frames, stacked_shape

if TYPE_CHECKING:
    from replayd.client.sharded import ShardedReplayClient


class EpisodeWriter:
    """Writes one actor's episodes into an episodic buffer.

    `append(obs=..., action=..., reward=...)` once per step (the observation the action was taken in),
    then `end_episode(terminated, obs=final_obs)`. Completed episodes wait until `batch_rows` rows are
    pending (or `flush()`); an open episode is sent as a chunk every `chunk_rows` rows. `close()` (or
    leaving a `with EpisodeWriter(...) as writer:` block without an exception) sends what is left.

    Values are checked against the buffer's schema (names, dtype, shape) as they are given, so a wrong
    one raises ValueError there and changes nothing: a value is converted to its field's dtype only within
    its kind or from a narrower kind (see `_row`), never truncated or wrapped. A stacked observation field
    (Frames(stack=k)) takes its frame, or the stacked observation an environment wrapper gives (gymnasium's
    FrameStackObservation), of which the newest frame is kept: the buffer stacks frames again when sampled. A
    compressed field's frames are compressed when their chunk or episode is complete (so requests carry them
    compressed).

    A flush that fails because the server is unreachable keeps its spans for the next flush. One the
    server refuses (an open episode evicted meanwhile, say) is sent again one episode at a time: the
    episodes it accepts are stored, the refused ones dropped, and the first refusal is raised; an open
    episode that was refused goes on as a new episode from its unsent steps.

    Spans go through the client's span sink (`client.span_sink(buffer)`): one server's, or a
    ShardedReplayClient's, which keeps each episode on one shard; an open episode whose shard went down goes
    on as a new episode (on a live shard) from its unsent steps (one with none but its final observation ends
    where it is: the sink holds the end until that shard is back).
    """

    def __init__(self, client: ReplayClient | ShardedReplayClient, buffer: str, chunk_rows: int = 1000,
                 batch_rows: int = 4096, auto_flush: bool = True) -> None:
        for name, value, least in (("chunk_rows", chunk_rows, 2), ("batch_rows", batch_rows, 1)):
            if not is_int(value) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.client = client
        self.buffer = buffer
        self.chunk_rows = chunk_rows
        self.batch_rows = batch_rows
        self.auto_flush = auto_flush  # False: the caller flushes (e.g. to retry while a server restarts)
        self._sink: SpanSink = client.span_sink(buffer)
        info = client.describe(buffer)
        fields = info["fields"]
        self.observation_fields = {name for name, (_, _, observation) in fields.items() if observation}
        self.dtypes = {name: np.dtype(dtype) for name, (dtype, _, _) in fields.items()}
        self.shapes = {name: tuple(shape) for name, (_, shape, _) in fields.items()}
        self.frames: dict[str, Frames] = dict(info["frames"])
        self._compressed = {name: frames for name, frames in self.frames.items() if frames.compression}
        self._steps: list[dict[str, np.ndarray]] = []  # rows of the open episode not sent yet
        self._episode_id = new_episode_id()
        self._rows_sent = 0  # rows of the open episode already sent as chunks
        self._pending: list[Span] = []
        self._pending_rows = 0
        # The open episode went on as a new one (after a refusal, or its shard went down) with no step yet.
        self._restarted_episode_ends = False
        # A final row's step fields are padding (the ring's layout).
        self._step_padding = {name: np.zeros(self.shapes[name], self.dtypes[name]) for name in fields
                              if name not in self.observation_fields}
        self.episodes_written = 0
        self.closed = False

    def __enter__(self) -> EpisodeWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:  # sending now could only hide the error that ended the block
            self.closed = True

    def close(self) -> None:
        """Sends every pending span and, when an episode is open, its unsent steps as one more chunk (all
        but its last step become sampleable; the episode stays open in the buffer). Then refuses writes.
        Raises grpc.RpcError UNAVAILABLE, and stays open to be closed again, while the sink holds spans it
        cannot deliver (for a shard that is down)."""
        if self.closed:
            return
        if len(self._steps) >= 2:  # fewer go where the episode is (a new episode needs two rows)
            self._go_on_if_stranded()
        if len(self._steps) >= 2 or (self._steps and self._rows_sent):
            self._pending_rows += len(self._steps)
            self._pending.append(self._chunk(ends=False, terminated=False))
        self.flush()
        self.deliver_held()
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"EpisodeWriter for buffer {self.buffer!r} is closed")

    def _row(self, values: Mapping[str, Any], expected: set[str], call: str) -> dict[str, np.ndarray]:
        """`values` as arrays of the buffer's dtypes and shapes; ValueError naming the field otherwise.

        A value is converted within its kind (Python scalars, float64 arrays from environments into float32
        fields, ints into smaller ints) or from a narrower kind (ints into floats), never across to a
        narrower kind: a float for an int field, say, is refused rather than truncated. Ints must fit their
        field (300 into uint8 is refused, not wrapped), and finite floats theirs (1e300 into float32 is
        refused, not made inf)."""
        if set(values) != expected:
            raise ValueError(f"{call}: buffer {self.buffer!r} expects fields {sorted(expected)}, got {sorted(values)}")
        row = {}
        for name, value in values.items():
            dtype = self.dtypes[name]
            given = np.asarray(value)
            # Signed ints into an unsigned field too (numpy's same_kind refuses int64 -> uint8, Python ints
            # included): the range check below refuses the values that do not fit.
            integers = given.dtype.kind in "biu" and dtype.kind in "iu"
            if not (integers or np.can_cast(given.dtype, dtype, casting="same_kind")):
                raise ValueError(f"{call}: field {name!r} cannot be {dtype}: got {given.dtype} values")
            # A copy: the row is sent later, and a caller may reuse its array (an env writing each
            # observation into one buffer); a view would store whatever that array holds by then.
            with np.errstate(over="ignore"):  # an overflow is refused below, not only warned about
                array = given.astype(dtype, copy=True)
            # An int that wrapped, or a float too large for a narrower float field (1e300 into float32: inf).
            wrapped = dtype.kind in "iu" and not np.array_equal(array, given)
            overflowed = dtype.kind == "f" and (np.isfinite(given) & ~np.isfinite(array)).any()
            if wrapped or overflowed:
                raise ValueError(f"{call}: field {name!r} cannot be {dtype}: values out of its range")
            row[name] = self._frame(call, name, array)
        return row

    def _frame(self, call: str, name: str, array: np.ndarray) -> np.ndarray:
        """The row of field `name` that `array` gives: itself, or the newest frame of a stacked observation."""
        shape, frames = self.shapes[name], self.frames.get(name)
        if array.shape == shape:
            return array
        if frames is None:
            raise ValueError(f"{call}: field {name!r} expected shape {shape}, got {array.shape}")
        stacked = stacked_shape(shape, frames.stack, frames.stack_axis)
        if array.shape != stacked:
            raise ValueError(f"{call}: field {name!r} expected a frame of shape {shape} or a stack of shape "
                             f"{stacked}, got {array.shape}")
        return np.array(array[-1] if frames.stack_axis == 0 else array[..., -1])  # a copy of the frame alone

    def append(self, **step: Any) -> None:
        """Adds one step of the open episode: its observation fields and step fields, one value each (checked
        against the schema: a ValueError naming the field, and nothing changes). Every `chunk_rows` steps of
        a long episode go to the server as a chunk."""
        self._check_open()
        self._steps.append(self._row(step, set(self.dtypes), "append"))
        if len(self._steps) >= self.chunk_rows:
            self._go_on_if_stranded()
            self._pending.append(self._chunk(ends=False, terminated=False))
            self._pending_rows += self.chunk_rows
            if self.auto_flush:
                self.flush()

    def end_episode(self, terminated: bool, **final_observation: Any) -> None:
        """Closes the episode with its final observation (the state after the last step)."""
        self._check_open()
        final_row = self._row(final_observation, self.observation_fields, "end_episode")
        if self._steps:  # with none, the end goes where the episode is (held there while that shard is down)
            self._go_on_if_stranded()
        if not self._steps and self._rows_sent == 0:
            if self._restarted_episode_ends:  # its steps all went with the earlier spans: nothing to store
                self._restarted_episode_ends = False
                return
            raise ValueError("end_episode: the episode has no steps")
        self._restarted_episode_ends = False
        self._steps.append({**final_row, **self._step_padding})
        span = self._chunk(ends=True, terminated=terminated)
        self._pending.append(span)
        self._pending_rows += span.rows
        self._episode_id = new_episode_id()
        self._rows_sent = 0
        self.episodes_written += 1
        if self.auto_flush and self._pending_rows >= self.batch_rows:
            self.flush()

    def _go_on_if_stranded(self) -> None:
        """An open episode whose spans went to a shard that is down now goes on as a new episode from its unsent
        steps (called when there are some; its sent spans stay on that shard, an open episode there)."""
        if self._rows_sent and self._sink.stranded(self._episode_id):
            self._go_on_as_new_episode()

    def _go_on_as_new_episode(self) -> None:
        self._episode_id, self._rows_sent = new_episode_id(), 0
        self._restarted_episode_ends = not self._steps

    def _chunk(self, ends: bool, terminated: bool) -> Span:
        columns = compress_columns({name: np.stack([step[name] for step in self._steps]) for name in self.dtypes},
                                   self._compressed)
        # The offset names the chunk (with the episode id), so a retried flush stores it once.
        span = Span(columns, self._episode_id, begins=self._rows_sent == 0, ends=ends, terminated=terminated,
                    offset=self._rows_sent)
        self._rows_sent += len(self._steps)
        self._steps = []
        return span

    def deliver_held(self) -> None:
        """Delivers the spans the sink holds for shards that were down (later flushes send them too); raises
        grpc.RpcError UNAVAILABLE while a shard they wait for is still down. One server's sink holds none."""
        self._sink.deliver_held()

    @property
    def pending_rows(self) -> int:
        """Rows of completed episodes held for the next flush."""
        return self._pending_rows

    def flush(self) -> None:
        """Sends every pending span in one stream (completed episodes and chunks, in order; requests of up
        to the client's `max_request_bytes`)."""
        if not self._pending:
            return
        try:
            self._sink.send(self._pending)
        except grpc.RpcError as exc:
            if exc.code() in RECONNECT:
                raise  # kept for the next flush (the server stores a span sent twice once)
            refusal = self._send_one_episode_at_a_time()
            if refusal is not None:
                raise refusal from exc
        self._pending, self._pending_rows = [], 0

    def _send_one_episode_at_a_time(self) -> grpc.RpcError | None:
        """After a refused flush: stores what the server accepts and drops what it refuses (an open episode
        among those goes on as a new one); returns the first refusal. Keeps the rest pending and raises
        when the server becomes unreachable."""
        episodes = [list(spans) for _, spans in itertools.groupby(self._pending, key=lambda span: span.episode_id)]
        first_refusal = None
        for sent, spans in enumerate(episodes):
            try:
                self._sink.send(spans)
            except grpc.RpcError as exc:
                if exc.code() in RECONNECT:
                    self._pending = [span for later in episodes[sent:] for span in later]
                    self._pending_rows = sum(span.rows for span in self._pending)
                    raise
                first_refusal = first_refusal or exc
                if spans[-1].ends:
                    self.episodes_written -= 1
                elif spans[0].episode_id == self._episode_id:
                    self._go_on_as_new_episode()
        self._pending, self._pending_rows = [], 0
        return first_refusal
