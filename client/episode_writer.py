"""EpisodeWriter: an actor appends steps; whole episodes are batched into few requests, and long
episodes go out as chunks so their steps become sampleable before the episode ends."""

from __future__ import annotations

from typing import Any

import numpy as np

from client.replay_client import ReplayClient, Span, new_episode_id, spans_requests


class EpisodeWriter:
    """Writes one actor's episodes into an episodic buffer.

    `append(obs=..., action=..., reward=...)` once per step (the observation the action was taken in),
    then `end_episode(terminated, obs=final_obs)`. Completed episodes wait until `batch_rows` rows are
    pending (or `flush()`); an open episode is sent as a chunk every `chunk_rows` rows. `close()` (or
    leaving a `with EpisodeWriter(...) as writer:` block without an exception) sends what is left.
    """

    def __init__(self, client: ReplayClient, buffer: str, chunk_rows: int = 1000, batch_rows: int = 4096,
                 auto_flush: bool = True) -> None:
        if chunk_rows < 2:
            raise ValueError(f"chunk_rows must be >= 2, got {chunk_rows}")
        self.client = client
        self.buffer = buffer
        self.chunk_rows = chunk_rows
        self.batch_rows = batch_rows
        self.auto_flush = auto_flush  # False: the caller flushes (e.g. to retry while a server restarts)
        fields = client.describe(buffer)["fields"]
        self.observation_fields = {name for name, (_, _, observation) in fields.items() if observation}
        self.dtypes = {name: np.dtype(dtype) for name, (dtype, _, _) in fields.items()}
        self._steps: list[dict[str, Any]] = []  # rows of the open episode not sent yet
        self._episode_id = new_episode_id()
        self._rows_sent = 0  # rows of the open episode already sent as chunks
        self._pending: list[Span] = []
        self._pending_rows = 0
        self._step_template: dict[str, np.ndarray] | None = None
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
        but its last step become sampleable; the episode stays open in the buffer). Then refuses writes."""
        if self.closed:
            return
        if len(self._steps) >= 2 or (self._steps and self._rows_sent):
            self._pending_rows += len(self._steps)
            self._pending.append(self._chunk(ends=False, terminated=False))
        self.flush()
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"EpisodeWriter for buffer {self.buffer!r} is closed")

    def append(self, **step: Any) -> None:
        self._check_open()
        self._steps.append(step)
        if self._step_template is None:
            self._step_template = {n: np.zeros_like(np.asarray(v, dtype=self.dtypes.get(n))) for n, v in step.items()
                                   if n not in self.observation_fields}
        if len(self._steps) >= self.chunk_rows:
            self._pending.append(self._chunk(ends=False, terminated=False))
            self._pending_rows += self.chunk_rows
            if self.auto_flush:
                self.flush()

    def end_episode(self, terminated: bool, **final_observation: Any) -> None:
        """Closes the episode with its final observation (the state after the last step)."""
        self._check_open()
        missing = self.observation_fields - set(final_observation)
        if missing:
            raise ValueError(f"end_episode needs the final observation fields {sorted(missing)}")
        if not self._steps and self._rows_sent == 0:
            raise ValueError("end_episode: the episode has no steps")
        self._steps.append({**final_observation, **(self._step_template or {})})
        span = self._chunk(ends=True, terminated=terminated)
        self._pending.append(span)
        self._pending_rows += len(next(iter(span.columns.values())))
        self._episode_id = new_episode_id()
        self._rows_sent = 0
        self.episodes_written += 1
        if self.auto_flush and self._pending_rows >= self.batch_rows:
            self.flush()

    def _chunk(self, ends: bool, terminated: bool) -> Span:
        names = self._steps[0].keys()
        # Python scalars and float64 arrays from environments are cast to the buffer's declared dtypes.
        columns = {name: np.asarray([step[name] for step in self._steps], dtype=self.dtypes.get(name))
                   for name in names}
        # The offset names the chunk (with the episode id), so a retried flush stores it once.
        span = Span(columns, self._episode_id, begins=self._rows_sent == 0, ends=ends, terminated=terminated,
                    offset=self._rows_sent)
        self._rows_sent += len(self._steps)
        self._steps = []
        return span

    @property
    def pending_rows(self) -> int:
        return self._pending_rows

    def flush(self) -> None:
        """Sends every pending span in one stream (completed episodes and chunks, in order; requests of up
        to the client's `max_request_bytes`)."""
        if self._pending:
            self.client.insert(spans_requests(self.buffer, self._pending, self.client.max_request_bytes))
            self._pending, self._pending_rows = [], 0
