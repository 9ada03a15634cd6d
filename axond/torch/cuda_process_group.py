"""`AxondCudaProcessGroup`: the "axond" torch ProcessGroup where CUDA tensors can run (torch sees a GPU, CuPy is
installed); each tensor method sends CPU tensors to `AxondProcessGroup`'s own method, unchanged, and CUDA tensors
to `CudaCollectives` (axond's NCCL backend). torch gives one Python ProcessGroup every device's calls (a
ProcessGroup subclass returned by the backend creator replaces torch's per-device dispatch), so the choice is
made per call, from the tensors' device (`axond.torch.devices.route`). barrier and the object collectives
stay on the CPU group, as with gloo."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axond.distributed.backends.base import BackendOptions
from axond.store import Store
from axond.torch.cuda import CudaCollectives
from axond.torch.devices import route, tensor_devices
from axond.torch.process_group import AxondProcessGroup


def _routed(name: str, cuda_name: str | None = None) -> Callable[..., Any]:
    """The method `name`: AxondProcessGroup's for CPU tensors, CudaCollectives' `cuda_name` for CUDA tensors."""
    on_cpu = getattr(AxondProcessGroup, name)
    on_cuda = cuda_name or name

    def method(self: AxondCudaProcessGroup, *args: Any, **kwargs: Any) -> Any:
        if route(name, self.group_name, tensor_devices([*args, *kwargs.values()]), cuda_registered=True) == "cuda":
            return getattr(self.cuda, on_cuda)(*args, **kwargs)
        return on_cpu(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = on_cpu.__doc__
    return method


class AxondCudaProcessGroup(AxondProcessGroup):
    """An `AxondProcessGroup` that also takes CUDA tensors (one device type per call)."""

    DEVICE_TYPES = ("cpu", "cuda")

    def __init__(self, store: Store, rank: int, size: int, options: BackendOptions) -> None:
        super().__init__(store, rank, size, options)
        self._cuda: CudaCollectives | None = None

    @property
    def cuda(self) -> CudaCollectives:
        """The CUDA half (its NCCL group is built by the first op on CUDA tensors)."""
        if self._cuda is None:
            self._cuda = CudaCollectives(self)
        return self._cuda

    allreduce = _routed("allreduce")
    allreduce_coalesced = _routed("allreduce_coalesced")
    broadcast = _routed("broadcast")
    reduce = _routed("reduce")
    allgather = _routed("allgather")
    allgather_coalesced = _routed("allgather_coalesced")
    all_gather_single = _routed("all_gather_single")
    allgather_into_tensor_coalesced = _routed("allgather_into_tensor_coalesced")
    all_gather_single_coalesced = _routed("all_gather_single_coalesced", "allgather_into_tensor_coalesced")
    _allgather_base = _routed("_allgather_base", "all_gather_single")
    reduce_scatter = _routed("reduce_scatter")
    reduce_scatter_single = _routed("reduce_scatter_single")
    reduce_scatter_tensor_coalesced = _routed("reduce_scatter_tensor_coalesced")
    reduce_scatter_single_coalesced = _routed("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")
    _reduce_scatter_base = _routed("_reduce_scatter_base", "reduce_scatter_single")
    alltoall = _routed("alltoall")
    all_to_all_single = _routed("all_to_all_single")
    alltoall_base = _routed("alltoall_base", "all_to_all_single")
    gather = _routed("gather")
    scatter = _routed("scatter")
    send = _routed("send")
    recv = _routed("recv")

    def shutdown(self) -> None:
        """Close the NCCL group (if a CUDA op built one), then the CPU group."""
        if self._cuda is not None:
            self._cuda.shutdown()
        super().shutdown()

    def abort(self) -> None:
        """Abort the NCCL communicator at once (peers blocked on it fail), then the CPU group."""
        if self._cuda is not None:
            self._cuda.abort(f"rank {self._rank} aborted its torch process group")
        super().abort()
