"""Serving concerns: clean stop on SIGTERM/SIGINT, port conflicts, many parked waiters."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import grpc.aio
import pytest

from axond.control.client import connect
from axond.coordinator.server import CoordinatorConfig, RunningCoordinator, start_coordinator
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_coordinator_stops_cleanly_on_signal(sig: signal.Signals) -> None:
    port = free_port()
    code = (
        "from axond.coordinator.server import CoordinatorConfig, run_coordinator; "
        f"raise SystemExit(run_coordinator(CoordinatorConfig(host='127.0.0.1', port={port})))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        with connect(f"127.0.0.1:{port}", call_timeout=2.0) as c:
            deadline = time.monotonic() + 30
            while not c.health(timeout=1.0):
                assert proc.poll() is None and time.monotonic() < deadline, "the coordinator did not start"
                time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, err
    assert f"listening on 127.0.0.1:{port}" in err and "stopped" in err


def test_port_in_use_is_a_clear_error(coordinator: RunningCoordinator) -> None:
    with pytest.raises(CoordinatorError, match=f"cannot listen on 127.0.0.1:{coordinator.port}"):
        start_coordinator(CoordinatorConfig(host="127.0.0.1", port=coordinator.port))


def test_stop_and_wait(coordinator_factory: Callable[..., RunningCoordinator]) -> None:
    running = coordinator_factory()
    assert running.address == f"127.0.0.1:{running.port}" and running.port > 0
    assert not running.wait(0.05)
    running.stop(grace=0.1)
    assert running.wait(5.0)
    running.stop()


def test_many_parked_waiters_do_not_starve_other_calls(client, coordinator: RunningCoordinator) -> None:  # type: ignore[no-untyped-def]
    node = client.register_node("h").node_id
    gen = client.join("j", node, 1, 1, 1, timeout=5.0).generation

    wait_s, parked = 30, 500
    admission = coordinator.admission
    assert admission is not None

    async def run() -> tuple[float, list[bytes]]:
        auth = [("authorization", f"Bearer {coordinator.token}")]  # the generated token
        async with grpc.aio.insecure_channel(coordinator.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            waiters = [
                asyncio.ensure_future(stub.KvGet(pb.KvGetRequest(job="j", generation=gen, key="go", wait_s=wait_s), timeout=wait_s + 10, metadata=auth))
                for _ in range(parked)
            ]
            deadline = time.monotonic() + wait_s / 2
            while admission.running[0] < parked:  # every waiter admitted and parked on the server
                assert time.monotonic() < deadline, f"only {admission.running[0]} of {parked} waiters parked"
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            await stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=auth)
            status_latency = time.monotonic() - t0
            await stub.KvSet(pb.KvSetRequest(job="j", generation=gen, key="go", value=b"1"), timeout=10, metadata=auth)
            values = [r.value for r in await asyncio.wait_for(asyncio.gather(*waiters), 20)]
            return status_latency, values

    latency, values = asyncio.run(run())
    # Served beside the waiters, not after them: queued behind them it would take their wait (30 s).
    assert latency < wait_s / 6, f"GetStatus took {latency:.2f} s behind {parked} parked waiters"
    assert values == [b"1"] * 500
