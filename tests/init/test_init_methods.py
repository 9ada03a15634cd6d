"""init_process_group's torch forms: init_method URLs, "gloo", timedelta timeouts, and env:// with
MASTER_ADDR/MASTER_PORT in real processes (rank 0 serves the TCP store)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import axond
from axond import DistributedError, InMemoryStore
from axond.store.init_methods import parse, seconds
from axond.store.tcp import TCPStore

ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "AXOND_COORDINATOR", "AXOND_FILE_STORE", "MASTER_ADDR", "MASTER_PORT",
             "AXOND_JOB_SECRET")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_seconds_and_urls() -> None:
    assert seconds(timedelta(minutes=2)) == 120.0 and seconds(5) == 5.0 and seconds(0.5) == 0.5
    with pytest.raises(ValueError, match="must be positive seconds, got datetime.timedelta"):
        seconds(timedelta(0))
    with pytest.raises(TypeError, match="seconds \\(a number\\) or a datetime.timedelta, got '30'"):
        seconds("30")  # type: ignore[arg-type]
    assert parse("tcp://10.0.0.1:29500?rank=1&world_size=4") == parse("tcp://10.0.0.1:29500?rank=1&world_size=4")
    m = parse("tcp://10.0.0.1:29500?rank=1&world_size=4")
    assert (m.scheme, m.host, m.port, m.params) == ("tcp", "10.0.0.1", 29500, {"rank": "1", "world_size": "4"})
    assert parse("file:///tmp/x").path == "/tmp/x" and parse("env://").scheme == "env"
    with pytest.raises(ValueError, match="unknown scheme; use env://"):
        parse("mpi://x")
    with pytest.raises(ValueError, match="needs HOST:PORT"):
        parse("tcp://host")


def test_gloo_tcp_url_and_timedelta_in_one_process(clean_env: pytest.MonkeyPatch) -> None:
    port = _free_port()
    pg = axond.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                  timeout=timedelta(seconds=20))
    try:
        assert pg.backend_name == "tcp" and pg.timeout == 20.0 and axond.get_backend() == "tcp"
        x = np.ones(3)
        axond.all_reduce(x)
        sub = axond.new_group([0], timeout=timedelta(seconds=3))
        assert sub.timeout == 3.0
        sub.destroy()
    finally:
        axond.destroy_process_group()
    probe = TCPStore("127.0.0.1", port, is_server=True)  # the port was released by destroy_process_group
    probe.close()


def test_file_url_query_ranks_and_positional_timeout(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pg = axond.init_process_group("tcp", f"file://{tmp_path}/store?rank=0&world_size=1")
    try:
        assert (axond.get_rank(), axond.get_world_size(), pg.timeout) == (0, 1, 300.0)
    finally:
        axond.destroy_process_group()
    pg = axond.init_process_group("auto", 7.5, rank=0, world_size=1, store=InMemoryStore())  # axond's positional form
    try:
        assert pg.timeout == 7.5
    finally:
        axond.destroy_process_group()
    pg = axond.init_process_group("gloo", None, timedelta(seconds=9), 1, 0, InMemoryStore())  # torch's positional order
    try:
        assert (pg.timeout, axond.get_rank(), axond.get_world_size()) == (9.0, 0, 1)
    finally:
        axond.destroy_process_group()
    with pytest.raises(TypeError, match="either \\(timeout,\\) or torch's"):
        axond.init_process_group("gloo", 5.0, 1)


def test_init_errors_name_the_fix(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="pass init_method or store, not both"):
        axond.init_process_group("gloo", "env://", rank=0, world_size=1, store=InMemoryStore())
    with pytest.raises(TypeError, match="multiple values for argument 'init_method'"):
        axond.init_process_group("gloo", "env://", init_method="tcp://a:1", rank=0, world_size=1)
    with pytest.raises(DistributedError, match="no store; set AXOND_COORDINATOR.*or MASTER_ADDR and MASTER_PORT"):
        axond.init_process_group("gloo", "env://", rank=0, world_size=1)
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(DistributedError, match="or MASTER_PORT \\(what torchrun does"):
        axond.init_process_group("gloo", rank=0, world_size=1)
    clean_env.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(DistributedError, match="rank 1 cannot reach the store on MASTER_ADDR:MASTER_PORT"):
        axond.init_process_group("gloo", timeout=0.5, rank=1, world_size=2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        clean_env.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        with pytest.raises(DistributedError, match="rank 0 cannot serve the store on .*pick a free MASTER_PORT"):
            axond.init_process_group("gloo", rank=0, world_size=2)
    with pytest.raises(ValueError, match="timeout must be positive seconds"):
        axond.init_process_group("gloo", timeout=timedelta(seconds=-1), rank=0, world_size=1)
    assert not axond.is_initialized()


SCRIPT = textwrap.dedent("""
    import sys
    from datetime import timedelta

    import numpy as np
    import axond

    axond.init_process_group("gloo", "env://", timeout=timedelta(seconds=30))
    x = np.array([axond.get_rank() + 1.0])
    axond.all_reduce(x)
    out = [np.zeros(1) for _ in range(axond.get_world_size())]
    axond.all_gather(out, x)
    assert x[0] == 3.0 and [o[0] for o in out] == [3.0, 3.0], (x, out)
    sub = axond.new_group([0, 1], timedelta(seconds=20), "gloo")  # torch's positional order
    y = np.ones(2)
    axond.all_reduce(y, group=sub)
    assert sub.timeout == 20.0 and (y == 2.0).all(), (sub, y)
    if axond.get_rank() == 0:
        axond.send(np.array([7.0]), 1)
    else:
        z = np.zeros(1)
        assert axond.recv(z, 0) == 0 and z[0] == 7.0, z
    sub.destroy()
    axond.destroy_process_group()
    print("ok", 2, flush=True)
""")


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("secret", ["", "ab" * 16])
def test_env_init_with_master_addr_and_port_in_real_processes(tmp_path: Path, secret: str) -> None:
    """What torchrun gives a rank: MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE and nothing of axond's."""
    script = tmp_path / "torch_style.py"
    script.write_text(SCRIPT)
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    procs = []
    for rank in (1, 0):  # the client starts first: it waits for rank 0's store
        env = dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), **({"AXOND_JOB_SECRET": secret} if secret else {}))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=60)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("ok 2" in o for o in outputs), outputs
