"""The CUDA side of the "axond" torch backend, as far as it runs without a GPU: which devices are registered,
which path a call's tensors take, the errors for CUDA tensors that cannot run here, and that the group class
used where CUDA can run (`AxondCudaProcessGroup`) still gives gloo's results for CPU tensors. The CUDA
collectives themselves are tested in tests/nccl_gpu/test_torch_cuda_gpu.py (skipped without a GPU)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed (pip install -e '.[torch]')")

import torch.distributed as dist  # noqa: E402

import torch_cases  # noqa: E402
from axond.testing import collect_from_processes  # noqa: E402
from axond.torch.devices import INSTALL_HINT, registered_devices, route, tensor_devices, why_no_cuda  # noqa: E402


def test_cuda_is_registered_only_where_torch_sees_a_gpu_and_cupy_is_installed() -> None:
    assert registered_devices(torch_has_cuda=False, cupy_installed=False) == ["cpu"]
    assert registered_devices(torch_has_cuda=False, cupy_installed=True) == ["cpu"]
    assert registered_devices(torch_has_cuda=True, cupy_installed=False) == ["cpu"]
    assert registered_devices(torch_has_cuda=True, cupy_installed=True) == ["cpu", "cuda"]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_importing_registers_cpu_only_here_and_no_module_imports_cupy() -> None:
    """One fresh interpreter: `axond.torch` registers "axond" for the CPU only on this machine without a GPU, and
    neither it nor the CUDA modules import CuPy."""
    code = ("import json, sys, torch, torch.distributed as dist, axond.torch; "
            "seen = [torch.cuda.is_available(), axond.torch.DEVICES, dist.Backend.backend_capability['axond'], "
            "'cupy' in sys.modules]; "
            "import axond.torch.cuda, axond.torch.cuda_process_group, axond.torch.cuda_work; "
            "print(json.dumps(seen + ['cupy' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    gpu, devices, capability, cupy_at_import, cupy_after_cuda_modules = json.loads(out.stdout)
    if not gpu:  # with a GPU (and CuPy) the registration includes cuda
        assert devices == ["cpu"] and capability == ["cpu"], out
    assert not cupy_at_import and not cupy_after_cuda_modules, out


def test_a_call_takes_the_path_of_its_tensors_device() -> None:
    assert route("allreduce", "g", {"cpu"}, cuda_registered=False) == "cpu"
    assert route("barrier", "g", set(), cuda_registered=True) == "cpu"
    assert route("allreduce", "g", {"cuda"}, cuda_registered=True) == "cuda"
    assert route("allreduce", "g", {"meta"}, cuda_registered=True) == "cpu"  # the CPU path refuses it by name


def test_mixing_cpu_and_cuda_tensors_in_one_call_raises() -> None:
    for registered in (False, True):
        with pytest.raises(TypeError, match=r"allgather on group 'g': the tensors are on \['cpu', 'cuda'\]; one call "
                                            r"takes tensors of one device type"):
            route("allgather", "g", {"cpu", "cuda"}, cuda_registered=registered)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_cuda_tensor_in_a_cpu_only_group_says_what_to_install() -> None:
    with pytest.raises(TypeError) as info:
        route("allreduce", "g", {"cuda"}, cuda_registered=False)
    message = str(info.value)
    assert "allreduce on group 'g'" in message
    assert "torch sees no CUDA device" in message
    assert "pip install 'axond[gpu]'" in message and ".cpu()" in message
    assert message.endswith(INSTALL_HINT)
    assert why_no_cuda() == "torch sees no CUDA device (torch.cuda.is_available() is False)"


def test_tensor_devices_looks_into_lists_of_lists() -> None:
    cpu, meta = torch.ones(2), torch.ones(2, device="meta")
    assert tensor_devices([[cpu], [cpu, cpu], None]) == {"cpu"}
    assert tensor_devices([[[cpu, cpu]], [meta]]) == {"cpu", "meta"}
    assert tensor_devices([cpu, [], 3]) == {"cpu"}
    assert tensor_devices([]) == set()


def _routing_rank(rank: int, n: int, store_dir: str, q: Any) -> None:
    """A rank whose "axond" groups are `AxondCudaProcessGroup`s, as on a GPU machine with CuPy."""
    import axond.torch

    axond.torch.DEVICES = ["cpu", "cuda"]  # what the creator sees where CUDA can run
    torch_cases.run(_routing_body, rank, n, store_dir, q)


def _routing_body(rank: int, n: int, gloo: Any) -> dict[str, Any]:
    pg = dist.distributed_c10d._get_default_group()
    errors = []
    for call in (lambda: pg.allreduce([torch.ones(2), torch.ones(2, device="meta")]),  # the mixed call: refused
                 lambda: pg.allreduce([torch.ones(2, device="meta")])):  # one other device: the CPU path refuses it
        try:
            call()
            errors.append("no error")
        except TypeError as e:
            errors.append(str(e))
    sync_bytes, overlap = type(pg).SYNC_BYTES, pg.overlap
    type(pg).SYNC_BYTES, type(pg).SYNC_WHEN_WAITED = -1, False  # every op through axond's async ops too
    pg.overlap = True
    try:
        collectives_async = torch_cases.collectives(rank, n, gloo)
    finally:
        type(pg).SYNC_BYTES, type(pg).SYNC_WHEN_WAITED = sync_bytes, True
        pg.overlap = overlap
    return {"class": type(pg).__name__, "errors": errors, "collectives": torch_cases.collectives(rank, n, gloo),
            "collectives_async": collectives_async, "ddp": torch_cases.ddp(rank, n, gloo),
            "fsdp": torch_cases.fsdp(rank, n, gloo)}


@pytest.mark.slow
def test_the_cuda_capable_group_class_gives_gloos_results_for_cpu_tensors() -> None:
    items, codes = collect_from_processes(functools.partial(_routing_rank), 2, expect=2, timeout=240)
    failures = [res for _, ok, res in items if not ok]
    assert not failures, failures[0]
    assert codes == [0, 0], codes
    for _, _, res in items:
        assert res["class"] == "AxondCudaProcessGroup"
        mixed, meta = res["errors"]
        assert "allreduce on group '0': the tensors are on ['cpu', 'meta']; one call takes tensors of one" in mixed
        assert "allreduce tensor is on meta; the axond backend moves CPU tensors" in meta, meta
        for section in ("collectives", "collectives_async"):
            assert res[section][0].startswith("ok") and int(res[section][0].split()[1]) > 100, res[section]
        assert res["ddp"] == [] and res["fsdp"] == [], (res["ddp"], res["fsdp"])
