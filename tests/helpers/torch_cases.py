"""Rank bodies of tests/torch/test_torch_backend.py: each process joins "axond" as the default group and a
gloo group over the same ranks, runs the same thing on both, and reports what differs."""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16]


def join(rank: int, n: int, store_dir: str, timeout: float = 20.0) -> Any:
    """Default group over "axond" (torch's FileStore), plus a gloo group on the same ranks (the reference)."""
    import axond.torch  # noqa: F401 -- registers the backend

    store = dist.FileStore(os.path.join(store_dir, "torch-store"), n)
    dist.init_process_group("axond", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=timeout))
    gloo = dist.new_group(list(range(n)), backend="gloo")
    _STORE_DIRS[id(gloo)] = store_dir
    return gloo


_STORE_DIRS: dict[int, str] = {}


def _store_dir(gloo: Any) -> str:
    path = os.path.join(_STORE_DIRS[id(gloo)], "axond-store")
    os.makedirs(path, exist_ok=True)
    return path


def run(body: Any, rank: int, n: int, store_dir: str, q: Any) -> None:
    """Run `body(rank, n, gloo)` and put (rank, ok, result or traceback) on `q`."""
    try:
        gloo = join(rank, n, store_dir)
        result = body(rank, n, gloo)
        dist.destroy_process_group()
        q.put((rank, True, result))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def _values(dtype: torch.dtype, shape: tuple[int, ...], rank: int, salt: int = 0) -> torch.Tensor:
    """Small exact integers (products stay exact in every dtype), different per rank."""
    base = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).reshape(shape)
    return ((base * 3 + rank * 5 + salt) % 7 + 1).to(dtype)


