"""The bare-gRPC baseline of `make bench` (bench/baselines/grpc_sink.py) moves every byte it is timed on, and
the CPU meter the gRPC bench reads beside each pass tells the server's CPU from this process's."""

import time

import pytest

from bench.baselines.grpc_sink import GrpcSink
from bench.subprocesses import CpuMeter
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


def test_cpu_meter_reads_the_server_then_this_process(sink: GrpcSink) -> None:
    meter = CpuMeter(sink.process.pid)
    start = meter.read()
    busy_until = time.process_time() + 0.3
    while time.process_time() < busy_until:  # CPU in this process only; the sink server idles
        pass
    server, client = meter.read() - start
    assert client >= 0.3
    assert server < 0.15
    start = meter.read()
    sink.repeat_seconds(50, 8 << 20)  # the server copies 400 MB into its sends
    server, client = meter.read() - start
    assert server > 0.01
    assert client > 0.01
