"""axond: a distributed-training runtime (coordinator, workers, collectives, parallel wrappers)."""

from axond.distributed import (
    Backend, BackendOptions, FileStore, P2POp, ProcessGroup, ReduceOp, TCPStore, Work, all_gather,
    all_gather_into_tensor, all_gather_object, all_reduce, all_to_all, all_to_all_single, barrier, batch_isend_irecv, broadcast, broadcast_object_list, create_group,
    destroy_process_group, gather, gather_object, get_backend, get_global_rank, get_group_rank, get_local_rank,
    get_process_group_ranks, get_rank, get_world_size, init_process_group, irecv, is_available, is_initialized,
    is_nccl_available, isend, monitored_barrier, new_group, recv, reduce, reduce_scatter, reduce_scatter_tensor,
    scatter, scatter_object_list, send, shared_empty,
)
from axond.distributed.forms.seed import (
    World, all_reduce_max, all_reduce_mean, all_reduce_min, all_reduce_product, all_reduce_sum, broadcast_from,
    gather_tensor, is_main_process, rank, reduce_scatter_mean, reduce_scatter_sum, scatter_tensor, sync_gradient,
    sync_gradients, world_size,
)
from axond.config import RuntimeEnv as _RuntimeEnv
from axond.distributed.diagnostics import failure as _failure
from axond.distributed.numerics import bf16 as _bf16
from axond.distributed.diagnostics.failure import record
from axond.distributed.diagnostics.steps import mark_step
from axond.distributed.reform import reform
from axond.errors import (
    AxondError, BackendUnavailable, CoordinatorError, DistributedError, MembershipChanged, StoreError, StoreTimeout,
)
from axond.store import InMemoryStore, PrefixStore, Store

__version__ = "0.1.0"

# launched by the worker: record even an exception before init_process_group (a bad variable raises there, not here)
_failure.install_if_launched(_RuntimeEnv.from_env(strict=False))

__all__ = [
    "AxondError", "Backend", "BackendOptions", "BackendUnavailable", "CoordinatorError", "DistributedError",
    "FileStore", "InMemoryStore", "MembershipChanged", "P2POp", "PrefixStore", "ProcessGroup", "ReduceOp", "Store", "StoreError",
    "StoreTimeout", "TCPStore", "Work", "World", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_reduce_max",
    "all_reduce_mean", "all_reduce_min", "all_reduce_product", "all_reduce_sum", "all_to_all", "all_to_all_single",
    "barrier", "bfloat16",
    "batch_isend_irecv", "broadcast", "broadcast_from", "broadcast_object_list", "create_group",
    "destroy_process_group", "gather", "gather_object", "gather_tensor", "get_backend", "get_global_rank",
    "get_group_rank", "get_local_rank", "get_process_group_ranks", "get_rank", "get_world_size", "init_process_group",
    "irecv", "is_available", "is_initialized", "is_main_process", "is_nccl_available", "isend", "mark_step",
    "monitored_barrier", "new_group", "rank", "record", "reform", "recv", "reduce", "reduce_scatter", "reduce_scatter_mean", "reduce_scatter_sum",
    "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "scatter_tensor", "send", "shared_empty", "sync_gradient", "sync_gradients", "world_size",
]


def __getattr__(name: str) -> object:
    """`axond.checkpoint` and `axond.train` without importing them first (loaded on first use), and `axond.bfloat16`
    (ml_dtypes' bfloat16 as a NumPy dtype; ml_dtypes is imported on first use: `axond.distributed.numerics.bf16`)."""
    if name == "bfloat16":
        return _bf16.bfloat16()
    if name in ("checkpoint", "train"):
        import importlib

        return importlib.import_module(f"axond.{name}")
    raise AttributeError(f"module 'axond' has no attribute {name!r}")
