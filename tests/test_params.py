"""module_to_bytes / load_module_bytes: any module's parameters survive the round trip."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from replayd.client.params import load_module_bytes, module_to_bytes


def atari_conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2))


def linear_with_transposed_weight() -> nn.Module:
    linear = nn.Linear(3, 2)
    linear.weight = nn.Parameter(torch.randn(3, 2).t())  # shape (2, 3), strides (1, 2): not contiguous
    return linear


def tied_linears() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight  # two names, one storage
    return model


@pytest.mark.parametrize("make, make_empty", [
    # channels_last, a common speed-up for conv nets, makes every 4-d weight non-contiguous
    pytest.param(lambda: atari_conv().to(memory_format=torch.channels_last), atari_conv, id="channels_last conv"),
    pytest.param(linear_with_transposed_weight, lambda: nn.Linear(3, 2), id="transposed weight"),
    pytest.param(tied_linears, tied_linears, id="tied weights"),
])
def test_parameters_round_trip(make: Callable[[], nn.Module], make_empty: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    published = make()
    loaded = make_empty()
    load_module_bytes(loaded, module_to_bytes(published))
    for (name, expected), (_, got) in zip(published.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(got, expected), name