def collectives(rank: int, n: int, gloo: Any) -> list[str]:
    """Every collective on both groups for every dtype; the list of cases whose results differ."""
    bad: list[str] = []
    checked = 0

    def same(case: str, ours: Any, theirs: Any) -> None:
        nonlocal checked
        checked += 1
        ours, theirs = list(ours), list(theirs)
        if len(ours) != len(theirs) or not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs)):
            bad.append(f"{case}: axond {ours} != gloo {theirs}")

    def both(fn: Any) -> tuple[Any, Any]:
        return fn(None), fn(gloo)

    for dtype in DTYPES:
        d = str(dtype).replace("torch.", "")
        x = _values(dtype, (2 * n, 3), rank)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
            def allreduce(g: Any, op: Any = op) -> list[torch.Tensor]:
                t = x.clone()
                dist.all_reduce(t, op=op, group=g)
                return [t]
            same(f"all_reduce {op} {d}", *both(allreduce))
        if not dtype.is_floating_point and not dtype.is_complex:
            for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
                def bitwise(g: Any, op: Any = op) -> list[torch.Tensor]:
                    t = x.clone()
                    dist.all_reduce(t, op=op, group=g)
                    return [t]
                same(f"all_reduce {op} {d}", *both(bitwise))
        if dtype.is_floating_point:
            t = x.clone()
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            s = x.clone()
            dist.all_reduce(s, group=gloo)
            same(f"all_reduce AVG {d} (gloo: SUM / n)", [t], [(s.float() / n).to(dtype)])
            premul = dist._make_nccl_premul_sum(0.5)  # a power of two: 0.5 a + 0.5 b == 0.5 (a + b) exactly
            t = x.clone()
            dist.all_reduce(t, op=premul)
            same(f"all_reduce PREMUL_SUM {d} (gloo: SUM * 0.5)", [t], [s * 0.5])
            out = torch.empty((2, 3), dtype=dtype)
            before = x.clone()
            dist.reduce_scatter_single(out, x, op=premul)
            same(f"reduce_scatter_single PREMUL_SUM {d} (gloo: SUM * 0.5)", [out, x], [s.chunk(n)[rank] * 0.5, before])
        strided = x.t()  # non-contiguous: staged through a copy
        same(f"all_reduce non-contiguous {d}", *both(lambda g: _inplace(dist.all_reduce, strided.clone().t().t(), g)))

        def broadcast(g: Any) -> list[torch.Tensor]:
            t = x.clone()
            dist.broadcast(t, src=n - 1, group=g)
            return [t]
        same(f"broadcast {d}", *both(broadcast))

        def all_gather(g: Any) -> list[torch.Tensor]:
            out = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(out, x, group=g)
            return out
        same(f"all_gather {d}", *both(all_gather))

        def all_gather_single(g: Any) -> list[torch.Tensor]:
            out = torch.empty((n * x.shape[0], 3), dtype=dtype)
            dist.all_gather_single(out, x, group=g)
            return [out]
        same(f"all_gather_into_tensor {d}", *both(all_gather_single))

        def reduce_scatter_tensor(g: Any) -> list[torch.Tensor]:
            out = torch.empty((2, 3), dtype=dtype)
            before = x.clone()
            dist.reduce_scatter_single(out, x, group=g)
            return [out, before - x]  # the input stays untouched
        same(f"reduce_scatter_tensor {d}", *both(reduce_scatter_tensor))

        def reduce_scatter(g: Any) -> list[torch.Tensor]:
            out = torch.empty((2, 3), dtype=dtype)
            dist.reduce_scatter(out, list(x.chunk(n)), group=g)
            return [out]
        same(f"reduce_scatter {d}", *both(reduce_scatter))

        def all_to_all_single(g: Any) -> list[torch.Tensor]:
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=g)
            return [out]
        same(f"all_to_all_single {d}", *both(all_to_all_single))

        sends = [i + 1 + rank for i in range(n)]  # uneven: rank r sends i + 1 + r rows to rank i
        receives = [rank + 1 + j for j in range(n)]
        y = _values(dtype, (sum(sends), 2), rank, salt=1)

        def uneven(g: Any) -> list[torch.Tensor]:
            out = torch.empty((sum(receives), 2), dtype=dtype)
            dist.all_to_all_single(out, y, output_split_sizes=receives, input_split_sizes=sends, group=g)
            return [out]
        same(f"all_to_all_single uneven {d}", *both(uneven))

        def all_to_all(g: Any) -> list[torch.Tensor]:
            out = [torch.empty((receives[j], 2), dtype=dtype) for j in range(n)]
            dist.all_to_all(out, list(y.split(sends)), group=g)
            return out
        same(f"all_to_all uneven lists {d} (gloo: all_to_all_single)", [torch.cat(all_to_all(None))], uneven(gloo))

        def gather(g: Any) -> list[torch.Tensor]:
            out = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
            dist.gather(x, out, dst=0, group=g)
            return out or []
        same(f"gather {d}", *both(gather))

        def scatter(g: Any) -> list[torch.Tensor]:
            out = torch.empty_like(x)
            dist.scatter(out, [_values(dtype, x.shape, i, salt=2) for i in range(n)] if rank == 1 else None, src=1,
                         group=g)
            return [out]
        same(f"scatter {d}", *both(scatter))

        def reduce(g: Any) -> list[torch.Tensor]:
            t = x.clone()
            dist.reduce(t, dst=1, op=dist.ReduceOp.MAX, group=g)
            return [t] if rank == 1 else []
        same(f"reduce {d}", *both(reduce))

        def ring(g: Any) -> list[torch.Tensor]:
            got = torch.empty_like(x)
            ops = [dist.P2POp(dist.isend, x, (rank + 1) % n, g), dist.P2POp(dist.irecv, got, (rank - 1) % n, g)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            return [got]
        same(f"batch_isend_irecv {d}", *both(ring))

        def send_recv(g: Any) -> list[torch.Tensor]:
            got = torch.empty_like(x)
            if rank == 0:
                dist.send(x, 1, group=g)
            elif rank == 1:
                dist.recv(got, 0, group=g)
                return [got]
            return []
        same(f"send/recv {d}", *both(send_recv))

    for dtype in (torch.int8, torch.uint8, torch.int16, torch.bool, torch.complex64):  # gloo lacks some: local reference
        d = str(dtype).replace("torch.", "")
        xs = [_values(torch.int64, (2 * n, 3), r) for r in range(n)]
        xs = [v > 3 for v in xs] if dtype == torch.bool else [v.to(dtype) for v in xs]
        folds = {dist.ReduceOp.SUM: (lambda a, b: a | b) if dtype == torch.bool else torch.add}
        if not dtype.is_complex:
            folds.update({dist.ReduceOp.BAND: torch.bitwise_and, dist.ReduceOp.BOR: torch.bitwise_or,
                          dist.ReduceOp.BXOR: torch.bitwise_xor})
            folds[dist.ReduceOp.MIN] = torch.minimum
            folds[dist.ReduceOp.MAX] = torch.maximum
        for op, fold in folds.items():
            expected = xs[0]
            for v in xs[1:]:
                expected = fold(expected, v)
            same(f"all_reduce {op} {d}", _inplace(lambda t, group, op=op: dist.all_reduce(t, op=op, group=group),
                                                   xs[rank].clone(), None), [expected])
        same(f"broadcast {d}", _inplace(lambda t, group: dist.broadcast(t, 1, group=group), xs[rank].clone(), None),
             [xs[1]])
        out = [torch.empty_like(xs[0]) for _ in range(n)]
        dist.all_gather(out, xs[rank])
        same(f"all_gather {d}", out, xs)

    def objects(g: Any) -> list[torch.Tensor]:
        got: list[Any] = [None] * n
        dist.all_gather_object(got, {"rank": rank, "tag": "x" * rank}, group=g)
        box = [{"from": rank}] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0, group=g)
        return [torch.tensor([len(repr(got)), len(repr(box))])]
    same("object collectives", *both(objects))
    outs = [torch.full((4,), float(rank + k)) for k in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in outs]
    for w in reversed(works):  # the last first: the waiting thread may complete it only after the ones before it
        w.wait()
    expect = [torch.full((4,), float(sum(range(n)) + n * k)) for k in range(3)]
    if not all(torch.equal(a, b) for a, b in zip(outs, expect)):
        bad.append(f"async all_reduces waited last first: {outs}")
    dist.barrier()
    return bad if bad else [f"ok {checked}"]


