"""Bearer tokens on gRPC and HTTP, TLS, and the refusal to expose an unauthenticated server."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from replayd.client import ReplayClient
from replayd.server.cli import main as cli_main
from replayd.server.server import ReplayServer
from tests.conftest import TEST_INSTANCE

TOKEN = "s3cret-token"
SCHEMA = {"obs": ("float32", (2,)), "reward": ("float32", ())}


@pytest.fixture
def guarded() -> Iterator[ReplayServer]:
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}auth", http_address="127.0.0.1:0",
                          token=TOKEN).start()
    yield server
    server.stop(grace=0)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


@pytest.mark.parametrize("token", ["", "wrong-token"], ids=["missing", "wrong"])
def test_grpc_without_the_right_token_is_unauthenticated(guarded: ReplayServer, token: str) -> None:
    with ReplayClient(guarded.address, timeout=10, token=token) as client:
        assert _code(client.list_buffers) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: client.create_buffer("b", 100, SCHEMA)) == grpc.StatusCode.UNAUTHENTICATED
        # Streaming calls are rejected alike, before their payload is parsed.
        assert _code(lambda: client.insert([])) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: next(client.sample_stream("b", 4))) == grpc.StatusCode.UNAUTHENTICATED
    assert not guarded.registry.all()


def test_grpc_with_the_right_token_works(guarded: ReplayServer) -> None:
    with ReplayClient(guarded.address, timeout=10, token=TOKEN) as client:
        client.create_buffer("b", 100, SCHEMA)
        client.insert_episode("b", True, obs=np.zeros((3, 2), np.float32), reward=np.ones(2, np.float32))
        assert len(next(client.sample_stream("b", 4))["obs"]) == 4
        assert client.describe("b")["stored_steps"] == 3


def test_client_token_defaults_to_the_environment(guarded: ReplayServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPLAYD_TOKEN", TOKEN)
    with ReplayClient(guarded.address, timeout=10) as client:
        assert client.list_buffers() == []


def test_http_needs_the_token_except_healthz_and_the_pages_static_files(guarded: ReplayServer) -> None:
    base = f"http://127.0.0.1:{guarded.http.port}"
    right = {"Authorization": f"Bearer {TOKEN}"}
    with ReplayClient(guarded.address, timeout=10, token=TOKEN) as client:
        client.create_buffer("b", 100, SCHEMA)
    for path in ("/api/buffers", "/api/buffers/b", "/api/history", "/metrics", "/readyz"):
        assert httpx.get(base + path).status_code == 401, path
        assert httpx.get(base + path, headers={"Authorization": "Bearer nope"}).status_code == 401, path
        assert httpx.get(base + path, headers=right).status_code == 200, path
    assert httpx.get(base + "/healthz").json() == {"status": "ok"}
    # The page, its script and its charting library hold no server state; the script sends the token.
    assert "static/status.js" in httpx.get(base + "/").text
    assert "api/buffers" in httpx.get(base + "/static/status.js").text
    assert httpx.get(base + "/static/vendor/uplot/uPlot.iife.min.js").text.startswith("/*! https://github.com/leeoniya/uPlot")


def test_server_without_token_accepts_any_client() -> None:
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}open").start()
    try:
        with ReplayClient(server.address, timeout=10, token="unneeded") as client:
            assert client.list_buffers() == []
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "replay.example"])
def test_serve_refuses_a_non_loopback_host_without_token(host: str, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("REPLAYD_TOKEN", raising=False)
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--host", host, "--port", "0", "--http-port", "-1"])
    assert info.value.code == 2
    assert "refusing to listen" in capsys.readouterr().err


def test_serve_bind_rule_accepts_token_flag_or_loopback() -> None:
    from replayd.server.tokens import check_bind

    check_bind("0.0.0.0", "token", insecure_bind_all=False)
    check_bind("0.0.0.0", None, insecure_bind_all=True)
    check_bind("127.0.0.1", None, insecure_bind_all=False)
    check_bind("localhost", None, insecure_bind_all=False)
    check_bind("::1", None, insecure_bind_all=False)


@pytest.mark.parametrize("half", ["cert", "key"])
def test_a_tls_certificate_without_its_key_or_a_key_without_its_certificate_is_refused(half: str) -> None:
    """Half a TLS configuration must not start a server (without its key a certificate is not served)."""
    pem = {f"tls_{half}": b"-----BEGIN PEM-----"}
    with pytest.raises(ValueError, match="tls_cert and tls_key: expected both or neither"):
        ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}halftls", **pem).stop(grace=0)  # stop: if accepted


def _self_signed(tmp_path: Path) -> tuple[bytes, bytes]:
    # openssl rather than the `cryptography` package, which is not a dependency.
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"), "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return (tmp_path / "cert.pem").read_bytes(), (tmp_path / "key.pem").read_bytes()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
def test_tls_round_trip_with_token(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}tls", token=TOKEN, tls_cert=cert,
                          tls_key=key).start()
    try:
        with ReplayClient(server.address, timeout=10, token=TOKEN, root_certificates=cert) as client:
            client.create_buffer("b", 100, SCHEMA)
            client.insert_episode("b", True, obs=np.ones((3, 2), np.float32), reward=np.ones(2, np.float32))
            assert np.all(client.sample("b", 4, seed=1)["obs"] == 1.0)
        with ReplayClient(server.address, timeout=10, token="wrong", root_certificates=cert) as client:
            assert _code(client.list_buffers) == grpc.StatusCode.UNAUTHENTICATED
        with ReplayClient(server.address, timeout=3, token=TOKEN, retries=0) as plain:
            assert _code(plain.list_buffers) == grpc.StatusCode.UNAVAILABLE  # no plaintext on a TLS port
    finally:
        server.stop(grace=0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
def test_with_tls_the_http_side_speaks_https_only(tmp_path: Path) -> None:
    """Under --tls-cert the HTTP side serves the gRPC port's certificate: over plain HTTP a client's bearer
    token for /metrics would cross the network in the clear."""
    cert, key = _self_signed(tmp_path)
    server = ReplayServer("127.0.0.1:0", instance=f"{TEST_INSTANCE}https", token=TOKEN, tls_cert=cert, tls_key=key,
                          http_address="127.0.0.1:0").start()
    try:
        verify = ssl.create_default_context(cadata=cert.decode())
        secure = f"https://127.0.0.1:{server.http.port}"
        right = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(secure + "/metrics", headers=right, verify=verify).status_code == 200
        assert httpx.get(secure + "/metrics", verify=verify).status_code == 401
        with pytest.raises(httpx.HTTPError):  # no plaintext on the HTTP port
            httpx.get(f"http://127.0.0.1:{server.http.port}/metrics", headers=right)
    finally:
        server.stop(grace=0)
    assert not list(Path(tempfile.gettempdir()).glob("replayd-tls-*"))  # the key's copy went with its folder
