"""Under torchrun `--max-restarts`, a restarted "axond" group reads its peers' addresses afresh: torchrun keeps one
store across attempts, so the group's rendezvous keys live under the attempt (TORCHELASTIC_RESTART_COUNT).
Without that, the restarted ranks read the dead attempt's addresses and hung until the timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install -e '.[torch]')")

pytestmark = pytest.mark.slow  # the real torchrun restarting a group

SCRIPT = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import axond.torch  # noqa: F401
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("axond", timeout=timedelta(seconds=20))
    t = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    if attempt == 0 and dist.get_rank() == 1:
        sys.exit(3)  # the first attempt fails; torchrun restarts both ranks
    dist.barrier()
    print(f"attempt {attempt} rank {dist.get_rank()} sum {t[0].item()}", flush=True)
    dist.destroy_process_group()
""")


def test_a_restarted_group_rendezvouses_afresh_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AXOND_", "MASTER_", "TORCHELASTIC_"))}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
                          "--standalone", str(script)], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "attempt 1 rank 0 sum 3.0" in out and "attempt 1 rank 1 sum 3.0" in out, out[-3000:]
