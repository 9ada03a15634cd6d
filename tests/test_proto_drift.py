"""The committed stubs in axond/v1/ must be exactly what grpc_tools generates from the proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py")


def test_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", "--python_out=.", "--grpc_python_out=.",
         "--pyi_out=.", "proto/axond/v1/coordinator.proto"],
        cwd=tmp_path, check=True, capture_output=True, timeout=60,
    )
    stale = [
        name for name in GENERATED
        if (tmp_path / "axond" / "v1" / name).read_bytes() != (ROOT / "axond" / "v1" / name).read_bytes()
    ]
    assert not stale, (
        f"axond/v1/{stale} differ from proto/axond/v1/coordinator.proto; regenerate with: python -m "
        "grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/axond/v1/coordinator.proto"
    )
