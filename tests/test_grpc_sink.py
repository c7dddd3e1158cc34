"""The bare-gRPC baseline of `make bench` (bench/baselines/grpc_sink.py) moves every byte it is timed on."""


import pytest

from bench.baselines.grpc_sink import GrpcSink
from tests.conftest import free_port


@pytest.fixture
def sink() -> GrpcSink:
    sink = GrpcSink(free_port())
    yield sink
    sink.close()
    assert sink.process.poll() is not None  # the server process is gone


# Both timings raise unless the other end counted every byte. 6 MiB messages are above gRPC's 4 MB default:
# the raised limits are in force on both ends.

def test_drain_takes_a_client_stream_whole(sink: GrpcSink) -> None:
    assert sink.drain_seconds([b"a" * (6 << 20), b"", b"bc"]) > 0


def test_repeat_sends_the_asked_messages(sink: GrpcSink) -> None:
    assert sink.repeat_seconds(3, 6 << 20) > 0
