"""The torch.distributed backend "axond" (`axond.torch`) against gloo, in real processes on loopback.

Every rank joins "axond" as the default group and a gloo group over the same ranks, runs the same
collective, DDP or FSDP2 training on both and compares. With two ranks and the same reduction
order, results must be bit-identical (float64 training included), so comparisons are exact.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed (pip install -e '.[torch]')")

import torch_cases  # noqa: E402
from axond.control.client import CoordinatorClient, connect  # noqa: E402
from axond.store.coordinator import CoordinatorStore  # noqa: E402
from axond.coordinator.server import RunningCoordinator  # noqa: E402
from axond.testing import collect_from_processes  # noqa: E402


def _ranks(body: object, n: int = 2, timeout: float = 60.0) -> list[object]:
    items, codes = collect_from_processes(functools.partial(torch_cases.run, body), n, expect=n, timeout=timeout)
    failures = [res for _, ok, res in items if not ok]
    assert not failures, failures[0]
    assert codes == [0] * n, codes
    return [res for _, _, res in sorted(items, key=lambda item: item[0])]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_importing_axond_does_not_import_torch() -> None:
    code = ("import sys, axond, axond.cli.main, axond.distributed.api; "
            "print('torch' in sys.modules, 'axond.torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"], out


@pytest.fixture(scope="module")
def parity() -> list[dict[str, list[str]]]:
    """One launch of two ranks running every comparison (torch's start-up is most of the time)."""
    return _ranks(torch_cases.parity)  # type: ignore[return-value]


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
@pytest.mark.parametrize("path", ["", "_async"])  # small ops on the calling thread; every op asynchronous
def test_collectives_match_gloo_for_every_dtype(parity: list[dict[str, list[str]]], path: str) -> None:
    for rank, res in enumerate(parity):
        got = res["collectives" + path]
        assert got[0].startswith("ok"), f"rank {rank}: " + "\n".join(got)
        assert int(got[0].split()[1]) > 100, got  # every case ran


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("path", ["", "_async"])
def test_ddp_trains_like_gloo(parity: list[dict[str, list[str]]], path: str) -> None:
    assert [res["ddp" + path] for res in parity] == [[], []]


def test_fsdp2_trains_like_gloo(parity: list[dict[str, list[str]]]) -> None:
    assert [res["fsdp"] for res in parity] == [[], []]


def test_dtensor_tensor_parallel_matches_gloo_and_one_process(parity: list[dict[str, list[str]]]) -> None:
    assert [res["tensor_parallel"] for res in parity] == [[], []]


def test_a_ddp_comm_hook_may_wait_for_another_collective_in_its_callback(parity: list[dict[str, list[str]]]) -> None:
    assert [res["hook_waiting_in_callback"] for res in parity] == [[], []]


def test_ops_waited_at_once_run_on_the_calling_thread(parity: list[dict[str, list[str]]]) -> None:
    assert [res["waited_at_once"] for res in parity] == [[], []]


def test_async_ops_overlap_only_where_the_host_has_cores_to_spare(parity: list[dict[str, list[str]]]) -> None:
    assert [res["overlap_policy"] for res in parity] == [[], []]


def test_overlap_decision_and_setting() -> None:
    from axond.torch.launching import overlap_setting, overlaps

    assert not overlaps(2, 2, 1)  # one core per rank: the communication thread would take the backward pass's core
    assert not overlaps(2, 3, 1)
    assert overlaps(2, 4, 1)  # a spare core per rank
    assert not overlaps(2, 8, 4) and overlaps(2, 10, 4)  # the compute threads count too
    assert [overlap_setting(env) for env in ({}, {"AXOND_TORCH_OVERLAP": "auto"}, {"AXOND_TORCH_OVERLAP": " 1"},
                                              {"AXOND_TORCH_OVERLAP": "off"})] == [None, None, True, False]
    with pytest.raises(ValueError, match="AXOND_TORCH_OVERLAP='sometimes': use auto, 1"):
        overlap_setting({"AXOND_TORCH_OVERLAP": "sometimes"})


def test_axond_collectives_take_torch_tensors(parity: list[dict[str, list[str]]]) -> None:
    assert [res["axond_api"] for res in parity] == [[], []]


@pytest.mark.slow
def test_dead_peer_raises_naming_the_op_within_the_timeout() -> None:
    items, codes = collect_from_processes(torch_cases.dead_peer, 2, expect=1, timeout=60.0)
    rank, kind, message, elapsed = items[0]
    assert rank == 0 and kind != "no error", items
    assert kind == "TorchDistributedError" and "all_reduce" in message and "peer rank 1" in message, message
    assert elapsed < 4.0 + 5.0, f"took {elapsed:.1f} s for a 4 s timeout"
    assert codes[1] == 3, codes


@pytest.mark.slow
def test_mismatched_collectives_raise_naming_both_ops() -> None:
    items, codes = collect_from_processes(torch_cases.mismatched_peer, 2, expect=2, timeout=60.0)
    for rank, kind, message, elapsed in items:
        assert kind == "TorchDistributedError", items  # axond's own error (a DistBackendError too) reaches torch code
        assert "all_reduce" in message and "broadcast" in message, message
        assert elapsed < 4.0 + 5.0, f"rank {rank} took {elapsed:.1f} s for a 4 s timeout"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


EXAMPLES = ("torch_ddp", "torch_fsdp")


@pytest.fixture(scope="module")
def examples_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each example under its own `axond worker` (two ranks, five steps), both jobs at once against one
    `axond coordinator` process (the interpreters' and torch's start-ups overlap): {example: the worker's result}."""
    tmp_path = tmp_path_factory.mktemp("examples")
    port, token = _free_port(), "torch-test-token"
    axond = [sys.executable, "-c", "from axond.cli.main import main; main()"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("AXOND_TOKEN", None)
    coord = subprocess.Popen([*axond, "coordinator", "--host", "127.0.0.1", "--port", str(port), "--token", token],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    workers: dict[str, subprocess.Popen[str]] = {}
    try:
        deadline = time.monotonic() + 30
        with connect(f"127.0.0.1:{port}", token=token, call_timeout=2.0) as c:  # not an interpreter per look
            while not c.health(timeout=1.0):
                assert time.monotonic() < deadline and coord.poll() is None, "the coordinator did not come up"
                time.sleep(0.2)
        for example in EXAMPLES:
            workers[example] = subprocess.Popen(
                [*axond, "worker", "--coordinator", f"127.0.0.1:{port}", "--token", token, "--job", example,
                 "--nproc-per-node", "2", "--", sys.executable, "-m", f"axond.examples.{example}", "--steps", "5"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        results = {}
        for example, proc in workers.items():
            out, err = proc.communicate(timeout=100)
            results[example] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return results
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=20)
        coord.terminate()
        coord.communicate(timeout=20)


@pytest.mark.timeout(150)
@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_under_the_worker(examples_run: dict[str, subprocess.CompletedProcess[str]], example: str) -> None:
    worker = examples_run[example]
    assert worker.returncode == 0, f"stdout:\n{worker.stdout}\nstderr:\n{worker.stderr}"
    assert "[rank 0] step 5/5 loss" in worker.stdout, worker.stdout
    assert "Traceback" not in worker.stderr, worker.stderr


_BEATS: list[threading.Thread] = []


def _job_store(client: CoordinatorClient, job: str, alive: threading.Event | None = None) -> CoordinatorStore:
    """A job of one node on the coordinator; with `alive`, a thread heartbeats for its node until `alive` is set
    (else the node is declared dead after a few seconds); the caller joins `_BEATS` before the client closes."""
    node = client.register_node("h").node_id
    gen = client.join(job, node, 1, 1, 1, 1, timeout=5.0).generation

    def beat(alive: threading.Event) -> None:
        while not alive.wait(0.5):
            client.heartbeat(node, job, gen)
    if alive is not None:
        _BEATS.append(threading.Thread(target=beat, args=(alive,), daemon=True))
        _BEATS[-1].start()
    return client.store(job, gen)


def test_coordinator_kv_as_a_torch_store(client: CoordinatorClient) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from axond.errors import StoreTimeout
    from axond.torch import TorchStore

    store = TorchStore(_job_store(client, "kv"), timedelta(seconds=5))
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "x") == b"x"  # empty expected: set when unset
    assert store.compare_set("c", "y", "z") == b"x"  # mismatch: the current value
    assert store.compare_set("c", "x", "z") == b"z"
    assert store.check(["a", "c"]) and not store.check(["missing"])
    assert store.delete_key("a") and not store.check(["a"])
    start = time.monotonic()
    with pytest.raises(StoreTimeout):
        store.wait(["never"], timedelta(seconds=0.5))
    assert time.monotonic() - start < 5
    prefixed = dist.PrefixStore("p", store)  # as torch wraps it
    prefixed.set("k", b"v")
    assert store.get("p/k") == b"v" and prefixed.get("k") == b"v"


@pytest.mark.slow
def test_init_method_axond_url(coordinator: RunningCoordinator, client: CoordinatorClient) -> None:
    stop = threading.Event()
    _job_store(client, "torchjob", stop)
    address = coordinator.address
    try:
        items, codes = collect_from_processes(functools.partial(torch_cases.over_axond_url, address), 2, expect=2,
                                              timeout=60.0)
    finally:
        stop.set()
        while _BEATS:
            _BEATS.pop().join(10)
    assert all(ok for _, ok, _ in items), items
    assert [res for _, _, res in sorted(items, key=lambda i: i[0])] == [[[3.0] * 3, [2.0] * 2, "axond"]] * 2
