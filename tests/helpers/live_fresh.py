"""A rank of a live job whose first generation ends before its group forms (tests/worker/test_worker_live_fresh.py).

Rank 2 of the first generation exits before it forms its group; the other ranks wait until their worker says the job
moved on, then call `axond.init_process_group()` with the first generation's variables still set: it takes their
place in the later generation. Each writes {pid, rank, world, generation, total} to OUT/fresh-PID.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import axond
from axond.distributed import membership


def main() -> None:
    out = sys.argv[1]
    if os.environ["RANK"] == "2":
        os._exit(3)  # leaves before its group forms (the job has no restarts: this process is its only rank 2)
    path = os.environ["AXOND_MEMBERSHIP_FILE"]
    first = int(os.environ["AXOND_GENERATION"])
    deadline = time.monotonic() + 60
    while (note := membership.read_note(path)) is None or note.generation <= first:
        if time.monotonic() > deadline:
            sys.exit("no later generation came within 60 s")
        time.sleep(0.02)
    axond.init_process_group("tcp", timeout=30)
    total = np.array([1.0], dtype=np.float32)
    axond.all_reduce(total)
    with open(os.path.join(out, f"fresh-{os.getpid()}.json"), "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "first_generation": first, "rank": axond.get_rank(),
                   "world": axond.get_world_size(), "generation": int(os.environ["AXOND_GENERATION"]),
                   "total": float(total[0])}, f)
    axond.destroy_process_group()


if __name__ == "__main__":
    main()
