"""torch modules <-> safetensors bytes for parameter broadcast (no pickle crosses the wire)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def module_to_bytes(module: nn.Module) -> bytes:
    import torch
    from safetensors.torch import save

    # A contiguous copy per entry: tied parameters share storage, which safetensors refuses to save twice, and
    # it refuses non-contiguous tensors (channels_last convs, transposed weights), which clone() alone keeps.
    return save({name: tensor.detach().cpu().clone(memory_format=torch.contiguous_format)
                 for name, tensor in module.state_dict().items()})


def load_module_bytes(module: nn.Module, payload: bytes) -> None:
    """Loads published weights into `module` (strict: names and shapes must match)."""
    from safetensors.torch import load

    module.load_state_dict(load(payload), strict=True)
