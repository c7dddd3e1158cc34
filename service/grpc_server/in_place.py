"""A sample stream's messages, with its batches gathered straight into them.

gRPC sends bytes, and a batch encoded the usual way is copied into its message once after the gather
(frames.sample_response_bytes). A stream repeats one layout, so once the codec has learned it (from the
stream's second batch on), each message is allocated whole first and the batch mode's kernels gather the
columns into views of it: the gather is then the only copy between the ring and gRPC's own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from replayd.server import kernels
from replayd.server.buffers.stacking import Shipped
from replayd.server.modes.base import BatchMode
from replayd.server.samplers.draw import Draw
from replayd.wire import codec
from replayd.wire.frames import SAMPLE_RESPONSE_HEAD_BYTES, sample_response_head

# Below this payload size, copying the batch once costs less than laying out the views (~20 µs).
IN_PLACE_MIN_BYTES = 256 * 2**10
# The codec knows a layout from its second batch on; a stream whose layout it does not know by its third
# batch (one Arrow frames differently) stops asking: asking costs ~10 µs a batch.
_TRIES = 3


class _IntoViews:
    """`mode`, gathering every batch into the given views (BatchMode.gather's `batch`); `built` names the
    columns its last batch came back with."""

    def __init__(self, mode: BatchMode, views: dict[str, np.ndarray]) -> None:
        self.mode, self.views = mode, views
        self.built: tuple[str, ...] = ()

    def check(self, ring) -> None:
        self.mode.check(ring)

    def admit(self, ring, draw: Draw) -> np.ndarray | None:
        return self.mode.admit(ring, draw)

    def refusal(self, ring) -> str | None:
        return self.mode.refusal(ring)

    def item_bytes(self, ring) -> int:
        return self.mode.item_bytes(ring)

    def gather(self, ring, draw: Draw, rng: np.random.Generator, batch: dict[str, np.ndarray] | None = None,
               shipped: list[Shipped] | None = None) -> dict[str, np.ndarray]:
        built = self.mode.gather(ring, draw, rng, dict(self.views), shipped)
        self.built = tuple(built)
        return built


class InPlaceMessages:
    """The serialized SampleResponses of one stream of batches of `mode`."""

    def __init__(self, mode: BatchMode, encode: Callable[[dict[str, np.ndarray]], bytes]) -> None:
        self.mode = mode
        self.encode = encode  # batch -> message, the usual way (it also checks the message's size)
        self.layout: codec.InPlace | None = None
        # The columns the mode builds: only these get views to write into. Any other column of the layout
        # (keys, weights: set after the mode) must be set again each batch, so that one no longer set
        # changes the layout instead of going out as whatever the new message's memory held.
        self.mode_columns: tuple[str, ...] = ()
        self.tries = _TRIES  # batches left to learn the stream's layout from
        self.in_place = 0  # messages written in place so far

    def next(self, sample: Callable[[BatchMode], dict[str, np.ndarray]]) -> bytes:
        """The next message; `sample(mode)` draws its batch."""
        layout = self.layout
        if layout is None:
            mode = _IntoViews(self.mode, {})
            batch = sample(mode)
            message = self.encode(batch)
            if self.tries:
                self.tries -= 1
                learned = codec.in_place(batch)
                if learned is not None:
                    self.tries = 0
                    self.layout = learned if learned.size >= IN_PLACE_MIN_BYTES else None
                    self.mode_columns = mode.built
            return message
        message, buffer = kernels.new_bytes(SAMPLE_RESPONSE_HEAD_BYTES + layout.size)
        if buffer.__array_interface__["data"][0] % 8:  # CPython aligns bytes data; views would not be aligned
            return self.encode(sample(self.mode))
        buffer[:SAMPLE_RESPONSE_HEAD_BYTES] = np.frombuffer(sample_response_head(layout.size), np.uint8)
        views = layout.views(buffer[SAMPLE_RESPONSE_HEAD_BYTES:])
        batch = sample(_IntoViews(self.mode, {name: views[name] for name in self.mode_columns}))
        if layout.written(batch, views):
            self.in_place += 1
            return message
        self.layout, self.tries = None, _TRIES  # the layout changed: learn the new one
        return self.encode(batch)
