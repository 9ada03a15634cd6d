"""init_process_group and the module-level API in real processes (file store and coordinator store)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

import axond
from axond import DistributedError, InMemoryStore
from axond.control.client import CoordinatorClient
from axond.distributed.backends.registry import resolve_backend
from axond.errors import BackendUnavailable
from axond.testing import RankFailed, run_processes


def _global_rank_api() -> dict[str, object]:
    r, n = axond.get_rank(), axond.get_world_size()
    x = np.full(3, r + 1.0)
    axond.all_reduce(x)
    y = np.full(2, r, np.int64)
    axond.broadcast(y, src=n - 1)
    gathered = axond.all_gather(np.array([r]))
    odd = axond.new_group([q for q in range(n) if q % 2 == 1])
    z = np.array([float(r)])
    if odd.contains(r):
        axond.all_reduce(z, group=odd)
        w = np.array([float(r)])
        axond.broadcast(w, src=n - 1 if (n - 1) % 2 else n - 2, group=odd)
        z[0] += 100 * w[0]
    token = np.array([r * 10])
    if r == 0:
        axond.send(token, dst=n - 1, tag=5)
    elif r == n - 1:
        axond.recv(token, src=0, tag=5)
    work = axond.all_reduce(np.ones(4), op=axond.ReduceOp.AVG, async_op=True)
    assert isinstance(work, axond.Work) and work.wait()
    axond.barrier()
    odd.destroy()
    return {"sum": x[0], "bcast": int(y[0]), "gathered": gathered.ravel().tolist(), "odd": z[0],
            "token": int(token[0]), "local": axond.get_local_rank(), "init": axond.is_initialized(),
            "main": axond.is_main_process(), "world": (axond.World().rank(), axond.World().world_size())}


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("n", [2, 3])
def test_module_api_uses_global_ranks(n: int) -> None:
    out = run_processes(_global_rank_api, n, timeout=60.0)
    for r, o in enumerate(out):
        assert o["sum"] == n * (n + 1) / 2 and o["bcast"] == n - 1
        assert o["gathered"] == list(range(n))
        if r % 2:
            assert o["odd"] == 1.0 + (0 if n == 2 else 0) + 100 * 1.0
        else:
            assert o["odd"] == float(r)
        assert o["token"] == (0 if r == n - 1 else r * 10)
        assert o["local"] == r and o["init"] is True and o["main"] == (r == 0)
        assert o["world"] == (r, n)


def _coordinator_ranks() -> tuple[int, float]:
    x = np.array([axond.get_rank() + 1.0])
    axond.all_reduce(x)
    return axond.get_rank(), float(x[0])


def test_init_from_the_environment_with_the_coordinator_store(coordinator, client: CoordinatorClient) -> None:  # type: ignore[no-untyped-def]
    node = client.register_node("h").node_id
    gen = client.join("initjob", node, 1, 1, 2, 0, timeout=5.0).generation
    env = {"AXOND_COORDINATOR": coordinator.address, "AXOND_JOB": "initjob", "AXOND_GENERATION": str(gen),
           "AXOND_JOB_SECRET": "ab" * 16}
    assert run_processes(_coordinator_ranks, 2, timeout=60.0, env=env) == [(0, 3.0), (1, 3.0)]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_module_launch_reads_everything_from_the_environment(tmp_path: Path) -> None:
    (tmp_path / "axond_init_probe.py").write_text(textwrap.dedent("""
        import numpy as np
        import axond

        pg = axond.init_process_group()
        x = np.array([float(axond.get_rank())])
        axond.all_reduce(x, op=axond.ReduceOp.MAX)
        assert x[0] == axond.get_world_size() - 1, x
        assert pg.backend_name == "tcp"
        axond.destroy_process_group()
        assert not axond.is_initialized()
    """))
    assert run_processes("axond_init_probe", 3, timeout=60.0, env={"PYTHONPATH": str(tmp_path)}) == [0, 0, 0]


def _fails_on_rank_one() -> None:
    if axond.get_rank() == 1:
        raise RuntimeError("rank one is broken")
    axond.barrier()


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_run_processes_reports_the_failing_rank() -> None:
    with pytest.raises(RankFailed, match="rank 1 of 2 failed: RuntimeError"):
        run_processes(_fails_on_rank_one, 2, timeout=30.0, op_timeout=2.0)


def test_init_errors_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "AXOND_COORDINATOR", "AXOND_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DistributedError, match="RANK is not set"):
        axond.init_process_group()
    with pytest.raises(DistributedError, match="no store; set AXOND_COORDINATOR"):
        axond.init_process_group(rank=0, world_size=1)
    with pytest.raises(DistributedError, match="outside WORLD_SIZE"):
        axond.init_process_group(rank=2, world_size=2, store=InMemoryStore())
    with pytest.raises(BackendUnavailable, match="unknown backend 'ucc'"):
        axond.init_process_group("ucc", rank=0, world_size=1, store=InMemoryStore())
    with pytest.raises(DistributedError, match="not initialised"):
        axond.get_rank()
    assert not axond.is_initialized()


def test_single_process_world_and_double_init() -> None:
    pg = axond.init_process_group("auto", timeout=5.0, rank=0, world_size=1, store=InMemoryStore())
    try:
        assert axond.is_initialized() and axond.get_world_size() == 1 and pg.backend_name == "tcp"
        x = np.arange(5.0)
        axond.all_reduce(x, op=axond.ReduceOp.AVG)
        np.testing.assert_array_equal(x, np.arange(5.0))
        assert axond.scatter(np.arange(3).reshape(1, 3)).tolist() == [0, 1, 2]
        with pytest.raises(DistributedError, match="already called"):
            axond.init_process_group(rank=0, world_size=1, store=InMemoryStore())
    finally:
        axond.destroy_process_group()
    assert not axond.is_initialized()


def test_auto_backend_is_tcp_without_a_gpu() -> None:
    assert resolve_backend("auto") == "tcp"