def _inplace(fn: Any, t: torch.Tensor, g: Any) -> list[torch.Tensor]:
    fn(t, group=g)
    return [t]


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()


def _steps(model: torch.nn.Module, params: Any, rank: int, steps: int = 4) -> list[torch.Tensor]:
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
        y = torch.randn(16, 4, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ddp(rank: int, n: int, gloo: Any) -> list[str]:
    """torch DDP over axond and over gloo from the same seeds: parameters must be identical."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = []
    for group in (None, gloo):
        model = DDP(mlp(seed=7 + rank), process_group=group, bucket_cap_mb=0.001)  # rank-dependent init: DDP syncs it
        results.append(_steps(model, model.parameters(), rank))
    return [f"{i}: max diff {float((a - b).abs().max())}" for i, (a, b) in enumerate(zip(*results)) if not torch.equal(a, b)]


def ddp_hook_waiting_in_its_callback(rank: int, n: int, gloo: Any) -> list[str]:
    """A DDP comm hook whose future callback runs another all_reduce of the same group and waits for it, as torch's
    PowerSGD hook does: the callbacks must not run where that op needs to complete. Parameters equal gloo's."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations, which would be strings here
        fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()

        def then(f: torch.futures.Future) -> torch.Tensor:
            extra = torch.ones(20_000, dtype=torch.float64)  # 160 KB: an async op, not one run at once
            dist.all_reduce(extra, group=group, async_op=True).get_future().wait()
            return f.value()[0].div_(extra[0].item())

        return fut.then(then)

    results = []
    for group in (None, gloo):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(8, 5000), torch.nn.Tanh(), torch.nn.Linear(5000, 4)).double()
        wrapped = DDP(model, process_group=group)  # its buckets (over 64 KB) go through axond's async ops
        wrapped.register_comm_hook(group, hook)
        results.append(_steps(wrapped, wrapped.parameters(), rank, steps=3))
    return [f"{i}: max diff {float((a - b).abs().max())}" for i, (a, b) in enumerate(zip(*results)) if not torch.equal(a, b)]


def fsdp(rank: int, n: int, gloo: Any) -> list[str]:
    """FSDP2 fully_shard over a DeviceMesh of axond and of gloo: the same full parameters after training."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results = []
    for mesh in (init_device_mesh("cpu", (n,)), DeviceMesh.from_group(gloo, "cpu")):
        model = mlp(seed=7)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _steps(model, model.parameters(), rank)
        results.append([p.full_tensor() for p in model.parameters()])
    return [f"{i}: max diff {float((a - b).abs().max())}" for i, (a, b) in enumerate(zip(*results)) if not torch.equal(a, b)]


def mismatched_peer(rank: int, n: int, store_dir: str, q: Any) -> None:
    """Rank 0 all_reduces while rank 1 broadcasts: both raise naming the ops, within the group timeout (after one
    all_reduce of the same shape together: rank 0's is the prepared one, see `mailbox_ops.SmallAllReduce`)."""
    try:
        join(rank, n, store_dir, timeout=4.0)
        dist.all_reduce(torch.ones(8))
        start = time.monotonic()
        try:
            if rank == 0:
                dist.all_reduce(torch.ones(8))
            else:
                dist.broadcast(torch.ones(8), src=0)
        except Exception as e:
            q.put((rank, type(e).__name__, str(e), time.monotonic() - start))
            return
        q.put((rank, "no error", "", time.monotonic() - start))
    except BaseException:
        q.put((rank, "setup failed", traceback.format_exc(), 0.0))


def dead_peer(rank: int, n: int, store_dir: str, q: Any) -> None:
    """Rank 1 dies after joining; rank 0's all_reduce must raise naming the op, within the group timeout."""
    try:
        join(rank, n, store_dir, timeout=4.0)
        dist.barrier()
        if rank == 1:
            os._exit(3)
        time.sleep(0.5)
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1 << 16))
        except Exception as e:  # torch may wrap axond's error; its message must survive
            q.put((rank, type(e).__name__, str(e), time.monotonic() - start))
            return
        q.put((rank, "no error", "", time.monotonic() - start))
    except BaseException:
        q.put((rank, "setup failed", traceback.format_exc(), 0.0))


