"""A worker's scratch directory (its ranks' error and membership files): a worker killed outright leaves its
directory behind, and the next worker removes it, never one a live process holds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from axond.worker.error_files import SCRATCH_PREFIX, remove_scratch, scratch_dir

HOLD = ("from axond.worker.error_files import scratch_dir; import sys, time; print(scratch_dir(), flush=True); "
        "time.sleep(float(sys.argv[1]))")


def test_the_directory_of_a_killed_worker_goes_and_a_live_ones_stays() -> None:
    live = subprocess.Popen([sys.executable, "-c", HOLD, "60"], stdout=subprocess.PIPE, text=True)
    killed = subprocess.Popen([sys.executable, "-c", HOLD, "60"], stdout=subprocess.PIPE, text=True)
    live_dir = ""
    try:
        assert live.stdout is not None and killed.stdout is not None
        live_dir, killed_dir = live.stdout.readline().strip(), killed.stdout.readline().strip()
        killed.kill()
        killed.wait(30)
        assert os.path.basename(killed_dir).startswith(f"{SCRATCH_PREFIX}{killed.pid}-")
        assert os.path.isdir(killed_dir) and os.path.isdir(live_dir)

        older = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)  # named as an older version's worker names it: no lock
        mine = scratch_dir()
        assert not os.path.exists(killed_dir), "a killed worker's directory is removed by the next one"
        assert os.path.isdir(older), "a directory of an older worker (which holds no lock) is never removed"
        shutil.rmtree(older)
        assert os.path.isdir(live_dir), "a directory a live process holds is never removed"
        remove_scratch(mine)
        assert not os.path.exists(mine)
    finally:
        for proc in (live, killed):
            proc.kill()
            proc.wait(30)
        shutil.rmtree(live_dir, ignore_errors=True)
