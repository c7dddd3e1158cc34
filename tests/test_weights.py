import json
import struct

import grpc
import pytest
import torch

from replayd.client import ReplayClient
from replayd.client.params import load_module_bytes, module_to_bytes
from replayd.client.replay_client import FetchedWeights
from replayd.server.weights import MAX_NAMES


def test_publish_and_fetch_newest_version(client: ReplayClient) -> None:
    learner = torch.nn.Linear(4, 2)
    assert client.fetch_weights("q") == FetchedWeights(0, b"", False)
    assert client.publish_weights("q", 1, module_to_bytes(learner))
    actor = torch.nn.Linear(4, 2)
    fetched = client.fetch_weights("q", newer_than=0)
    load_module_bytes(actor, fetched.safetensors)
    assert fetched.version == 1 and torch.equal(actor.weight, learner.weight)
    assert client.fetch_weights("q", newer_than=1) == FetchedWeights(0, b"", False)  # nothing newer
    with torch.no_grad():
        learner.weight.add_(1.0)
    assert client.publish_weights("q", 3, module_to_bytes(learner))
    assert not client.publish_weights("q", 2, module_to_bytes(learner))  # not newer: ignored
    fetched = client.fetch_weights("q", newer_than=1)
    load_module_bytes(actor, fetched.safetensors)
    assert fetched.version == 3 and torch.equal(actor.weight, learner.weight)


def test_final_weights_tell_every_fetch_that_no_newer_version_comes(client: ReplayClient) -> None:
    blob = module_to_bytes(torch.nn.Linear(4, 2))
    assert client.publish_weights("q", 1, blob)
    assert not client.publish_weights("q", 1, blob, final=True)  # refused (not newer): nothing changes
    assert not client.fetch_weights("q").final
    assert client.publish_weights("q", 2, blob, final=True)
    assert client.fetch_weights("q", newer_than=1) == FetchedWeights(2, blob, True)
    assert client.fetch_weights("q", newer_than=2) == FetchedWeights(0, b"", True)  # an actor that has them
    assert client.publish_weights("q", 3, blob)  # a newer version (a new learner) is not final
    assert client.fetch_weights("q", newer_than=2) == FetchedWeights(3, blob, False)


def test_non_safetensors_payload_is_rejected(client: ReplayClient) -> None:
    import pickle

    with pytest.raises(grpc.RpcError) as error:
        client.publish_weights("q", 1, pickle.dumps({"w": [1, 2]}))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "safetensors" in error.value.details()


@pytest.mark.parametrize("entry, data", [
    ({"dtype": "F32", "shape": [100], "data_offsets": [0, 16]}, 16),  # shape says 400 bytes
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, 16),  # 8 trailing bytes no tensor covers
    ({"dtype": "XX", "shape": [4], "data_offsets": [0, 16]}, 16),  # no such dtype
])
def test_blobs_actors_could_not_load_are_rejected(client: ReplayClient, entry: dict, data: int) -> None:
    header = json.dumps({"w": entry}).encode()
    blob = struct.pack("<Q", len(header)) + header + bytes(data)
    with pytest.raises(grpc.RpcError) as error:
        client.publish_weights("bad", 1, blob)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "safetensors" in error.value.details()
    assert client.fetch_weights("bad").version == 0


def test_modules_with_shared_parameters_serialize() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.b.weight = self.a.weight

    source, target = Tied(), Tied()
    load_module_bytes(target, module_to_bytes(source))
    assert torch.equal(target.a.weight, source.a.weight) and torch.equal(target.b.weight, source.a.weight)


def test_weights_under_more_names_than_the_store_holds_are_refused(client: ReplayClient) -> None:
    """Without a bound a client filled the server's memory with blobs under new names (8 x 25 MB: +391 MB)."""
    blob = module_to_bytes(torch.nn.Linear(2, 1))
    for k in range(MAX_NAMES):
        assert client.publish_weights(f"w{k}", 1, blob)
    with pytest.raises(grpc.RpcError) as refused:
        client.publish_weights("one_more", 1, blob)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"the server holds weights under {MAX_NAMES} names already" in refused.value.details()
    assert client.publish_weights("w0", 2, blob)  # a newer version under a held name still replaces it
    assert client.fetch_weights("one_more") == FetchedWeights(0, b"", False)