def waited_at_once(rank: int, n: int, gloo: Any) -> list[str]:
    """Ops torch waits for at once (its options' asyncOp False, as `dist.all_reduce(t)` sets) run on the calling
    thread whatever their size: the Work comes back completed. With asyncOp True a large op runs asynchronously,
    and a wait completes it, its future too."""
    from axond.torch import AxondProcessGroup

    pg = dist.group.WORLD
    assert isinstance(pg, AxondProcessGroup)
    bad: list[str] = []
    big = AxondProcessGroup.SYNC_BYTES  # float32 elements: 4x the bytes that run on the calling thread anyway
    for kind, options in (("allreduce", dist.AllreduceOptions()), ("broadcast", dist.BroadcastOptions())):
        for at_once in (True, False):
            t = torch.full((big,), float(rank + 1))
            options.asyncOp = not at_once
            work = pg.allreduce([t], options) if kind == "allreduce" else pg.broadcast([t], options)
            if at_once and not work.is_completed():
                bad.append(f"{kind} of {t.nbytes} bytes with asyncOp False came back not completed")
            work.wait()
            want = float(n * (n + 1) // 2) if kind == "allreduce" else 1.0
            if not torch.equal(t, torch.full((big,), want)):
                bad.append(f"{kind} asyncOp {not at_once}: {t[:4]}")
            work.get_future().wait()  # completed on a completion thread, maybe just after the Work
    return bad


def overlap_policy(rank: int, n: int, gloo: Any) -> list[str]:
    """By default async collectives over SYNC_BYTES overlap (the communication thread) only where every rank on the
    host has a core to spare; without overlap they run on the calling thread and come back completed, with it
    they come back as the communication thread's Work; the results are the same either way."""
    from axond.torch import AxondProcessGroup
    from axond.torch.launching import overlaps

    pg = dist.group.WORLD
    assert isinstance(pg, AxondProcessGroup)
    bad: list[str] = []
    backend = pg.axond_group.backend
    if backend.host_ranks != n:  # type: ignore[union-attr]
        bad.append(f"host_ranks {backend.host_ranks}, want {n}")  # type: ignore[union-attr]
    want = overlaps(n, len(os.sched_getaffinity(0)), torch.get_num_threads())
    if pg.overlap != want:
        bad.append(f"overlap {pg.overlap} by default, want {want}")
    saved = pg.overlap
    options = dist.AllreduceOptions()
    options.asyncOp = True
    try:
        for overlap, kind in ((False, "DoneWork"), (True, "AxondWork")):
            pg.overlap = overlap
            t = torch.full((AxondProcessGroup.SYNC_BYTES,), float(rank + 1))  # 4x SYNC_BYTES bytes
            work = pg.allreduce([t], options)
            if type(work).__name__ != kind or (not overlap and not work.is_completed()):
                bad.append(f"overlap {overlap}: {type(work).__name__}, completed {work.is_completed()}, want {kind}")
            work.wait()
            if not torch.equal(t, torch.full_like(t, float(n * (n + 1) // 2))):
                bad.append(f"overlap {overlap}: {t[:4]}")
    finally:
        pg.overlap = saved
    return bad


def parity(rank: int, n: int, gloo: Any) -> dict[str, list[str]]:
    """Every comparison of one process launch (torch's start-up dominates the tests' time), by section."""
    from axond.torch import AxondProcessGroup

    pg = dist.group.WORLD
    assert isinstance(pg, AxondProcessGroup)
    sync_bytes, overlap = AxondProcessGroup.SYNC_BYTES, pg.overlap
    AxondProcessGroup.SYNC_BYTES, AxondProcessGroup.SYNC_WHEN_WAITED = -1, False  # every op through axond's async
    pg.overlap = True  # ops (whatever the host's cores), then completed on the waiting thread (Completer.complete)
    try:  # or the completion thread (DDP's buckets)
        run_async = {"collectives_async": collectives(rank, n, gloo), "ddp_async": ddp(rank, n, gloo)}
    finally:
        AxondProcessGroup.SYNC_BYTES, AxondProcessGroup.SYNC_WHEN_WAITED = sync_bytes, True
        pg.overlap = overlap
    return {**run_async, "collectives": collectives(rank, n, gloo), "ddp": ddp(rank, n, gloo), "fsdp": fsdp(rank, n, gloo),
            "tensor_parallel": tensor_parallel(rank, n, gloo), "axond_api": axond_api_with_tensors(rank, n, gloo),
            "waited_at_once": waited_at_once(rank, n, gloo), "overlap_policy": overlap_policy(rank, n, gloo),
            "hook_waiting_in_callback": ddp_hook_waiting_in_its_callback(rank, n, gloo)}


def tensor_parallel(rank: int, n: int, gloo: Any) -> list[str]:
    """DTensor tensor parallelism (column- then row-parallel Linear) over axond and over gloo, and unsharded."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)  # the same on every rank
    results = []
    for mesh in (init_device_mesh("cpu", (n,)), DeviceMesh.from_group(gloo, "cpu"), None):
        model = mlp(seed=3)
        if mesh is not None:
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        out = model(x)
        out.sum().backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        results.append([out.detach(), *grads])
    bad = [f"{i}: axond {a} != gloo {b}" for i, (a, b) in enumerate(zip(results[0], results[1])) if not torch.equal(a, b)]
    # against one process: the row-parallel sum adds partial products in another order (float64, 1e-12 is ample)
    bad += [f"{i}: axond {a} != unsharded {b}" for i, (a, b) in enumerate(zip(results[0], results[2]))
            if not torch.allclose(a, b, rtol=1e-12, atol=1e-12)]
    return bad


def axond_api_with_tensors(rank: int, n: int, gloo: Any) -> list[str]:
    """axond's own collectives given torch tensors, on an axond default group beside torch's."""
    import axond

    axond.init_process_group("tcp", 20.0, rank=rank, world_size=n, store=axond.FileStore(_store_dir(gloo)))
    bad = []
    for dtype in DTYPES:
        t = _values(dtype, (4, 3), rank)
        expected = sum(_values(dtype, (4, 3), r).double() for r in range(n)).to(dtype)
        axond.all_reduce(t)
        if not torch.equal(t, expected):
            bad.append(f"all_reduce {dtype}: {t} != {expected}")
        strided = _values(dtype, (3, 4), rank).t()
        axond.all_reduce(strided, op=dist.ReduceOp.MAX)
        if not torch.equal(strided, torch.maximum(*[_values(dtype, (3, 4), r) for r in range(n)]).t()):
            bad.append(f"all_reduce non-contiguous MAX {dtype}: {strided}")
        gathered = axond.all_gather(_values(dtype, (2,), rank))
        if not (isinstance(gathered, torch.Tensor) and gathered.dtype == dtype
                and torch.equal(gathered, torch.stack([_values(dtype, (2,), r) for r in range(n)]))):
            bad.append(f"all_gather {dtype}: {gathered!r}")
        b = _values(dtype, (5,), rank)
        axond.broadcast(b, src=1)
        if not torch.equal(b, _values(dtype, (5,), 1)):
            bad.append(f"broadcast {dtype}: {b}")
    t = torch.ones(8)
    work = axond.all_reduce(t, async_op=True)
    work.wait()
    if not torch.equal(t, torch.full((8,), float(n))):
        bad.append(f"async all_reduce: {t}")
    axond.destroy_process_group()
    return bad


def over_axond_url(address: str, rank: int, n: int, store_dir: str, q: Any) -> None:
    """Join with init_method="axond://HOST:PORT?job=torchjob" (no axond launcher), then all_reduce and new_group."""
    try:
        import axond.torch  # noqa: F401

        for i in range(2):  # a second init in the same process, after destroy, starts afresh
            if i == 1 and rank == 0:
                time.sleep(1.0)  # rank 1 looks up rank 0's address first: it must not find the first init's
            dist.init_process_group("axond", init_method=f"axond://{address}?job=torchjob", rank=rank, world_size=n,
                                    timeout=timedelta(seconds=20))
            t = torch.full((3,), float(rank + 1))
            dist.all_reduce(t)
            sub = dist.new_group([0, 1])
            s = torch.ones(2)
            dist.all_reduce(s, group=sub)
            result = [t.tolist(), s.tolist(), dist.get_backend()]
            dist.destroy_process_group()
        q.put((rank, True, result))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
