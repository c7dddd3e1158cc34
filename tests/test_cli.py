"""`replayd serve` refuses bad flag values with a usage error, and a port in use with a clear message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replayd.server import cli
from replayd.server.cli import main as cli_main
from replayd.server.server import ReplayServer
from tests.conftest import TEST_INSTANCE


@pytest.mark.parametrize(("flags", "message"), [
    (["--port", "-5"], "expected a port in 0..65535, got -5"),  # gRPC would serve it as port 65531
    (["--port", "99999"], "expected a port in 0..65535, got 99999"),
    (["--http-port", "70000"], "expected a port in 0..65535, got 70000"),
    (["--max-buffer-gb", "0"], "expected a number > 0, got 0"),  # every create_buffer would fail
    (["--max-message-mb", "-1"], "expected a number > 0, got -1"),  # gRPC takes -1 as no limit at all
    (["--max-message-mb", "4096"], "gRPC messages are smaller than 2048 MB"),  # not an OverflowError traceback
    (["--max-buffer-gb", "1e-12"], "--max-buffer-gb: 1e-12 is less than one byte"),  # not a limit of 0 bytes
    (["--max-message-mb", "1e-9"], "--max-message-mb: 1e-09 is less than one byte"),
    (["--sample-workers", "-1"], "expected an integer >= 0, got -1"),  # usage errors, not tracebacks
    (["--sample-workers", "100000"], "--sample-workers: expected at most"),  # not 100,000 processes spawned
    (["--checkpoint-keep", "-2"], "expected an integer >= 0, got -2"),
    (["--log-level", "BOGUS"], "invalid choice: 'BOGUS'"),
    (["--token", "päss"], "token: expected printable ASCII"),  # no client could send it in metadata
    (["--token", "secret "], "token: expected printable ASCII"),
    (["--sample-workers", "1", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "--sample-workers serve plain gRPC"),
    (["--max-workers", "2"], "expected at least 3 worker threads, got 2"),  # a usage error, not a ValueError
    (["--checkpoint-every", "60"], "--checkpoint-every needs --checkpoint-dir"),  # would never checkpoint
    (["--checkpoint-every", "0", "--checkpoint-dir", "ckpt"], "argument --checkpoint-every: expected a number > 0, "
                                                               "got 0"),
    (["--checkpoint-every", "-1", "--checkpoint-dir", "ckpt"], "expected a number > 0, got -1"),
    (["--checkpoint-every", "nan", "--checkpoint-dir", "ckpt"], "expected a number > 0, got nan"),  # back to back
    (["--checkpoint-every", "inf", "--checkpoint-dir", "ckpt"], "expected a number > 0, got inf"),  # OverflowError
    (["--checkpoint-every", "1e10", "--checkpoint-dir", "ckpt"], "--checkpoint-every: expected at most 9223372036 "
                                                                 "seconds, got 1e+10"),
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-key", "k.pem"], "--tls-cert and --tls-key go together"),
])
def test_bad_flag_values_are_usage_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "serve", lambda args: pytest.fail(f"{flags} were accepted: the server was started"))
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--instance", f"{TEST_INSTANCE}cli", "--http-port", "-1", *flags])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_sample_workers_off_x86_are_a_usage_error(capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """They read shared memory lock-free, which takes x86's memory ordering (service/buffers/ring.py)."""
    monkeypatch.setattr(cli, "serve", lambda args: pytest.fail("--sample-workers off x86 started a server"))
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--instance", f"{TEST_INSTANCE}cli", "--http-port", "-1", "--sample-workers", "2"])
    assert info.value.code == 2
    assert "--sample-workers sample shared memory lock-free, which needs an x86-64 host; this one is 'aarch64'" in (
        capsys.readouterr().err)


def test_recover_without_an_instance_is_a_usage_error(capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A random instance name has no segments to reattach: --recover must name the killed server's."""
    monkeypatch.setattr(cli, "serve", lambda args: pytest.fail("--recover without --instance started a server"))
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--http-port", "-1", "--recover"])
    assert info.value.code == 2
    assert "--recover needs the --instance name" in capsys.readouterr().err


def _server_arguments(monkeypatch: pytest.MonkeyPatch, *flags: str) -> tuple[tuple, dict]:
    """The arguments `replayd serve FLAGS` makes its ReplayServer with (none is made: the recorder refuses)."""
    made: list[tuple[tuple, dict]] = []

    def recorder(*args, **kwargs):
        made.append((args, kwargs))
        raise OSError("recorded")

    monkeypatch.setattr(cli, "ReplayServer", recorder)
    monkeypatch.setattr(cli, "tune_allocator", lambda: None)  # not this test process's allocator
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **kwargs: None)
    with pytest.raises(SystemExit, match="replayd: recorded"):
        cli_main(["serve", "--instance", f"{TEST_INSTANCE}cli", *flags])
    assert len(made) == 1
    return made[0]


