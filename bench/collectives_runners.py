"""The libraries compared by bench/collectives.py, behind one small interface (float32 arrays)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def counts(op: str, nbytes: int, n: int) -> int:
    """Elements of the per-rank input."""
    elems = max(1, nbytes // 4)
    if op == "all_gather":
        return max(1, elems // n)
    if op == "reduce_scatter":
        return max(n, elems - elems % n)
    return elems


class Runner:
    """One library's collectives on float32 arrays; `size` is the op's total bytes as in nccl-tests."""

    rank: int
    size: int
    touch: Callable[[], Any] = staticmethod(lambda: None)
    """Set by `prepare`: writes the op's input anew with values it did not hold before (`stamp`), as a training
    step's compute does between two collectives (`--fresh-inputs`); every rank writes as many bytes (broadcast: its
    x), so the ranks stay in step."""
    stamps: int = 0

    def stamp(self) -> float:
        """A value new at every call (1, 2, ... 1000, then again; the same sequence on every rank)."""
        self.stamps += 1
        return float(self.stamps % 1000 + 1)

    def prepare(self, op: str, nbytes: int) -> tuple[Callable[[], Any], Callable[[], bool]]:
        """Return (one call, check after a fresh call with known data)."""
        raise NotImplementedError

    def max_times(self, times: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class AxondRunner(Runner):
    def __init__(self, backend: str, shared: bool = False) -> None:
        """`shared`: the ops' buffers come from `axond.shared_empty` (read by the peers on one host at memory speed)."""
        import axond

        self.ax = axond
        self.pg = axond.distributed.default_group()
        self.rank, self.size = self.pg.rank, self.pg.size
        self.xp: Any = np
        if backend == "nccl":
            import cupy

            self.xp = cupy
        self.shared = shared and backend != "nccl"

    def _zeros(self, shape: Any) -> Any:
        if self.shared:
            return self.ax.shared_empty(shape, np.float32)  # zero-filled
        return self.xp.zeros(shape, self.xp.float32)

    def prepare(self, op: str, nbytes: int) -> tuple[Callable[[], Any], Callable[[], bool]]:
        pg, xp, n, r = self.pg, self.xp, self.size, self.rank
        count = counts(op, nbytes, n)
        x = self._zeros(count)
        total = n * (n + 1) / 2
        self.touch = lambda: x.fill(self.stamp())
        if op == "all_reduce":
            def check() -> bool:
                x[...] = r + 1
                pg.all_reduce(x)
                return bool((x == total).all())
            return (lambda: pg.all_reduce(x)), check
        if op == "broadcast":
            def check_b() -> bool:
                x[...] = r + 1
                pg.broadcast(x, 0)
                return bool((x == 1).all())
            return (lambda: pg.broadcast(x, 0)), check_b
        if op == "all_gather":
            gathered = self._zeros((n, count))

            def check_g() -> bool:
                x[...] = r + 1
                out = pg.all_gather(x, out=gathered)
                return all(bool((out[i] == i + 1).all()) for i in range(n))
            return (lambda: pg.all_gather(x, out=gathered)), check_g
        y = self._zeros(count)
        y[...] = r + 1
        self.touch = lambda: y.fill(self.stamp())
        block = xp.empty(count // n, xp.float32)
        def check_rs() -> bool:
            y[...] = r + 1
            return bool((pg.reduce_scatter(y, out=block) == total).all())
        return (lambda: pg.reduce_scatter(y, out=block)), check_rs

    def max_times(self, times: np.ndarray) -> np.ndarray:
        return np.asarray(self.pg.all_gather(times)).max(axis=0)

    def barrier(self) -> None:
        self.pg.barrier()


class GlooRunner(Runner):
    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def prepare(self, op: str, nbytes: int) -> tuple[Callable[[], Any], Callable[[], bool]]:
        torch, dist, n, r = self.torch, self.dist, self.size, self.rank
        count = counts(op, nbytes, n)
        x = torch.zeros((count,), dtype=torch.float32)
        total = n * (n + 1) / 2
        self.touch = lambda: x.fill_(self.stamp())
        if op == "all_reduce":
            def check() -> bool:
                x.fill_(r + 1)
                dist.all_reduce(x)
                return bool((x == total).all())
            return (lambda: dist.all_reduce(x)), check
        if op == "broadcast":
            def check_b() -> bool:
                x.fill_(r + 1)
                dist.broadcast(x, 0)
                return bool((x == 1).all())
            return (lambda: dist.broadcast(x, 0)), check_b
        if op == "all_gather":
            outs = [torch.empty_like(x) for _ in range(n)]
            def check_g() -> bool:
                x.fill_(r + 1)
                dist.all_gather(outs, x)
                return all(bool((outs[i] == i + 1).all()) for i in range(n))
            return (lambda: dist.all_gather(outs, x)), check_g
        out = torch.empty(count // n, dtype=torch.float32)
        whole = torch.full((count,), float(r + 1))
        inputs = list(whole.chunk(n))
        self.touch = lambda: whole.fill_(self.stamp())
        def rs() -> None:
            dist.reduce_scatter(out, inputs)

        def check_rs() -> bool:
            whole.fill_(float(r + 1))
            rs()
            return bool((out == total).all())
        return rs, check_rs

    def max_times(self, times: np.ndarray) -> np.ndarray:
        t = self.torch.from_numpy(times.copy())
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.numpy()

    def barrier(self) -> None:
        self.dist.barrier()


class MpiRunner(Runner):
    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def prepare(self, op: str, nbytes: int) -> tuple[Callable[[], Any], Callable[[], bool]]:
        MPI, comm, n, r = self.MPI, self.comm, self.size, self.rank
        count = counts(op, nbytes, n)
        x = np.zeros(count, np.float32)
        total = n * (n + 1) / 2
        self.touch = lambda: x.fill(self.stamp())
        if op == "all_reduce":
            def check() -> bool:
                x[...] = r + 1
                comm.Allreduce(MPI.IN_PLACE, x)
                return bool((x == total).all())
            return (lambda: comm.Allreduce(MPI.IN_PLACE, x)), check
        if op == "broadcast":
            def check_b() -> bool:
                x[...] = r + 1
                comm.Bcast(x, 0)
                return bool((x == 1).all())
            return (lambda: comm.Bcast(x, 0)), check_b
        if op == "all_gather":
            out = np.empty(count * n, np.float32)
            def check_g() -> bool:
                x[...] = r + 1
                comm.Allgather(x, out)
                return all(bool((out[i * count : (i + 1) * count] == i + 1).all()) for i in range(n))
            return (lambda: comm.Allgather(x, out)), check_g
        x[...] = r + 1
        self.touch = lambda: x.fill(self.stamp())
        out = np.empty(count // n, np.float32)

        def check_rs() -> bool:
            x[...] = r + 1
            comm.Reduce_scatter_block(x, out)
            return bool((out == total).all())
        return (lambda: comm.Reduce_scatter_block(x, out)), check_rs

    def max_times(self, times: np.ndarray) -> np.ndarray:
        out = np.empty_like(times)
        self.comm.Allreduce(times, out, op=self.MPI.MAX)
        return out

    def barrier(self) -> None:
        self.comm.Barrier()
