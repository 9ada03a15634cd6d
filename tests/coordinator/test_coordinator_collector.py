"""The garbage collector of a coordinator process (coordinator/collector.py): tuned by `run_coordinator`, the
process that is the coordinator, and left alone by `start_coordinator` inside another program."""

from __future__ import annotations

import subprocess
import sys

import pytest

from axond.coordinator.collector import MIDDLE, OLD, YOUNG

SCRIPT = """
import gc, os, signal, threading, time
from axond.coordinator.server import CoordinatorConfig, run_coordinator, start_coordinator

config = CoordinatorConfig(host="127.0.0.1", port=0, in_memory=True, insecure=True)
before = gc.get_threshold()
running = start_coordinator(config)
embedded = gc.get_threshold()
running.stop(grace=0.2)
assert gc.get_freeze_count() == 0, gc.get_freeze_count()

def stop_once_tuned():
    deadline = time.monotonic() + 60.0
    while gc.get_threshold() == before and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=stop_once_tuned, daemon=True).start()
rc = run_coordinator(config)
print(before, embedded, gc.get_threshold(), gc.get_freeze_count() > 0, rc)
"""


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_run_coordinator_tunes_the_collector_start_coordinator_does_not() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, embedded, serving, frozen, rc = proc.stdout.strip().rsplit("\n", 1)[-1].replace(", ", ",").split(" ")
    assert embedded == before  # a coordinator inside another program leaves its collector alone
    assert serving == f"({YOUNG},{MIDDLE},{OLD})" and serving != before
    assert frozen == "True"  # what it held at startup is out of every collection
    assert rc == "0"
