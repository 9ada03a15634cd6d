"""The native API and axond's examples under torch's real torchrun (`python -m torch.distributed.run`).

torchrun's agent serves a torch TCPStore on MASTER_PORT and sets TORCHELASTIC_USE_AGENT_STORE=True: every rank
must be a client of it (rank 0 may not serve a store of its own there). Checked in both of torchrun's modes:
the static rendezvous (`--master-addr/--master-port --nnodes 2 --node-rank`) with the torch-compat page's own
snippet, and `--standalone` with `-m axond.examples.train_mlp`.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # the real torchrun launching real ranks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for name in ("AXOND_COORDINATOR", "AXOND_FILE_STORE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {TIMEOUT} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def _compat_snippet(tmp_path: Path) -> Path:
    """docs/torch-compat.md's first snippet, which says it runs under torchrun, plus a line printing its result."""
    text = (ROOT / "docs" / "torch-compat.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None and 'init_process_group("gloo", "env://")' in code.group(1)
    body = code.group(1).replace(
        "axond.destroy_process_group()",
        'open(f"result-{axond.get_rank()}", "w").write(repr((t.tolist(), [o.tolist() for o in out])))\n'
        "axond.destroy_process_group()")
    script = tmp_path / "compat.py"
    script.write_text(body)
    return script


def _check_results(where: Path) -> None:
    """Each rank's all_reduce of its rank (0 + 1) and the all_gather of that."""
    for rank in (0, 1):
        assert (where / f"result-{rank}").read_text() == "([1.0], [[1.0], [1.0]])"


def test_docs_snippet_under_torchrun_static_rendezvous(tmp_path: Path) -> None:
    script = _compat_snippet(tmp_path)
    port = str(_free_port())
    procs = [_torchrun("--master-addr", "127.0.0.1", "--master-port", port, "--nnodes", "2", "--node-rank", str(n),
                       "--nproc-per-node", "1", str(script), cwd=tmp_path) for n in (0, 1)]
    for p in procs:
        _finish(p)
    _check_results(tmp_path)


def test_example_module_under_torchrun_standalone(tmp_path: Path) -> None:
    """`--standalone` (the agent's store on a port torchrun picked) with `-m`: the same `env://` path as the snippet."""
    out = _finish(_torchrun("--standalone", "--nproc-per-node", "2", "-m", "axond.examples.train_mlp",
                            "--epochs", "1", "--samples", "256", "--checkpoint", "", cwd=tmp_path))
    assert "epoch 1/1 loss" in out, out
