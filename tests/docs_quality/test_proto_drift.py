"""The committed stubs must be exactly what grpc_tools generates from the protos (proto/ is the one source).

`proto/axond/v1/` generates `axond/v1/`; `proto/etcd/` (the part of etcd's v3 API the etcd state backend
uses) generates `axond/etcdv3/`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STUBS = {
    "axond/v1": (["-Iproto", "proto/axond/v1/coordinator.proto"], ("coordinator",)),
    "axond/etcdv3": (["-Iaxond/etcdv3=proto/etcd", "proto/etcd/kv.proto", "proto/etcd/rpc.proto"], ("kv", "rpc")),
}
"""Package of the stubs -> (protoc's include and input arguments, the protos' module names)."""


@pytest.mark.parametrize("package", sorted(STUBS))
def test_generated_stubs_match_the_proto(tmp_path: Path, package: str) -> None:
    args, modules = STUBS[package]
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    command = [sys.executable, "-m", "grpc_tools.protoc", *args[:1], "--python_out=.", "--grpc_python_out=.",
               "--pyi_out=.", *args[1:]]
    subprocess.run(command, cwd=tmp_path, check=True, capture_output=True, timeout=60)
    generated = [f"{m}{suffix}" for m in modules for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    stale = [name for name in generated
             if (tmp_path / package / name).read_bytes() != (ROOT / package / name).read_bytes()]
    assert not stale, (
        f"{package}/{stale} differ from their protos; regenerate with: python -m grpc_tools.protoc "
        f"{args[0]} --python_out=. --grpc_python_out=. --pyi_out=. {' '.join(args[1:])}"
    )
