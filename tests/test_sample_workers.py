"""`replayd serve --sample-workers K`: worker processes serve sampling from the shared memory."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from replayd.client import ReplayClient
from replayd.server.grpc_server.sample_workers import WORKER_THREADS, SampleWorkers, SampleWorkerServicer
from replayd.server.server import ReplayServer
from replayd.server.storage.instance_lock import lock_path
from replayd.wire import codec
from replayd.wire import replay_pb2 as pb
from replayd.wire.components import Hindsight, MaxTimesSampled, Prioritized, Sequences, Transitions
from replayd.wire.errors import InvalidArgument, NotFound
from replayd.wire.frames import sample_response_batch
from tests.conftest import TEST_INSTANCE, free_port

SCHEMA = {"obs": ("float32", (4,)), "action": ("int64", ()), "reward": ("float32", ())}


@pytest.fixture
def worker_server():
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}w", sample_workers=2).start()
    yield server
    server.stop(grace=0)


def fill(client: ReplayClient, name: str, **create) -> None:
    client.create_buffer(name, 10_000, SCHEMA, **create)
    rng = np.random.default_rng(0)
    client.insert_episodes(name, [{"obs": rng.normal(size=(n + 1, 4)).astype(np.float32),
                                   "action": rng.integers(0, 2, n), "reward": np.ones(n, np.float32)}
                                  for n in rng.integers(5, 50, 30)], [True] * 30)


def test_workers_serve_sampling_with_the_servers_results(worker_server: ReplayServer) -> None:
    with ReplayClient(worker_server.address) as client, \
            ReplayClient(worker_server.address, use_sample_workers=False) as direct:
        fill(client, "uniform")
        info = client.describe("uniform")
        assert sorted(int(e.rsplit(":", 1)[1]) for e in info["sample_endpoints"]) == sorted(
            worker_server.sample_workers.ports)
        # Each description lists the workers rotated, so that clients spread their streams over them.
        again = client.describe("uniform")["sample_endpoints"]
        assert sorted(again) == sorted(info["sample_endpoints"]) and again[0] != info["sample_endpoints"][0]
        for _ in range(3):  # round-robin over both workers: same seed, same batch as the server's own
            batch = client.sample("uniform", 64, mode=Transitions(n_step=3), seed=5, include_keys=True)
            reference = direct.sample("uniform", 64, mode=Transitions(n_step=3), seed=5, include_keys=True)
            for name in reference:
                np.testing.assert_array_equal(batch[name], reference[name])
        assert len(list(client.sample_stream("uniform", 32, num_batches=4))) == 4
        # Prioritized buffers are served by the workers too; buffers whose sampling changes state are not.
        fill(client, "prio", sampler=Prioritized())
        assert len(client.describe("prio")["sample_endpoints"]) == 2
        assert "probability" in client.sample("prio", 8)
        fill(client, "retiring", remover=MaxTimesSampled(3))
        assert client.describe("retiring")["sample_endpoints"] == []
        assert client.sample("retiring", 8)["obs"].shape == (8, 4)


def test_workers_serve_sequences_and_hindsight_batches_as_the_server_does(worker_server: ReplayServer) -> None:
    schema = {"obs": ("float32", (4,)), "achieved": ("float32", (2,)), "goal": ("float32", (2,)),
              "action": ("int64", ()), "reward": ("float32", ())}
    rng = np.random.default_rng(2)
    with ReplayClient(worker_server.address) as client, \
            ReplayClient(worker_server.address, use_sample_workers=False) as direct:
        client.create_buffer("goals", 10_000, schema, observation_fields=("obs", "achieved", "goal"),
                             goal_fields=("achieved", "goal"))
        lengths = rng.integers(5, 60, 30)
        client.insert_episodes("goals", [{"obs": rng.normal(size=(n + 1, 4)).astype(np.float32),
                                          "achieved": rng.normal(size=(n + 1, 2)).astype(np.float32),
                                          "goal": rng.normal(size=(n + 1, 2)).astype(np.float32),
                                          "action": rng.integers(0, 2, n), "reward": np.ones(n, np.float32)}
                                         for n in lengths], [True] * 30)
        assert client.describe("goals")["sample_endpoints"]
        for mode in (Sequences(20, burn_in=10, period=5, n_step=3), Hindsight("geometric", discount=0.7)):
            for _ in range(2):  # both workers
                batch = client.sample("goals", 64, mode, seed=9, include_keys=True)
                reference = direct.sample("goals", 64, mode, seed=9, include_keys=True)
                assert list(batch) == list(reference)
                for name in reference:
                    np.testing.assert_array_equal(batch[name], reference[name], err_msg=f"{mode}: {name}")


def test_worker_streams_of_large_batches_are_the_servers_batches(worker_server: ReplayServer) -> None:
    """Batches over IN_PLACE_MIN_BYTES, which a worker gathers straight into its messages from the stream's
    second or third on (while the lock-free reader may redraw a torn batch into the same message)."""
    schema = {"frame": ("uint8", (32, 32, 4)), "action": ("int64", ()), "reward": ("float32", ())}
    rng = np.random.default_rng(1)
    with ReplayClient(worker_server.address) as client, \
            ReplayClient(worker_server.address, use_sample_workers=False) as direct:
        client.create_buffer("frames", 5_000, schema, observation_fields=("frame",))
        lengths = rng.integers(10, 50, 20)
        client.insert_episodes("frames", [{"frame": rng.integers(0, 256, (n + 1, 32, 32, 4), dtype=np.uint8),
                                           "action": rng.integers(0, 6, n), "reward": np.ones(n, np.float32)}
                                          for n in lengths], [True] * len(lengths))
        assert client.describe("frames")["sample_endpoints"]
        ours = list(client.sample_stream("frames", 80, Transitions(n_step=2), 5, include_keys=True, seed=3))
        reference = list(direct.sample_stream("frames", 80, Transitions(n_step=2), 5, include_keys=True, seed=3))
        for batch, expected in zip(ours, reference, strict=True):
            assert list(batch) == list(expected)
            for name in expected:
                np.testing.assert_array_equal(batch[name], expected[name])


def test_a_killed_worker_is_restarted_on_its_port(worker_server: ReplayServer) -> None:
    workers = worker_server.sample_workers
    with ReplayClient(worker_server.address) as client:
        fill(client, "b")
        victim = workers._processes[0]
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while workers.restarts == 0:
            assert time.monotonic() < deadline, "the dead worker was not restarted"
            time.sleep(0.05)
        for _ in range(4):  # both endpoints answer again (the client retries while the port rebinds)
            assert client.sample("b", 16)["obs"].shape == (16, 4)


def test_workers_answer_malformed_requests_with_invalid_argument(worker_server: ReplayServer) -> None:
    for port in worker_server.sample_workers.ports:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in ("Sample", "SampleStream"):
                call = (channel.unary_unary if method == "Sample" else channel.unary_stream)(
                    f"/replayd.v1.Replay/{method}")  # raw bytes: no serializers
                with pytest.raises(grpc.RpcError) as info:
                    response = call(b"\x0a\xff\xff\xff\xff\x0f", timeout=20)
                    list(response) if method == "SampleStream" else response
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value)
                assert "malformed request" in info.value.details()
            # A negative count is refused, not streamed without end.
            stream = channel.unary_stream("/replayd.v1.Replay/SampleStream")(pb.SampleStreamRequest(
                request=ReplayClient.sample_request("b", 4), num_batches=-1).SerializeToString(), timeout=20)
            with pytest.raises(grpc.RpcError) as negative:
                next(stream)
            assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "num_batches expected >= 0, got -1" in negative.value.details()


def test_a_client_finds_the_workers_of_a_restarted_server() -> None:
    """Workers of a new server process listen on new ports: the client must not keep the old addresses."""
    first = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}r", sample_workers=1).start()
    address = first.address
    try:
        with ReplayClient(address, retries=8) as client:
            fill(client, "b")
            assert client.sample("b", 16)["obs"].shape == (16, 4)  # remembers the worker's address
            first.stop(grace=0)
            second = ReplayServer(address, instance=f"{TEST_INSTANCE}r", sample_workers=1).start()
            try:
                fill(client, "b")
                assert client.sample("b", 16)["obs"].shape == (16, 4)
                stream = client.sample_stream("b", 16, num_batches=2)
                assert len(list(stream)) == 2
            finally:
                second.stop(grace=0)
    finally:
        first.stop(grace=0)


def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry))
    return found


def test_a_worker_restarting_while_the_server_stops_is_stopped_too(worker_server: ReplayServer) -> None:
    """The monitor restarts a dead worker; a stop during that restart left the new worker running (stop
    terminated the dead one, then the restart put the new one in its place)."""
    workers = worker_server.sample_workers
    spawning, release = threading.Event(), threading.Event()
    spawn = workers._spawn

    def slow_spawn(port: int) -> tuple:
        spawning.set()
        release.wait(10)
        return spawn(port)

    workers._spawn = slow_spawn
    os.kill(workers._processes[0].pid, signal.SIGKILL)
    assert spawning.wait(30), "the monitor did not restart the worker"
    stopping = threading.Thread(target=worker_server.stop, kwargs={"grace": 0})
    stopping.start()
    release.set()
    stopping.join(60)
    assert not stopping.is_alive() and not workers._monitor.is_alive()
    assert [p for p in multiprocessing.active_children() if p.name == "replayd-sample-worker"] == []


def test_workers_of_a_killed_server_exit() -> None:
    """SIGKILL gives the server no chance to stop its workers: they notice and exit on their own, rather
    than serving on beside a restarted server."""
    port = free_port()
    instance = f"{TEST_INSTANCE}orphan"
    command = [sys.executable, "-m", "replayd.server.cli", "serve", "--port", str(port), "--instance", instance,
               "--http-port", "-1", "--sample-workers", "2"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    children: set[int] = set()
    try:
        with ReplayClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout=60)
        deadline = time.monotonic() + 60
        while len(children) < 2:  # both workers (and multiprocessing's resource tracker) started
            assert time.monotonic() < deadline and server.poll() is None
            children = _children(server.pid)
            time.sleep(0.05)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in children):
            assert time.monotonic() < deadline, f"orphaned workers still running: {children}"
            time.sleep(0.05)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if os.path.exists(lock_path(instance)):  # a killed server leaves its (released) instance lock file
            os.unlink(lock_path(instance))


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_worker_stream_of_a_recreated_buffer_ends_with_not_found(worker_server: ReplayServer) -> None:
    """A buffer deleted and created again (larger) while a worker streams it: the stream ends with NOT_FOUND
    (the worker keeps the old ring mapped under it rather than die of SIGSEGV), and the new buffer is
    served."""
    with ReplayClient(worker_server.address, retries=0) as client:
        fill(client, "b")
        stream = client.sample_stream("b", 8, timeout=60)
        assert next(stream)["obs"].shape == (8, 4)
        client.delete_buffer("b")
        client.create_buffer("b", 200_000, SCHEMA)
        fill_rows = {"obs": np.ones((6, 4), np.float32), "action": np.zeros(5, np.int64),
                     "reward": np.ones(5, np.float32)}
        client.insert_episode("b", True, **fill_rows)
        for _ in range(2):  # each worker attaches the new buffer, dropping its old ring
            assert client.sample("b", 4)["obs"].shape == (4, 4)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in range(100_000):  # batches sampled ahead before the delete may still arrive
                next(stream)
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND
        assert (client.sample("b", 16)["obs"] == 1).all()
    assert worker_server.sample_workers.restarts == 0


def test_a_client_routed_to_workers_samples_a_buffer_recreated_for_the_server_only(
        worker_server: ReplayServer) -> None:
    """A buffer created again with a remover is sampled by its server only: a client whose cached route still
    names the workers is sent back to the server (UNAVAILABLE: it describes the buffer again), for samples and
    streams alike; before, every call failed with FAILED_PRECONDITION."""

    def routed_to_workers(client: ReplayClient) -> None:
        admin.delete_buffer("b")
        fill(admin, "b")
        for _ in range(2):  # both workers attach it; the client keeps their route
            assert client.sample("b", 4)["obs"].shape == (4, 4)
        admin.delete_buffer("b")
        fill(admin, "b", remover=MaxTimesSampled(2))
        assert admin.describe("b")["sample_endpoints"] == []

    with ReplayClient(worker_server.address) as admin:
        fill(admin, "b")
        with ReplayClient(worker_server.address) as learner:
            routed_to_workers(learner)
            for _ in range(2):
                assert learner.sample("b", 4)["obs"].shape == (4, 4)
        with ReplayClient(worker_server.address) as learner:
            routed_to_workers(learner)
            # a deadline: a stream that kept reopening on UNAVAILABLE fails here, not at the suite timeout
            stream = learner.sample_stream("b", 4, num_batches=2, timeout=30)
            assert [batch["obs"].shape for batch in stream] == [(4, 4)] * 2


def test_workers_unmap_deleted_buffers(worker_server: ReplayServer) -> None:
    """A worker drops a deleted buffer's mapping (and its file descriptors), also when nobody asks for
    that buffer again and when streams held it: one cancelled, the others ended by the delete."""
    workers = worker_server.sample_workers._processes

    def mapping(segment: str) -> list[int]:
        """The pids of the workers that map a segment whose name starts with `segment`."""
        return [p.pid for p in workers if segment in open(f"/proc/{p.pid}/maps").read()]

    with ReplayClient(worker_server.address) as client:
        for name in ("gone1", "gone2"):
            fill(client, name)
            for _ in range(4):  # round-robin: both workers attach it
                client.sample(name, 8)
            streams = [client.sample_stream(name, 8, timeout=30) for _ in range(4)]
            for stream in streams:
                next(stream)
            assert mapping(f"rpd_{worker_server.instance}_{name}") == [p.pid for p in workers]
            streams[0].close()  # cancelled mid-stream
            client.delete_buffer(name)
            for stream in streams[1:]:  # the others end with NOT_FOUND at their next batch
                with pytest.raises(grpc.RpcError) as ended:
                    for _ in range(10_000):
                        next(stream)
                assert ended.value.code() == grpc.StatusCode.NOT_FOUND
                stream.close()
        deadline = time.monotonic() + 20
        while mapping(f"rpd_{worker_server.instance}_gone"):
            assert time.monotonic() < deadline, "workers still map the deleted buffers"
            time.sleep(0.05)


class _Aborted(Exception):
    pass


class _Context:
    """What a worker's handlers use of a grpc.ServicerContext: a deadline, whether the call is still on,
    and abort (raising, as gRPC's does)."""

    def __init__(self, seconds: float, active: bool = True) -> None:
        self.deadline, self.active = time.monotonic() + seconds, active

    def time_remaining(self) -> float:
        return self.deadline - time.monotonic()

    def is_active(self) -> bool:
        return self.active

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


@pytest.fixture
def in_process_worker(server: ReplayServer):
    """A worker's servicer in this process, over the shared memory of the `server` fixture's buffers."""
    worker = SampleWorkerServicer(server.instance, 2**20)
    try:
        yield worker
    finally:
        for _, ring in worker._rings.values():
            ring.close()


def test_a_worker_sample_asked_to_wait_gets_the_data_inserted_meanwhile(
        client: ReplayClient, in_process_worker: SampleWorkerServicer) -> None:
    client.create_buffer("empty", 1000, SCHEMA)
    result: list = []
    failures: list[BaseException] = []

    def sample() -> None:
        try:
            request = ReplayClient.sample_request("empty", 4, wait=True)
            result.append(codec.decode(sample_response_batch(in_process_worker.Sample(request, _Context(20)))))
        except BaseException as exc:  # reported below
            failures.append(exc)

    waiting = threading.Thread(target=sample)
    waiting.start()
    try:
        deadline = time.monotonic() + 20
        while in_process_worker.worker_seats.taken["waits"] < 1:  # the worker waits for data
            assert time.monotonic() < deadline and waiting.is_alive(), failures
            time.sleep(0.005)
        client.insert_episode("empty", True, obs=np.ones((6, 4), np.float32), action=np.zeros(5, np.int64),
                              reward=np.ones(5, np.float32))
        waiting.join(timeout=20)
        assert not waiting.is_alive() and not failures, failures
        assert result[0]["obs"].shape == (4, 4) and (result[0]["obs"] == 1).all()
        assert in_process_worker.worker_seats.taken["waits"] == 0
    finally:
        waiting.join(timeout=20)


def test_a_cancelled_wait_on_a_worker_ends_at_once(client: ReplayClient,
                                                     in_process_worker: SampleWorkerServicer) -> None:
    """A client that gives up on a sample waiting for data: the worker stops waiting (and frees its thread and
    seat) at once, not at the call's deadline."""
    client.create_buffer("empty", 1000, SCHEMA)
    started = time.monotonic()
    with pytest.raises(_Aborted) as ended:
        in_process_worker.Sample(ReplayClient.sample_request("empty", 4, wait=True), _Context(5, active=False))
    assert ended.value.args[0] == grpc.StatusCode.CANCELLED and "the call ended while it waited" in ended.value.args[1]
    assert time.monotonic() - started < 4 and in_process_worker.worker_seats.taken["waits"] == 0
    assert in_process_worker.rejected == {}  # a cancelled call is not a rejected one


def test_a_buffer_deleted_between_the_workers_look_and_its_attach_is_not_found(
        client: ReplayClient, in_process_worker: SampleWorkerServicer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker finds the segment, then the delete unlinks it before the attach: NOT_FOUND, as for a
    buffer gone before the look (not INTERNAL from a FileNotFoundError)."""
    client.create_buffer("racing", 1000, SCHEMA)

    def unlinked_meanwhile(header: str) -> None:
        raise FileNotFoundError(2, "No such file or directory", f"/{header}")

    monkeypatch.setattr("replayd.server.grpc_server.sample_workers.RingReader.attach", unlinked_meanwhile)
    with pytest.raises(NotFound, match="buffer 'racing' does not exist"):
        in_process_worker.ring("racing")


def test_a_buffer_whose_header_is_not_written_yet_is_not_found() -> None:
    """CreateBuffer creates the header segment (zero-filled), then writes its JSON: a worker asked for the buffer
    in between (a client routed there before a delete and create again) answered INTERNAL (a JSONDecodeError)."""
    from multiprocessing import shared_memory

    from replayd.server.storage.shared_arrays import _untracked, remove_segment

    instance = f"{TEST_INSTANCE}hdr"
    header = _untracked(shared_memory.SharedMemory(name=f"rpd_{instance}_creating", create=True, size=256))
    try:
        with pytest.raises(NotFound, match="buffer 'creating' does not exist"):
            SampleWorkerServicer(instance, 2**20).ring("creating")
    finally:
        header.close()
        remove_segment(header.name)


@pytest.mark.parametrize("name", ["racing.data", "a/b", ""])
def test_a_worker_checks_buffer_names_as_the_server_does(
        client: ReplayClient, in_process_worker: SampleWorkerServicer, name: str) -> None:
    """Names the server refuses are refused by the worker too: "b.data" would open the data segment as a
    header (copying it whole before failing), "a/b" would be INTERNAL."""
    client.create_buffer("racing", 1000, SCHEMA)
    with pytest.raises(InvalidArgument, match=r"buffer name .* must match"):
        in_process_worker.ring(name)


def test_a_worker_keeps_a_quarter_of_its_threads_free_for_short_calls() -> None:
    seats = SampleWorkerServicer(TEST_INSTANCE, 2**20).worker_seats
    assert WORKER_THREADS == 16 and seats.caps == {"waits": 6, "streams": 6}


def test_a_worker_whose_port_was_taken_is_started_again_once_it_is_free(caplog: pytest.LogCaptureFixture) -> None:
    """A dead worker is restarted on its port. When another socket took that port meanwhile, a worker that
    exits before serving is an OSError at once, and the monitor tries again until the port is free (rather
    than wait for a port the new worker never reports, and end the monitor thread, so that no worker is ever
    restarted again)."""
    workers = SampleWorkers(1, f"{TEST_INSTANCE}taken", "127.0.0.1", 2**20, None)
    workers.start()
    taken = socket.socket()
    try:
        port = workers.ports[0]
        started = time.monotonic()
        with pytest.raises(OSError, match=f"could not serve on 127.0.0.1:{port}"):
            workers._spawn(port)  # the running worker holds the port
        assert time.monotonic() - started < 30
        os.kill(workers._processes[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # the port is free once the worker is dead: take it before the monitor's restart binds it
            try:
                taken.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, f"port {port} of the killed worker was not freed"
                time.sleep(0.01)
        taken.listen()
        deadline = time.monotonic() + 60
        while not any("trying again" in record.getMessage() for record in caplog.records):
            assert time.monotonic() < deadline, "the monitor did not report the failed restart"
            time.sleep(0.05)
        assert workers._monitor.is_alive() and workers.restarts == 0
        taken.close()
        deadline = time.monotonic() + 60
        while workers.restarts == 0:
            assert time.monotonic() < deadline, "the worker was not restarted once its port was free"
            time.sleep(0.05)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
    finally:
        taken.close()
        workers.stop()
    assert [p for p in multiprocessing.active_children() if p.name == "replayd-sample-worker"] == []


def test_ctrl_c_stops_the_server_and_its_workers_quietly() -> None:
    """A terminal's Ctrl-C sends SIGINT to the whole process group: the workers stop quietly (no
    KeyboardInterrupt traceback each), and the monitor starts none again while the server stops."""
    port = free_port()
    instance = f"{TEST_INSTANCE}ctrlc"
    command = [sys.executable, "-m", "replayd.server.cli", "serve", "--port", str(port), "--instance", instance,
               "--http-port", "-1", "--sample-workers", "2"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # its own process group, as a terminal's job
    try:
        while "listening" not in server.stdout.readline():  # printed once the workers serve
            assert server.poll() is None, server.stderr.read()
        with ReplayClient(f"127.0.0.1:{port}") as client:
            fill(client, "b")
            stream = client.sample_stream("b", 16)  # open calls: the server's stop waits its grace for them
            next(iter(stream))
            workers = _children(server.pid)
            os.killpg(server.pid, signal.SIGINT)
            out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
    assert server.returncode == 0, err
    assert "KeyboardInterrupt" not in err and "starting it again" not in err, err
    assert "shared memory unlinked" in out
    deadline = time.monotonic() + 30
    while any(_state(pid) not in ("Z", "gone") for pid in workers):
        assert time.monotonic() < deadline, f"workers still running: {workers}"
        time.sleep(0.05)