def test_serve_flags_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    args, kwargs = _server_arguments(monkeypatch)
    assert args == ("127.0.0.1:50051",)
    assert kwargs["http_address"] == "127.0.0.1:8080" and kwargs["checkpoint_keep"] == 3  # the defaults
    assert kwargs["max_buffer_bytes"] is None and kwargs["max_workers"] == 64
    args, kwargs = _server_arguments(monkeypatch, "--port", "0", "--http-port", "0", "--max-buffer-gb", "1.5",
                                     "--checkpoint-dir", "ckpt", "--checkpoint-every", "30", "--checkpoint-keep", "5")
    assert args == ("127.0.0.1:0",)
    assert kwargs["http_address"] == "127.0.0.1:0"  # 0: HTTP on a free port, not off
    assert kwargs["max_buffer_bytes"] == 3 * 2**29  # GiB, not MiB
    assert kwargs["checkpoint_dir"] == "ckpt" and kwargs["checkpoint_every"] == 30 and kwargs["checkpoint_keep"] == 5
    assert kwargs["instance"] == f"{TEST_INSTANCE}cli"
    _, kwargs = _server_arguments(monkeypatch, "--http-port", "-1", "--checkpoint-keep", "0")
    assert kwargs["http_address"] is None and kwargs["checkpoint_keep"] is None  # off; keep every checkpoint
    args, kwargs = _server_arguments(monkeypatch, "--host", "::1", "--port", "0", "--http-port", "0")
    assert args == ("[::1]:0",) and kwargs["http_address"] == "[::1]:0"  # "::1:0" bound somewhere else


def _serve(*flags: str) -> subprocess.CompletedProcess:
    """`replayd serve` in a process of its own (it tunes the allocator and logging of the process it runs in)."""
    return subprocess.run([sys.executable, "-m", "replayd.server.cli", "serve", "--http-port", "-1", *flags],
                          capture_output=True, text=True, timeout=30)


def test_a_port_in_use_is_refused() -> None:
    """gRPC sets SO_REUSEPORT on Linux: a second server on a port in use would start and take part of the
    first one's calls. It is refused, and the serve command says so in one line."""
    first = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}cli1").start()
    try:
        try:
            second = ReplayServer(f"127.0.0.1:{first.port}", instance=f"{TEST_INSTANCE}cli2")
        except OSError as exc:
            assert f"could not serve gRPC on 127.0.0.1:{first.port}" in str(exc)
        else:
            second.stop(grace=0)
            pytest.fail("a second server was made on the first one's port")
        refused = _serve("--instance", f"{TEST_INSTANCE}cli3", "--port", str(first.port))
        assert refused.returncode == 1
        assert f"replayd: could not serve gRPC on 127.0.0.1:{first.port}" in refused.stderr
        assert "Traceback" not in refused.stderr
    finally:
        first.stop(grace=0)


def test_unreadable_tls_files_are_reported(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    refused = _serve("--instance", f"{TEST_INSTANCE}cli4", "--port", "0", "--tls-cert", missing, "--tls-key", missing)
    assert refused.returncode == 1
    assert "replayd: [Errno 2] No such file or directory" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize("flags", [["--rmove"], ["--instance", f"{TEST_INSTANCE}cli", "--remove-stale"], ["extra"]])
def test_segments_refuses_unknown_arguments(flags: list[str], capsys: pytest.CaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`replayd segments --rmove` is a usage error: listing the segments and exiting 0 would let the operator
    take them for removed."""
    monkeypatch.setattr(cli, "list_segments", lambda args: pytest.fail(f"{flags} were accepted"))
    with pytest.raises(SystemExit) as info:
        cli_main(["segments", *flags])
    assert info.value.code == 2
    assert f"replayd segments: error: unrecognized arguments: {flags[-1]}" in capsys.readouterr().err


def test_a_checkpoint_dir_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    """The server served on, and every periodic checkpoint failed with a traceback in the log."""
    (tmp_path / "file").write_text("")
    for directory in (tmp_path / "file" / "ckpt", tmp_path / "file"):
        refused = _serve("--instance", f"{TEST_INSTANCE}cli5", "--port", "0", "--checkpoint-dir", str(directory),
                         "--checkpoint-every", "1")
        assert refused.returncode == 1
        assert f"replayd: checkpoint directory '{directory}' cannot be written" in refused.stderr
        assert "Traceback" not in refused.stderr
