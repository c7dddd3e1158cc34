"""Plain loopback TCP bandwidth: the ceiling for any gRPC transfer on this machine.

A receiver thread `recv_into`s a preallocated buffer; the sender `sendall`s large writes from one
preallocated buffer. Both socket calls release the GIL, so one process is enough.

    .venv/bin/python -m bench.baselines.loopback_tcp [MB]
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import numpy as np

MiB = 2**20


def loopback_tcp_gbps(total_mb: int = 2048, write_mb: int = 4, repeats: int = 3) -> float:
    """Median GB/s (1e9 bytes/s) of sending `total_mb` MiB over 127.0.0.1 in `write_mb` MiB writes."""
    payload = memoryview(np.random.default_rng(0).integers(0, 256, write_mb * MiB, dtype=np.uint8).tobytes())
    total = total_mb * MiB
    rates = []
    for _ in range(repeats):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        received = [0]

        def receive(listener: socket.socket = listener, received: list[int] = received) -> None:
            conn, _ = listener.accept()
            buffer = bytearray(write_mb * MiB)
            view = memoryview(buffer)
            with conn:
                while received[0] < total:
                    n = conn.recv_into(view)
                    if n == 0:
                        break
                    received[0] += n

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        sender = socket.create_connection(listener.getsockname())
        sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sent = 0
        while sent < total:
            sender.sendall(payload)
            sent += len(payload)
        thread.join()
        elapsed = time.perf_counter() - start
        sender.close()
        listener.close()
        rates.append(received[0] / elapsed / 1e9)
    return float(np.median(rates))


if __name__ == "__main__":
    print(f"{loopback_tcp_gbps(int(sys.argv[1]) if len(sys.argv) > 1 else 2048):.2f} GB/s")
