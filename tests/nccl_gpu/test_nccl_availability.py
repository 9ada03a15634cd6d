"""Asking for NCCL where it cannot run: clear errors, lazy imports, and "auto" falling back to tcp.

Nothing here runs NCCL. The probe's branches for a machine that has CuPy but lacks a device or NCCL
are exercised in a subprocess against a stand-in `cupy` package written to a temp dir; it answers
only the probe's questions (device count, NCCL availability and version), so no collective can run.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from axond.distributed.backends.base import BackendOptions
from axond.distributed.backends.nccl import NcclBackend
from axond.distributed.backends.registry import backend_class, resolve_backend
from axond.errors import BackendUnavailable
from axond.store import InMemoryStore

HAS_CUPY = importlib.util.find_spec("cupy") is not None
no_cupy = pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here; these check the machine without it")


def run_python(code: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=60)


def test_importing_axond_and_the_backend_does_not_import_cupy() -> None:
    done = run_python("""
        import sys
        import axond, axond.distributed.backends.nccl, axond.distributed.backends.registry
        assert "cupy" not in sys.modules, "importing axond must not import CuPy"
        print("ok")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@no_cupy
def test_probe_names_the_missing_package() -> None:
    assert NcclBackend.is_available() == (False, "CuPy is not installed: pip install 'axond[gpu]'")


@no_cupy
def test_backend_nccl_without_gpu_is_a_clear_error() -> None:
    expected = r"backend 'nccl' cannot run here: CuPy is not installed: pip install 'axond\[gpu\]'"
    with pytest.raises(BackendUnavailable, match=expected):
        backend_class("nccl")
    with pytest.raises(BackendUnavailable, match="CuPy is not installed"):
        NcclBackend(InMemoryStore(), 0, 1, "world", BackendOptions(timeout=1.0))


@no_cupy
def test_auto_falls_back_to_tcp() -> None:
    assert resolve_backend("auto") == "tcp"
    with pytest.raises(BackendUnavailable, match="CuPy is not installed"):
        resolve_backend("nccl")


STAND_IN = {
    "no_device": ("0", "True", "22104", ""),
    "cuda_error": ("(_ for _ in ()).throw(RuntimeError('cudaErrorNoDevice: no CUDA-capable device'))",
                   "True", "22104", ""),
    "no_nccl": ("1", "False", "0", ""),
    "nccl_import_error": ("1", "True", "0", "raise ImportError('libnccl.so.2: cannot open shared object file')"),
    "old_nccl": ("1", "True", "2604", ""),
    "usable": ("2", "True", "22104", ""),
}


def write_stand_in_cupy(root: Path, count: str, available: str, version: str, nccl_prelude: str) -> None:
    """A `cupy` package that answers the probe's three questions and nothing else."""
    cuda = root / "cupy" / "cuda"
    cuda.mkdir(parents=True)
    (root / "cupy" / "__init__.py").write_text("from cupy import cuda\n")
    (cuda / "__init__.py").write_text("from cupy.cuda import runtime\n")
    (cuda / "runtime.py").write_text(f"def getDeviceCount():\n    return {count}\n")
    (cuda / "nccl.py").write_text(
        f"{nccl_prelude}\navailable = {available}\ndef get_version():\n    return {version}\n"
    )


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("no_device", "no CUDA device visible (check the driver and CUDA_VISIBLE_DEVICES)"),
        ("cuda_error", "no CUDA device visible (CUDA says RuntimeError: cudaErrorNoDevice"),
        ("no_nccl", "CuPy has no NCCL (cupy.cuda.nccl unavailable): install the nvidia-nccl-cu12 wheel"),
        ("nccl_import_error", "CuPy has no NCCL (cupy.cuda.nccl: libnccl.so.2"),
        ("old_nccl", "NCCL 2604 is too old: axond needs NCCL >= 2.7"),
        ("usable", ""),
    ],
)
def test_probe_reasons_with_cupy_present(tmp_path: Path, case: str, reason: str) -> None:
    write_stand_in_cupy(tmp_path, *STAND_IN[case])
    done = run_python("""
        from axond.distributed.backends.nccl import NcclBackend
        from axond.distributed.backends.registry import backend_class, resolve_backend
        from axond.errors import BackendUnavailable
        ok, why = NcclBackend.is_available()
        print(ok)
        print(why)
        print(resolve_backend("auto"))
        try:
            backend_class("nccl")
        except BackendUnavailable as e:
            print(e)
    """, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    ok, why, auto, *error = done.stdout.splitlines()
    assert why.startswith(reason)
    # with CuPy installed, "auto" lets the members choose together (NCCL, staging, or tcp on a rank without a GPU)
    if case == "usable":
        assert (ok, why, auto, error) == ("True", "", "gpu-auto", [])
    else:
        assert (ok, auto) == ("False", "gpu-auto")
        assert error == [f"backend 'nccl' cannot run here: {why}"]
