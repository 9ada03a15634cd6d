"""One rank of a bench/gpu.py section: `python bench/gpu_ranks.py SECTION OUT.json ARGS_JSON`.

Started by bench/gpu.py with RANK, WORLD_SIZE, AXOND_BENCH_DEVICE (the GPU) and AXOND_BENCH_STORE (a torch
FileStore path shared by the ranks); rank 0 writes the section's result to OUT.json. Needs torch with CUDA and
CuPy: it runs only on a GPU machine.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _setup() -> tuple[Any, Any, Any, int, int, int, Any]:
    import cupy
    import torch
    import torch.distributed as dist

    import axond.torch  # noqa: F401 - registers the "axond" torch backend

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = int(os.environ["AXOND_BENCH_DEVICE"])
    torch.cuda.set_device(dev)
    cupy.cuda.Device(dev).use()
    store = dist.FileStore(os.environ["AXOND_BENCH_STORE"], world)
    return cupy, torch, dist, rank, world, dev, store


def _axond_group(store: Any, rank: int, world: int, backend: str, dev: int, name: str) -> Any:
    """An axond group on CuPy arrays over the torch store (backend "nccl" or "auto")."""
    from axond.distributed.backends.base import BackendOptions
    from axond.distributed.process_group import create_group
    from axond.store.over_torch import AxondStoreOverTorch

    return create_group(AxondStoreOverTorch(store), rank, world, backend, BackendOptions(timeout=60.0, device=dev),
                        name=name)


def _per_call(fn: Callable[[], None], sync: Callable[[], None], iters: int) -> float:
    """Seconds per call of `fn` run `iters` times back to back (after 10 warm-up calls), synchronised at the end."""
    for _ in range(10):
        fn()
    sync()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - started) / iters


def blocking(args: dict[str, Any]) -> dict[str, Any]:
    cupy, torch, dist, rank, world, dev, store = _setup()
    from axond.distributed.numerics.reduce_op import ReduceOp

    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    ax = dist.new_group(backend="axond")
    pg = _axond_group(store, rank, world, "nccl", dev, "bench-blocking")
    a = torch.randn(8192, 8192, device="cuda")
    ca = cupy.from_dlpack(a)
    (a @ a).sum().item()
    torch.cuda.synchronize()
    started = time.perf_counter()
    b = a @ a
    torch.cuda.synchronize()
    kernel_ms = (time.perf_counter() - started) * 1e3
    rows = []
    for path in ("axond (CuPy arrays)", "torch nccl", "torch over axond"):
        best, ok = float("inf"), False
        for _ in range(3):
            if path.startswith("axond"):
                x = cupy.ones(2, cupy.float32)
                cupy.cuda.Device().synchronize()
                c = ca @ ca  # queued on CuPy's current stream, before the call
                started = time.perf_counter()
                pg.all_reduce(x, ReduceOp.SUM)
                host = time.perf_counter() - started
                cupy.cuda.Device().synchronize()
                ok = bool((x == world).all())
            else:
                t = torch.ones(2, device="cuda")
                torch.cuda.synchronize()
                b = a @ a
                started = time.perf_counter()
                dist.all_reduce(t, group=None if path == "torch nccl" else ax)
                host = time.perf_counter() - started
                torch.cuda.synchronize()
                ok = bool((t == world).all().item())
            best = min(best, host)
        rows.append({"path": path, "host_ms": best * 1e3, "correct": ok})
    del b, c
    pg.destroy()
    dist.destroy_process_group()
    return {"kernel_ms": kernel_ms, "rows": rows}


def per_call(args: dict[str, Any]) -> dict[str, Any]:
    cupy, torch, dist, rank, world, dev, store = _setup()
    from cupy.cuda import nccl

    from axond.distributed.numerics.reduce_op import ReduceOp

    iters = int(args["iters"])
    large_iters = max(10, iters // 40)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    ax = dist.new_group(backend="axond")
    pg = _axond_group(store, rank, world, "nccl", dev, "bench-per-call")
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    csync, tsync = cupy.cuda.Device().synchronize, torch.cuda.synchronize
    n_large = (64 << 20) // 4
    rows = []
    for path in ("raw CuPy NcclCommunicator", "axond (CuPy arrays)", "torch nccl", "torch over axond"):
        row: dict[str, Any] = {"path": path}
        for size, count, key in ((2, iters, "small_us"), (n_large, large_iters, "large_us")):
            if path.startswith(("raw", "axond")):
                x = cupy.ones(size, cupy.float32)
                if path.startswith("raw"):
                    ptr, stream = x.data.ptr, cupy.cuda.get_current_stream().ptr
                    fn = lambda: comm.allReduce(ptr, ptr, size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream)  # noqa: E731
                else:
                    fn = lambda: pg.all_reduce(x, ReduceOp.SUM)  # noqa: E731
                row[key] = _per_call(fn, csync, count) * 1e6
            else:
                t = torch.ones(size, device="cuda")
                group = None if path == "torch nccl" else ax
                row[key] = _per_call(lambda: dist.all_reduce(t, group=group), tsync, count) * 1e6
        row["large_gbs"] = (n_large * 4) / (row["large_us"] * 1e-6) / 1e9
        rows.append(row)
    pg.destroy()
    dist.destroy_process_group()
    return {"rows": rows}


def ddp(args: dict[str, Any]) -> dict[str, Any]:
    cupy, torch, dist, rank, world, dev, store = _setup()
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = int(args["steps"])
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    ax = dist.new_group(backend="axond")

    def build() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()

    models = {"nccl": DDP(build(), device_ids=[dev]), "axond": DDP(build(), device_ids=[dev], process_group=ax)}
    optims = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    gen = torch.Generator(device="cuda").manual_seed(rank)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(steps + 3):
        x = torch.randn(256, 2048, device="cuda", generator=gen)
        for k, m in models.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            optims[k].zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            optims[k].step()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - started)
    ms = {k: statistics.median(v[3:]) * 1e3 for k, v in times.items()}
    diff = max(float((p - q).abs().max()) for p, q in zip(models["nccl"].parameters(), models["axond"].parameters()))
    rows = [{"backend": "nccl", "ms": ms["nccl"], "ratio": 1.0},
            {"backend": "axond", "ms": ms["axond"], "ratio": ms["axond"] / ms["nccl"], "diff": diff}]
    dist.destroy_process_group()
    return {"rows": rows}


def two_ranks(args: dict[str, Any]) -> dict[str, Any]:
    cupy, torch, dist, rank, world, dev, store = _setup()
    from axond.distributed.numerics.reduce_op import ReduceOp

    iters = int(args["iters"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ax = dist.new_group(backend="axond")
    n = (1 << 20) // 4
    want = world * (world + 1) / 2
    rows: list[dict[str, Any]] = []

    def measure(path: str, call: Callable[[], Any], check: Callable[[], bool], sync: Callable[[], None]) -> None:
        try:
            call()
            sync()
            ok = check()
            dist.barrier()
            started = time.perf_counter()
            for _ in range(iters):
                call()
                sync()
            rows.append({"path": path, "ms": (time.perf_counter() - started) / iters * 1e3, "correct": ok})
        except Exception as e:  # noqa: BLE001 - the table says why the path failed
            rows.append({"path": path, "note": f"{type(e).__name__}: {e}"[:300]})
        dist.barrier()

    t = torch.full((n,), rank + 1.0, device="cuda")
    measure("torch CUDA tensors over gloo", lambda: dist.all_reduce(t.fill_(rank + 1.0)),
            lambda: bool((t == want).all().item()), torch.cuda.synchronize)
    u = torch.full((n,), rank + 1.0, device="cuda")
    measure('torch CUDA tensors over "axond"', lambda: dist.all_reduce(u.fill_(rank + 1.0), group=ax),
            lambda: bool((u == want).all().item()), torch.cuda.synchronize)
    try:
        pg = _axond_group(store, rank, world, "auto", dev, "bench-two-ranks")
        x = cupy.full(n, rank + 1.0, cupy.float32)
        measure(f"CuPy arrays, axond auto ({pg.backend_name})",
                lambda: (x.fill(rank + 1.0), pg.all_reduce(x, ReduceOp.SUM)),
                lambda: bool((x == want).all()), cupy.cuda.Device().synchronize)
        pg.destroy()
    except Exception as e:  # noqa: BLE001 - the table says why the path failed
        rows.append({"path": "CuPy arrays, axond auto", "note": f"{type(e).__name__}: {e}"[:300]})
    dist.destroy_process_group()
    return {"rows": rows}


SECTIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "blocking": blocking, "per_call": per_call, "ddp": ddp, "two_ranks": two_ranks}


def main(argv: list[str]) -> int:
    section, out, args = argv[0], argv[1], json.loads(argv[2])
    result = SECTIONS[section](args)
    if int(os.environ["RANK"]) == 0:
        with open(out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out + ".tmp", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
