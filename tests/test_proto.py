"""The committed gRPC code must be what grpc_tools generates from proto/replay.proto."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-Ireplayd/wire={ROOT / 'proto'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ROOT / "proto" / "replay.proto")],
        check=True, cwd=ROOT,
    )
    for name in ("replay_pb2.py", "replay_pb2.pyi", "replay_pb2_grpc.py"):
        generated = (tmp_path / "replayd" / "wire" / name).read_text()
        committed = (ROOT / "proto" / name).read_text()
        assert generated == committed, f"proto/{name} is stale: run `make proto` and commit"
