"""`torch.distributed.init_process_group("axond")` without `import axond.torch`: torch's "torch.backends" entry
points register a lazy "axond" while torch imports (without importing axond), and the first group imports the real
backend. Fresh interpreters, so that nothing of this test process is registered already."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install -e '.[torch]')")

from worker_support import free_port

SCRIPT = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.rendezvous import _rendezvous_handlers
print("REGISTERED", "axond" in dist.Backend.backend_list, "axond" in _rendezvous_handlers)
print("IMPORTED", sorted(m for m in sys.modules if m == "axond" or m.startswith("axond.")))
if "axond" in dist.Backend.backend_list:
    dist.init_process_group("axond", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
    t = torch.arange(4.0)
    dist.all_reduce(t)
    print("GROUP", type(dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))).__name__,
          t.tolist())
    dist.destroy_process_group()
"""


def _run(**env: str) -> str:
    res = subprocess.run([sys.executable, "-c", SCRIPT % free_port()], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_the_entry_point_is_installed() -> None:
    found = [e for e in entry_points(group="torch.backends") if e.name == "axond"]
    assert found and found[0].value == "axond_torch_autoload:register", \
        "reinstall axond (pip install -e .): its torch.backends entry point is missing"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_init_process_group_axond_works_without_importing_axond_torch() -> None:
    out = _run()
    assert "REGISTERED True True" in out, out
    assert "IMPORTED []" in out, f"importing torch must not import axond: {out}"
    assert "GROUP AxondProcessGroup [0.0, 1.0, 2.0, 3.0]" in out, out


@pytest.mark.slow  # a fresh interpreter importing torch: the full run, not the quick loop
def test_torch_device_backend_autoload_0_turns_it_off() -> None:
    out = _run(TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert "REGISTERED False False" in out, out
