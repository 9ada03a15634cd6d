"""Run by tests/worker/test_worker_live_recovery.py under `axond worker --live-recovery`: plain all_reduces in a loop,
the documented way to catch `axond.MembershipChanged` and `axond.reform()` outside the trainer.

argv: OUT_DIR. The process that starts as rank 2 stops before its all_reduce 10 (writes `hang-PID`, then sleeps) so
that the test can SIGKILL it; the others record what they caught and their place after `reform()` in
`end-PID.json`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import axond

ROUNDS, HANG_AT = 30, 10


def main() -> None:
    out = Path(sys.argv[1])
    axond.init_process_group("tcp", timeout=30)
    start_rank = axond.get_rank()
    caught: list[dict[str, object]] = []
    sums: list[float] = []
    done = 0
    while done < ROUNDS:
        if start_rank == 2 and done == HANG_AT:
            (out / f"hang-{os.getpid()}").write_text("")
            time.sleep(120)
        x = np.ones(4, np.float32)
        try:
            axond.all_reduce(x)
        except axond.MembershipChanged as e:
            group = axond.reform()
            caught.append({"reason": e.reason, "generation": e.generation, "previous": e.previous_generation,
                           "op": e.op, "distributed_error": isinstance(e, axond.DistributedError),
                           "rank": group.rank, "size": group.size,
                           "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "AXOND_GENERATION")}})
            continue  # the cut all_reduce runs again in the new group
        sums.append(float(x[0]))
        done += 1
    (out / f"end-{os.getpid()}.json").write_text(json.dumps({"start_rank": start_rank, "caught": caught,
                                                             "sums": sums}))
    axond.destroy_process_group()


if __name__ == "__main__":
    main()
