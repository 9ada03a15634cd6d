"""No thread is left inside gRPC when a worker, or a client's streams, end after the coordinator went away.

At exit the interpreter stops the daemon threads still running wherever they are; one stopped while it holds a gRPC
call's lock hangs the call's `__del__`, which runs later in that exit: the process never ends. A store whose
coordinator is gone opens a new KV stream for each call, and each stream's gRPC sender thread used to outlive it by
up to a second, so a worker that lost its coordinator exited with dozens of them (and its Background reads) still
inside gRPC, and some of those exits hung (one in fifty two-node workers in a stress loop). Real coordinators and
processes on loopback.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from axond.control import heartbeat_stream, kv_stream
from axond.control.client import connect
from axond.coordinator.server import RunningCoordinator
from axond.errors import CoordinatorError, StoreError
from axond.worker.heartbeat import Heartbeater
from control_procs import HERE, TOKEN, Procs, free_port, procs  # noqa: F401 - procs is the fixture

_GRPC_PARTS = (f"{os.sep}grpc{os.sep}", f"axond{os.sep}control{os.sep}")


_STREAM_THREADS = ("_messages", "_read", "consume_request_iterator")
"""What a stream's threads run: its sender (gRPC's, running the client's `_messages`) and its reader."""


_STREAM_FRAME = re.compile(r'File "[^"]*(grpc|axond/control)/[^"]*", line \d+, in (' + "|".join(_STREAM_THREADS) + ")")
"""A stream thread's frame in the stacks tests/helpers/exit_threads.py writes."""


def _in_streams() -> list[str]:
    """The threads of this process running a client stream's code, as 'name: file:function'."""
    frames = sys._current_frames()
    found = []
    for t in threading.enumerate():
        frame = frames.get(t.ident or 0)
        while frame is not None:
            code = frame.f_code
            if code.co_name in _STREAM_THREADS and any(part in code.co_filename for part in _GRPC_PARTS):
                found.append(f"{t.name}: {code.co_filename}:{code.co_name}")
                break
            frame = frame.f_back
    return found


def test_streams_closed_at_exit_leave_no_thread_inside_grpc_after_the_coordinator_went_away(
        coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    running = coordinator_factory(heartbeat_interval=0.2, dead_after_missed=5)
    client = connect(running.address, token=running.token, call_timeout=0.3)
    try:
        reg = client.register_node("h")
        gen = client.join("j", reg.node_id, 1, 1, 1, timeout=5.0).generation
        hb = Heartbeater(client, reg.node_id, 0.2, lease=1.0)  # beats by hand: no thread of its own
        hb.track("j", gen)
        hb.beat_now()
        store = client.store("j", gen)
        store.set("k", b"1")  # over the KV stream
        running.stop(grace=0.2)
        for _ in range(10):  # each call finds its stream ended and opens another
            with pytest.raises((CoordinatorError, StoreError)):
                store.get("k", timeout=0)
            hb.beat_now()
        assert hb.last_error, "the heartbeats to a stopped coordinator failed"
        kv_stream._close_open_streams()  # what the interpreter's exit runs
        heartbeat_stream._close_open_streams()
        assert _in_streams() == [], "stream threads still running after the streams were closed"
    finally:
        client.close()


@pytest.mark.slow  # a worker that rides out nothing: it stops at its lease (1 s) and exits
@pytest.mark.timeout(60)
def test_a_worker_that_lost_its_coordinator_exits_with_no_thread_inside_grpc(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    coordinator = procs.coordinator("coordinator", port, "--heartbeat-interval", "0.2", "--dead-after-missed", "5",
                                    "--in-memory")
    report = tmp_path / "exit-threads.txt"
    worker = procs.start("worker", [
        sys.executable, "-c", "import exit_threads; from axond.cli.main import main; main()", "worker",
        "--coordinator", f"127.0.0.1:{port}", "--token", TOKEN, "--job", "exit", "--stop-grace", "1",
        "--", sys.executable, str(HERE / "control_job.py"),
    ], env={"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "EXIT_THREADS_FILE": str(report), "CONTROL_DONE_FILE": str(tmp_path / "never"),
            "CONTROL_TIMEOUT": "100"})
    worker.wait_for("CONTROL-READY", timeout=30)
    coordinator.popen.kill()
    assert worker.wait(30) == 3, worker.text()  # lost its lease: stopped its ranks and exited 3
    left = report.read_text()
    stuck = [block for block in left.split("== ")[1:] if _STREAM_FRAME.search(block)]
    assert stuck == [], "stream threads still running when the worker exited:\n" + "\n".join(stuck)
