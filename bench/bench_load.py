"""Load test: 16 inserting clients and 2 sampling clients against one server subprocess on loopback.

    .venv/bin/python -m bench.bench_load [--quick]      # JSON lines on stdout

The 16 inserters are threads, each with its own ReplayClient (channel), spread over INSERT_PROCESSES
worker processes (spawned: each has its own GIL, as separate actors would); half send whole episodes
(EPISODES_PER_REQUEST per request), half send each episode as two chunks of an open episode (so the
span offsets of exactly-once inserts are exercised). Payloads are prebuilt per thread; each request
gets fresh episode ids. The 2 samplers are threads of this process calling unary `sample` (transitions,
batch 256, wait=True). Everything runs for SECONDS (quick: QUICK_SECONDS) and stops by itself; every
call has a deadline, and a worker that fails to report is killed.

Reported: insert and sample throughput, p50/p99 latency per call, errors (calls that failed after the
client's retries; expected 0), and episodes acknowledged to clients against episodes the buffer stored
(its `inserted_episodes` counter, which never counts an acknowledged duplicate; expected equal).
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import sys
import threading
import time

import grpc
import numpy as np

from bench.bench_replay import ServerProcess
from replayd.client.replay_client import ReplayClient, Span, new_episode_id, spans_request
from replayd.wire import replay_pb2 as pb
from replayd.wire.frames import InsertFrame

SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}
BUFFER = "load"
CAPACITY = 1_000_000
INSERTERS = 16
INSERT_PROCESSES = 2
SAMPLERS = 2
SECONDS = 60.0
QUICK_SECONDS = 10.0
EPISODES_PER_REQUEST = 4
MIN_LEN, MAX_LEN = 50, 200
SAMPLE_BATCH = 256
CALL_TIMEOUT = 30.0


def record(case: str, metric: str, value: float, unit: str) -> dict:
    return {"bench": "load", "case": case, "metric": metric, "value": float(value), "unit": unit,
            "baseline": "", "baseline_value": 0.0, "speedup": 0.0}


def _rows(rng: np.random.Generator, count: int) -> dict[str, np.ndarray]:
    return {"obs": rng.normal(size=(count, 4)).astype(np.float32), "action": rng.integers(0, 2, count),
            "reward": np.ones(count, np.float32)}


def _with_ids(frame: InsertFrame, episode_ids: list[int]) -> InsertFrame:
    """The prebuilt request with fresh episode ids (the Arrow payload is shared, not re-encoded)."""
    request = pb.InsertRequest()
    request.CopyFrom(frame.request)
    del request.episode_ids[:]
    request.episode_ids.extend(episode_ids)
    return InsertFrame(request, frame.steps)


class _Inserter:
    """One inserting client: whole-episode batches, or episodes as two chunks each."""

    def __init__(self, address: str, index: int, deadline: float) -> None:
        self.client = ReplayClient(address, timeout=CALL_TIMEOUT)
        self.index = index
        self.chunked = index % 2 == 1
        self.deadline = deadline
        rng = np.random.default_rng(index)
        if self.chunked:
            length = int(rng.integers(MIN_LEN, MAX_LEN))
            split = length // 2
            self.first = spans_request(BUFFER, [Span(_rows(rng, split), 0, begins=True, ends=False)])
            self.last = spans_request(BUFFER, [Span(_rows(rng, length + 1 - split), 0, begins=False, ends=True,
                                                    terminated=True, offset=split)])
            self.steps_per_episode = length
        else:
            lengths = rng.integers(MIN_LEN, MAX_LEN, EPISODES_PER_REQUEST)
            self.batch = spans_request(BUFFER, [Span(_rows(rng, int(n) + 1), 0, terminated=bool(k % 2))
                                                for k, n in enumerate(lengths)])
            self.steps_per_request = int(lengths.sum())
        self.latencies: list[float] = []
        self.acknowledged = self.steps = self.errors = self.duplicates = 0
        self.error_codes: dict[str, int] = {}

    def _call(self, frame: InsertFrame) -> pb.InsertResponse | None:
        start = time.perf_counter()
        try:
            response = self.client.insert([frame])
        except grpc.RpcError as exc:
            self.errors += 1
            self.error_codes[str(exc.code())] = self.error_codes.get(str(exc.code()), 0) + 1
            return None
        self.latencies.append(time.perf_counter() - start)
        self.duplicates += response.duplicate_spans
        return response

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                if self.chunked:
                    episode_id = new_episode_id()
                    if self._call(_with_ids(self.first, [episode_id])) is None:
                        continue
                    response = self._call(_with_ids(self.last, [episode_id]))  # always closes what it opened
                    if response is not None:
                        self.acknowledged += response.episodes_completed
                        self.steps += self.steps_per_episode
                else:
                    ids = [new_episode_id() for _ in range(EPISODES_PER_REQUEST)]
                    response = self._call(_with_ids(self.batch, ids))
                    if response is not None:
                        self.acknowledged += response.episodes_completed
                        self.steps += self.steps_per_request
        finally:
            self.client.close()

    def report(self) -> dict:
        return {"latencies": self.latencies, "acknowledged": self.acknowledged, "steps": self.steps,
                "errors": self.errors, "error_codes": self.error_codes, "duplicates": self.duplicates,
                "requests": len(self.latencies)}


def insert_worker(address: str, indices: list[int], begin: float, deadline: float,
                  results: multiprocessing.Queue) -> None:
    """A worker process: one thread per inserter from `begin` to `deadline` (time.monotonic(), which is
    system-wide); puts one report per inserter on `results`."""
    time.sleep(max(0.0, begin - time.monotonic()))
    inserters = [_Inserter(address, i, deadline) for i in indices]
    threads = [threading.Thread(target=inserter.run) for inserter in inserters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for inserter in inserters:
        results.put(inserter.report())


class _Sampler:
    def __init__(self, address: str, deadline: float) -> None:
        self.client = ReplayClient(address, timeout=CALL_TIMEOUT)
        self.deadline = deadline
        self.latencies: list[float] = []
        self.errors = 0

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                start = time.perf_counter()
                try:
                    self.client.sample(BUFFER, SAMPLE_BATCH, wait=True, timeout=10)
                except grpc.RpcError:
                    self.errors += 1
                    continue
                self.latencies.append(time.perf_counter() - start)
        finally:
            self.client.close()


def _ms(latencies: list[float], q: float) -> float:
    return float(np.percentile(latencies, q)) * 1e3 if latencies else 0.0


def run(quick: bool = False) -> list[dict]:
    seconds = QUICK_SECONDS if quick else SECONDS
    server = ServerProcess()
    context = multiprocessing.get_context("spawn")  # gRPC does not survive fork
    results = context.Queue()
    workers: list[multiprocessing.Process] = []
    try:
        with ReplayClient(server.address, timeout=CALL_TIMEOUT) as admin:
            admin.wait_ready(30)
            admin.create_buffer(BUFFER, CAPACITY, SCHEMA)
            start_delay = 5.0  # spawned workers import numpy and grpc first
            begin = time.monotonic() + start_delay
            deadline = begin + seconds
            per_process = [list(range(INSERTERS))[p::INSERT_PROCESSES] for p in range(INSERT_PROCESSES)]
            workers = [context.Process(target=insert_worker, args=(server.address, indices, begin, deadline, results),
                                       daemon=True)
                       for indices in per_process]
            for worker in workers:
                worker.start()
            time.sleep(max(0.0, begin - time.monotonic()))
            started = time.perf_counter()
            samplers = [_Sampler(server.address, deadline) for _ in range(SAMPLERS)]
            sampler_threads = [threading.Thread(target=s.run) for s in samplers]
            for thread in sampler_threads:
                thread.start()
            reports = []
            for _ in range(INSERTERS):  # bounded: a worker that hangs is killed below
                try:
                    reports.append(results.get(timeout=seconds + 2 * CALL_TIMEOUT + 30))
                except queue.Empty:
                    break
            for thread in sampler_threads:
                thread.join()
            elapsed = time.perf_counter() - started
            info = admin.describe(BUFFER)
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
        server.stop()

    counters = info["counters"]
    insert_latencies = [x for r in reports for x in r["latencies"]]
    sample_latencies = [x for s in samplers for x in s.latencies]
    acknowledged = sum(r["acknowledged"] for r in reports)
    stored = int(counters.get("inserted_episodes", 0))
    insert_errors = sum(r["errors"] for r in reports) + (INSERTERS - len(reports))  # a missing report is an error
    sample_errors = sum(s.errors for s in samplers)
    case = (f"{INSERTERS} inserters ({INSERT_PROCESSES} processes; half whole x{EPISODES_PER_REQUEST}, half 2 chunks) "
            f"+ {SAMPLERS} samplers (batch {SAMPLE_BATCH}), {seconds:.0f}s loopback")
    out = [
        record(case, "insert_requests_per_s", len(insert_latencies) / elapsed, "requests/s"),
        record(case, "insert_episodes_per_s", acknowledged / elapsed, "episodes/s"),
        record(case, "insert_steps_per_s", sum(r["steps"] for r in reports) / elapsed, "steps/s"),
        record(case, "insert_p50_latency", _ms(insert_latencies, 50), "ms"),
        record(case, "insert_p99_latency", _ms(insert_latencies, 99), "ms"),
        record(case, "sample_batches_per_s", len(sample_latencies) / elapsed, "batches/s"),
        record(case, "sample_transitions_per_s", len(sample_latencies) * SAMPLE_BATCH / elapsed, "transitions/s"),
        record(case, "sample_p50_latency", _ms(sample_latencies, 50), "ms"),
        record(case, "sample_p99_latency", _ms(sample_latencies, 99), "ms"),
        record(case + " (expected 0)", "insert_errors", insert_errors, "calls"),
        record(case + " (expected 0)", "sample_errors", sample_errors, "calls"),
        record(case, "acknowledged_episodes", acknowledged, "episodes"),
        record(case + " (expected = acknowledged)", "stored_episodes", stored, "episodes"),
        record(case, "duplicate_spans", counters.get("duplicate_spans", 0), "spans"),
        record(case + " (expected 0)", "open_episodes_left", counters.get("open_episodes", 0), "episodes"),
    ]
    codes: dict[str, int] = {}
    for r in reports:
        for code, n in r["error_codes"].items():
            codes[code] = codes.get(code, 0) + n
    if codes:
        print(f"bench_load: insert errors by code: {codes}", file=sys.stderr)
    return out


if __name__ == "__main__":
    for item in run(quick="--quick" in sys.argv):
        print(json.dumps(item))
