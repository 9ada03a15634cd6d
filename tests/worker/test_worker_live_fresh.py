"""A live job whose first generation ends before its ranks formed their group: they take their places in the next
generation (`axond.init_process_group()` as `axond.reform()` does), instead of exiting into a restart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from worker_support import Procs, free_port, procs  # noqa: F401

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "live_fresh.py"


def test_ranks_whose_first_generation_ended_form_the_next_one(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    procs.axond("coordinator", "--port", str(port), "--host", "127.0.0.1", "--in-memory", "--insecure",
                "--heartbeat-interval", "0.2", "--dead-after-missed", "15", "--settle-time", "5")
    workers = [procs.axond("worker", "--coordinator", f"127.0.0.1:{port}", "--nnodes", "2:3", "--job", "fresh",
                           "--live-recovery", "--max-restarts", "0", "--join-timeout", "60", "--",
                           sys.executable, str(SCRIPT), str(tmp_path)) for _ in range(3)]
    finished = [procs.finish(w, timeout=90) for w in workers]
    codes = sorted(f.code for f in finished)
    assert codes[:2] == [0, 0] and codes[2] != 0, [(f.code, f.stderr[-1500:]) for f in finished]
    results = [json.loads(p.read_text()) for p in tmp_path.glob("fresh-*.json")]
    assert len(results) == 2, [f.stderr[-1500:] for f in finished]
    for got in results:
        assert got["world"] == 2 and got["total"] == 2.0 and got["generation"] > got["first_generation"], got
    assert sorted(got["rank"] for got in results) == [0, 1]
    assert all("restarting" not in f.stderr for f in finished)
