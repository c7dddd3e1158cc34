"""The package as a user installs it: `python -m build` makes an sdist and, from it, a wheel whose only top-level
package is `replayd`; the wheel, installed into a fresh virtual environment with the pinned constraints, serves
with `replayd serve` from that environment and runs the README's quickstart against it (from a folder outside the
repository, so every import comes from the installed wheel).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from replayd.client.polling import wait_until
from replayd.client.replay_client import ReplayClient
from tests.conftest import TEST_INSTANCE, free_port
from tests.test_readme import edited, quickstart

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"


def run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def clean_env() -> dict[str, str]:
    """The environment without this checkout on the import path; pip pinned by the constraints."""
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_CONSTRAINT"] = str(CONSTRAINTS)  # also pins what pip's isolated builds install
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], timeout=900, env=clean_env())
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    (found,) = dist.glob("replayd-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel and its learner extra (the quickstart trains)."""
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", str(root)], timeout=300)
    run([str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "--constraint", str(CONSTRAINTS),
         f"{wheel}[learner]"], timeout=1500, env=clean_env(), cwd=root)
    return root


def venv_version(venv: Path) -> str:
    """The version the fresh environment's metadata holds for replayd (the wheel's)."""
    code = "import importlib.metadata as m; print(m.version('replayd'))"
    return run([str(venv / "bin" / "python"), "-c", code], timeout=60, cwd=venv, env=clean_env()).stdout.strip()


@pytest.fixture
def served(venv: Path, tmp_path: Path) -> Iterator[str]:
    """`replayd serve` of the fresh environment, on a free port; stopped (its segments unlinked) after."""
    address = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen(
        [str(venv / "bin" / "replayd"), "serve", "--port", address.rsplit(":", 1)[1], "--http-port", "-1",
         "--instance", f"{TEST_INSTANCE}pkg"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with ReplayClient(address, timeout=10) as probe:
            wait_until(lambda: server.poll() is not None or probe.list_buffers() == [],
                       time.monotonic() + 120, "the installed `replayd serve` answering")
        assert server.poll() is None, server.stderr.read()
        yield address
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_python_m_build_makes_an_sdist_and_a_wheel_whose_only_top_level_package_is_replayd(dist: Path,
                                                                                             wheel: Path) -> None:
    assert len(list(dist.glob("replayd-*.tar.gz"))) == 1
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"replayd"}, top_level
    assert {"replayd/server/cli.py", "replayd/client/replay_client.py", "replayd/wire/replay_pb2.py",
            "replayd/ray.py"} <= set(names)
    assert any(name.startswith("replayd/server/kernels/_kernels.") and name.endswith(".so") for name in names)


def test_the_installed_wheel_serves_and_runs_the_readme_quickstart(venv: Path, served: str, tmp_path: Path) -> None:
    python = str(venv / "bin" / "python")
    version = run([str(venv / "bin" / "replayd"), "--version"], timeout=60, cwd=tmp_path, env=clean_env())
    assert version.stdout.strip() == f"replayd {venv_version(venv)}"
    snippet = edited(quickstart(), '"127.0.0.1:50051"', repr(served))
    snippet = edited(snippet, "+ 1e-3)\n", "+ 1e-3)\n    break\n")
    script = tmp_path / "quickstart.py"
    script.write_text(snippet + (
        "\nimport replayd\n"
        "print(replayd.__file__)\n"
        "assert out['td_error'].shape == (256,)\n"
        "assert rc.describe('cartpole')['episodes'] == 1\n"
        "rc.close()\n"))
    done = run([python, str(script)], timeout=600, cwd=tmp_path, env=clean_env())
    assert Path(done.stdout.strip().splitlines()[-1]).is_relative_to(venv), done.stdout  # not this checkout's
