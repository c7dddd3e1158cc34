"""A pure tensor function compiled ahead by inductor, one compiled graph per input signature.

``torch.compile`` checks dynamo's guards on every call; on a CartPole Q-loss step that measured
55-80 us of a ~180 us call (bench/bench_trainers.py).  Here a function of tensors alone (no
mutation, no Python state read) is traced once per input signature with ``make_fx`` and compiled
by inductor's ``standalone_compile`` with ``cpp_wrapper`` (the compiled kernels are called from
C++, not through a Python wrapper); the guard is a dict lookup on the tensors' shapes, strides,
dtypes and devices and the static arguments.

Costs: a C++ compiler when a signature is first seen (inductor's CPU code is C++; inductor names
the missing compiler if there is none), and seconds per new signature (about 15 s for the first
graph of a process on a cold inductor cache, 3 s for the next, under 1 s from the on-disk cache).
``standalone_compile`` is an underscored (provisional) API: the torch pin in constraints.txt is the
version this is tested with.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["CompiledFunction"]


class CompiledFunction:
    """``fn(*weights..., *inputs, **static)`` through the graph compiled for their signature and ``static``.

    ``fn`` must return a tuple of tensors and read nothing but its arguments: the compiled graph
    replays the operations traced on the first call with that signature.  Not for concurrent calls
    from several threads (the weights' memo is one pair of attributes).
    """

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]]) -> None:
        self.fn = fn
        self._graphs: dict[tuple, Callable[..., Sequence[Tensor]]] = {}
        self._weights: tuple[tuple[Tensor, ...], ...] = ()  # the groups last seen, and derived from them:
        self._flat_weights: tuple[Tensor, ...] = ()
        self._weights_signature: tuple = ()

    def __call__(self, weights: Sequence[tuple[Tensor, ...]], inputs: Sequence[Tensor],
                 **static: Hashable) -> Sequence[Tensor]:
        """``weights``: groups of tensors that stay the same objects from call to call (a network's
        parameters, updated in place); a group that is the same tuple object as in the previous call
        is not signed again (reading 12 tensors' signatures costs ~4 us), so a caller hands out a new
        tuple when a tensor in it changes shape, strides, dtype or device (``QNetwork.weight_views``)."""
        if len(weights) != len(self._weights) or any(a is not b for a, b in zip(weights, self._weights, strict=False)):
            flat = tuple(t for group in weights for t in group)
            signature = tuple(_signature(t) for t in flat)
            self._weights, self._flat_weights, self._weights_signature = tuple(weights), flat, signature
        # The compiled code is specialized to all of these: a graph called with other shapes would
        # read out of bounds without an error.
        key = (tuple(static.items()), self._weights_signature, *(_signature(t) for t in inputs))
        tensors = [*self._flat_weights, *inputs]
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._compile(tensors, static)
        return graph(*tensors)

    @property
    def compiled_graphs(self) -> int:
        return len(self._graphs)

    def _compile(self, tensors: list[Tensor], static: dict[str, Hashable]) -> Callable[..., Sequence[Tensor]]:
        def traced(*args: Tensor) -> tuple[Tensor, ...]:
            return self.fn(*args, **static)

        from torch._inductor import config, standalone_compile  # about 1 s to import: only where used

        # The compiler folds an argument that is the same tensor object as an earlier one into it: the graph
        # would then read the earlier argument for both, also in later calls with distinct tensors (the
        # target network passed as the online one, say). Each slot gets its own example tensor.
        seen: set[int] = set()
        examples = []
        for tensor in tensors:
            if id(tensor) in seen:
                tensor = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                             device=tensor.device).copy_(tensor)
            seen.add(id(tensor))
            examples.append(tensor)
        tensors = examples
        with torch.no_grad():
            graph_module = make_fx(traced)(*tensors)
        with config.patch(cpp_wrapper=True):
            return standalone_compile(graph_module, tensors, dynamic_shapes="from_example_inputs")


def _signature(tensor: Tensor) -> tuple:
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.device
