"""Bare gRPC streams of bytes: the ceiling grpcio itself puts on an insert or a sample stream here.

A server process (its own GIL, as ours runs) with two methods and no codec: `Drain` takes a client
stream of messages and drops them (the bytes our insert requests are); `Repeat` sends one prepared
message a number of times (the bytes of a sample batch). Both ends use the message limits our client
and server use. What the transfers cost beyond these is replayd's own work.

    .venv/bin/python -m bench.baselines.grpc_sink serve --port N      # what GrpcSink starts
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path

import grpc

from bench import subprocesses
from replayd.wire.channel import DEFAULT_MAX_MESSAGE_BYTES, channel_options

_SERVICE = "replayd.bench.Sink"
_COUNTS = struct.Struct("<QQ")  # Repeat's request: messages, bytes per message


def serve(port: int) -> None:
    prepared: dict[int, bytes] = {}

    def drain(messages: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return struct.pack("<Q", sum(len(message) for message in messages))

    def repeat(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        count, size = _COUNTS.unpack(request)
        message = prepared.setdefault(size, bytes(size))
        for _ in range(count):
            yield message

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=channel_options(DEFAULT_MAX_MESSAGE_BYTES))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(_SERVICE, {
        "Drain": grpc.stream_unary_rpc_method_handler(drain),
        "Repeat": grpc.unary_stream_rpc_method_handler(repeat),
    })])
    if server.add_insecure_port(f"127.0.0.1:{port}") != port:
        raise SystemExit(f"grpc sink: cannot listen on 127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


class GrpcSink:
    """The sink server in a subprocess on `port`, and a client channel to it."""

    def __init__(self, port: int) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "bench.baselines.grpc_sink", "serve", "--port",
                                         str(port)], cwd=Path(__file__).resolve().parents[2])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options(DEFAULT_MAX_MESSAGE_BYTES))
        self._drain = self.channel.stream_unary(f"/{_SERVICE}/Drain")
        self._repeat = self.channel.unary_stream(f"/{_SERVICE}/Repeat")
        try:
            grpc.channel_ready_future(self.channel).result(timeout=30)
        except grpc.FutureTimeoutError:
            self.close()
            raise RuntimeError(f"grpc sink on port {port} did not start within 30 s "
                               f"(exit code {self.process.returncode})") from None

    def drain_seconds(self, messages: Sequence[bytes]) -> float:
        """Seconds to stream `messages` to the server in one call, until it has answered."""
        start = time.perf_counter()
        received = struct.unpack("<Q", self._drain(iter(messages), timeout=600))[0]
        elapsed = time.perf_counter() - start
        if received != sum(len(message) for message in messages):
            raise RuntimeError(f"grpc sink received {received} bytes of {sum(map(len, messages))}")
        return elapsed

    def repeat_seconds(self, count: int, size: int) -> float:
        """Seconds to receive `count` messages of `size` bytes in one server stream."""
        start = time.perf_counter()
        received = sum(len(message) for message in self._repeat(_COUNTS.pack(count, size), timeout=600))
        elapsed = time.perf_counter() - start
        if received != count * size:
            raise RuntimeError(f"grpc sink sent {received} bytes of {count * size}")
        return elapsed

    def close(self) -> None:
        self.channel.close()
        subprocesses.stop(self.process)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--port", type=int, required=True)
    serve(parser.parse_args().port)
