"""A rank of the coordinator-outage tests (tests/control/test_control_outage.py), started by `axond worker`.

Prints `CONTROL-READY rank=R generation=G` after a first all_reduce, then all-reduces (checking every result)
until the file named by CONTROL_DONE_FILE exists, and exits 0: the collectives need no coordinator, so an
outage of it must not stop them. CONTROL_TIMEOUT bounds the whole run (exit 3 past it).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import axond


def main() -> int:
    pg = axond.init_process_group(timeout=30.0)
    x = np.ones(16, np.float32)
    pg.all_reduce(x)
    print(f"CONTROL-READY rank={pg.rank} generation={os.environ['AXOND_GENERATION']}", flush=True)
    done = os.environ["CONTROL_DONE_FILE"]
    deadline = time.monotonic() + float(os.environ.get("CONTROL_TIMEOUT", "120"))
    steps = 0
    while True:
        x[...] = 1
        pg.all_reduce(x)
        if x[0] != pg.size:
            print(f"CONTROL-FAIL rank {pg.rank}: all_reduce gave {x[0]}", flush=True)
            return 2
        steps += 1
        finished = np.array([os.path.exists(done)], np.int32)
        pg.all_reduce(finished, op=axond.ReduceOp.MIN)  # every rank stops at the same step
        if finished[0]:
            break
        if time.monotonic() > deadline:
            print(f"CONTROL-FAIL rank {pg.rank}: still running after {deadline} s", flush=True)
            return 3
        time.sleep(0.02)
    axond.destroy_process_group()
    print(f"CONTROL-DONE rank={pg.rank} steps={steps}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
