"""CUDA tensors on the torch backend "axond" (axond's NCCL backend via CuPy) against torch's own "nccl".

Runs where at least two GPUs, CuPy with NCCL and a CUDA build of torch are present; skipped elsewhere
(this project's CI machines have no GPU, so these tests have not run there). Each rank uses its own GPU,
joins "axond" as the default group and a "nccl" group over the same ranks, runs the same thing on both
and reports what differs. Values are small integers, so sums and products are exact in every dtype and
the two backends must agree bit for bit.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed (pip install -e '.[torch]')")

import torch.distributed as dist  # noqa: E402

from axond.distributed.backends.nccl import NcclBackend  # noqa: E402
from axond.testing import collect_from_processes  # noqa: E402

pytestmark = pytest.mark.gpu

WORLD = 2
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16]


@functools.lru_cache(maxsize=1)
def gpu_reason() -> str:
    """Empty if these tests can run here, else why not (evaluated lazily, at test time)."""
    if not torch.cuda.is_available():
        return "needs a CUDA build of torch and a GPU (torch.cuda.is_available() is False)"
    if not dist.is_nccl_available():
        return "needs torch built with NCCL (the reference backend)"
    ok, why = NcclBackend.is_available()
    if not ok:
        return f"needs CuPy with NCCL: {why}"
    if torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} GPUs (NCCL refuses two ranks on one device); {torch.cuda.device_count()} visible"
    return ""


@pytest.fixture(autouse=True)
def need_gpus() -> None:
    reason = gpu_reason()
    if reason:
        pytest.skip(reason)


def _rank(body: Any, rank: int, n: int, store_dir: str, q: Any) -> None:
    """Join "axond" (default group) and "nccl" on GPU `rank`, run `body(rank, n, nccl)`, report on `q`."""
    try:
        import axond.torch  # noqa: F401 -- registers the backend

        torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(store_dir, "torch-store"), n)
        dist.init_process_group("axond", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=60))
        nccl = dist.new_group(list(range(n)), backend="nccl")
        result = body(rank, n, nccl)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        q.put((rank, True, result))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def _run(body: Any, timeout: float = 300.0) -> list[Any]:
    items, codes = collect_from_processes(functools.partial(_rank, body), WORLD, expect=WORLD, timeout=timeout)
    failures = [res for _, ok, res in items if not ok]
    assert not failures, failures[0]
    assert codes == [0] * WORLD, codes
    return [res for _, _, res in sorted(items, key=lambda item: item[0])]


def _values(dtype: torch.dtype, shape: tuple[int, ...], rank: int, salt: int = 0) -> torch.Tensor:
    base = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64, device="cuda").reshape(shape)
    return ((base * 3 + rank * 5 + salt) % 7 + 1).to(dtype)


def collectives(rank: int, n: int, nccl: Any) -> list[str]:
    """Every collective on both groups for every dtype (and non-contiguous inputs); the cases that differ."""
    bad: list[str] = []

    def same(case: str, fn: Any) -> None:
        ours, theirs = fn(None), fn(nccl)
        if len(ours) != len(theirs) or not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs)):
            bad.append(f"{case}: axond {ours} != nccl {theirs}")

    for dtype in DTYPES:
        d = str(dtype)
        x = _values(dtype, (2 * n, 3), rank)
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
        for op in ops + ([dist.ReduceOp.AVG] if dtype.is_floating_point else []):
            same(f"all_reduce {op} {d}", lambda g, op=op: _inplace(lambda t: dist.all_reduce(t, op=op, group=g), x))
            same(f"all_reduce {op} {d} strided",
                 lambda g, op=op: _inplace(lambda t: dist.all_reduce(t, op=op, group=g), x.t()))
            same(f"reduce {op} {d}", lambda g, op=op: _inplace(lambda t: dist.reduce(t, 1, op=op, group=g), x))
            same(f"reduce_scatter_tensor {op} {d}", lambda g, op=op: _reduce_scatter_tensor(x, op, g, n))
            same(f"reduce_scatter {op} {d}", lambda g, op=op: _reduce_scatter(x, op, g, n))
        same(f"broadcast {d}", lambda g: _inplace(lambda t: dist.broadcast(t, 1, group=g), x))
        same(f"broadcast {d} strided", lambda g: _inplace(lambda t: dist.broadcast(t, 1, group=g), x.t()))
        same(f"all_gather {d}", lambda g: _all_gather(x, g, n))
        same(f"all_gather_into_tensor {d}", lambda g: _all_gather_into_tensor(x, g, n))
        same(f"all_to_all_single {d}", lambda g: _all_to_all_single(x, g, n, even=True))
        same(f"all_to_all_single uneven {d}", lambda g: _all_to_all_single(x, g, n, even=False))
        same(f"all_to_all {d}", lambda g: _all_to_all(x, g, n))
        same(f"gather {d}", lambda g: _gather(x, g, n, rank))
        same(f"scatter {d}", lambda g: _scatter(x, g, n, rank))
        same(f"send/recv {d}", lambda g: _send_recv(x, g, rank))
        async_works = [dist.all_reduce(t, async_op=True) for t in (x.clone(), x.clone())]
        for w in async_works:
            w.wait()
    dist.barrier()
    return bad


def _inplace(fn: Any, x: torch.Tensor) -> list[torch.Tensor]:
    t = x.clone()  # clone keeps the strides of a transposed (non-contiguous) input
    fn(t)
    return [t]


def _reduce_scatter_tensor(x: torch.Tensor, op: Any, g: Any, n: int) -> list[torch.Tensor]:
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.clone(), op=op, group=g)
    return [out]


def _reduce_scatter(x: torch.Tensor, op: Any, g: Any, n: int) -> list[torch.Tensor]:
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter(out, list(x.clone().chunk(n)), op=op, group=g)
    return [out]


def _all_gather(x: torch.Tensor, g: Any, n: int) -> list[torch.Tensor]:
    outs = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(outs, x, group=g)
    return outs


def _all_gather_into_tensor(x: torch.Tensor, g: Any, n: int) -> list[torch.Tensor]:
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=g)
    return [out]


def _all_to_all_single(x: torch.Tensor, g: Any, n: int, even: bool) -> list[torch.Tensor]:
    if even:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=g)
        return [out]
    rank = dist.get_rank()
    ins = [1 + (rank + r) % 2 for r in range(n)]  # rows sent to each rank
    outs = [1 + (r + rank) % 2 for r in range(n)]  # rows each rank sends here
    src = x[: sum(ins)].contiguous()
    out = torch.empty((sum(outs), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, src, outs, ins, group=g)
    return [out]


def _all_to_all(x: torch.Tensor, g: Any, n: int) -> list[torch.Tensor]:
    outs = [torch.empty_like(c) for c in x.chunk(n)]
    dist.all_to_all(outs, list(x.chunk(n)), group=g)
    return outs


def _gather(x: torch.Tensor, g: Any, n: int, rank: int) -> list[torch.Tensor]:
    outs = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
    dist.gather(x, outs, dst=0, group=g)
    return outs or [x]


def _scatter(x: torch.Tensor, g: Any, n: int, rank: int) -> list[torch.Tensor]:
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.scatter(out, list(x.chunk(n)) if rank == 1 else None, src=1, group=g)
    return [out]


def _send_recv(x: torch.Tensor, g: Any, rank: int) -> list[torch.Tensor]:
    got = torch.empty_like(x)
    if rank == 0:
        dist.send(x, 1, group=g)
        dist.recv(got, 1, group=g)
    else:
        dist.recv(got, 0, group=g)
        dist.send(x, 0, group=g)
    return [got]


def ddp(rank: int, n: int, nccl: Any) -> list[str]:
    """DDP on GPU `rank` over "axond" and over "nccl" from the same seeds: parameters must be identical."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = []
    for group in (None, nccl):
        torch.manual_seed(7 + rank)  # rank-dependent init: DDP broadcasts rank 0's
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).cuda()
        model = DDP(model, device_ids=[rank], process_group=group, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator(device="cuda").manual_seed(100 + rank)
        for _ in range(4):
            x = torch.randn(16, 8, generator=gen, device="cuda")
            y = torch.randn(16, 4, generator=gen, device="cuda")
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    return [f"{i}: max diff {float((a - b).abs().max())}" for i, (a, b) in enumerate(zip(*results)) if not torch.equal(a, b)]


def stream_order(rank: int, n: int, nccl: Any) -> dict[str, Any]:
    """A kernel still running on the current stream when all_reduce is called must be seen by it; wait() orders the
    current stream without blocking the host; a kernel after wait() sees the result; no synchronize in between."""
    out: dict[str, Any] = {}
    dist.all_reduce(torch.ones(1, device="cuda"))  # the first CUDA op builds the NCCL group (a rendezvous)
    t = torch.zeros(1 << 20, device="cuda")
    if rank == 1:
        time.sleep(1.0)  # rank 0's wait() must return long before this rank even calls all_reduce
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the fill: the host is far ahead of the stream
    t.fill_(rank + 1.0)
    work = dist.all_reduce(t, async_op=True)
    started = time.monotonic()
    work.wait()
    out["wait_seconds"] = time.monotonic() - started
    doubled = t * 2  # queued after wait() on the current stream: must see the sum
    out["sum_seen"] = float(doubled[0].item()) / 2
    out["expected"] = float(sum(range(1, n + 1)))
    future_work = dist.all_reduce(torch.full((4,), float(rank + 1), device="cuda"), async_op=True)
    out["future_value"] = float(future_work.get_future().wait()[0][0].item())
    return out


def test_every_collective_on_cuda_tensors_matches_nccl() -> None:
    for rank, bad in enumerate(_run(collectives)):
        assert bad == [], f"rank {rank}: " + "\n".join(bad)


def test_ddp_on_cuda_over_axond_trains_like_nccl() -> None:
    for rank, bad in enumerate(_run(ddp)):
        assert bad == [], f"rank {rank}: {bad}"


def test_ops_follow_torchs_current_stream_and_wait_does_not_block_the_host() -> None:
    results = _run(stream_order)
    for res in results:
        assert res["sum_seen"] == res["expected"], res
        assert res["future_value"] == res["expected"], res
    assert results[0]["wait_seconds"] < 0.5, results[0]  # rank 1 joined ~1 s later; wait() only orders the stream
