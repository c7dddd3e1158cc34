import grpc
import pytest
import torch

from client import ReplayClient
from client.params import load_module_bytes, module_to_bytes


def test_publish_and_fetch_newest_version(client: ReplayClient) -> None:
    learner = torch.nn.Linear(4, 2)
    assert client.fetch_weights("q") is None
    assert client.publish_weights("q", 1, module_to_bytes(learner))
    actor = torch.nn.Linear(4, 2)
    version, payload = client.fetch_weights("q", newer_than=0)
    load_module_bytes(actor, payload)
    assert version == 1 and torch.equal(actor.weight, learner.weight)
    assert client.fetch_weights("q", newer_than=1) is None  # nothing newer
    with torch.no_grad():
        learner.weight.add_(1.0)
    assert client.publish_weights("q", 3, module_to_bytes(learner))
    assert not client.publish_weights("q", 2, module_to_bytes(learner))  # not newer: ignored
    version, payload = client.fetch_weights("q", newer_than=1)
    load_module_bytes(actor, payload)
    assert version == 3 and torch.equal(actor.weight, learner.weight)


def test_non_safetensors_payload_is_rejected(client: ReplayClient) -> None:
    import pickle

    with pytest.raises(grpc.RpcError) as error:
        client.publish_weights("q", 1, pickle.dumps({"w": [1, 2]}))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "safetensors" in error.value.details()
