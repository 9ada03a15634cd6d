"""Process groups, collectives and their backends (the data plane).

    api.py             the torch.distributed-style module functions over the default group (global ranks)
    process_group.py   `ProcessGroup`: a backend and the ranks it spans, every collective a method (group ranks)
    work.py            `Work` handles of async ops and the per-group queue that runs them in issue order
    ops.py             the vocabulary every backend shares: op, dtype and reduction codes
    forms/             the other ways to call the same collectives: torch's list forms, tensors, batched
                       p2p, Python objects, the seed API's names
    numerics/          what a reduction computes: `ReduceOp`, the NumPy kernels, low-precision sums
    diagnostics/       failure reporting: a rank's root cause to its peers, what each rank is blocked in,
                       the barrier that names who did not arrive
    backends/          the `Backend` interface, its registry, what every backend shares (chunking, split
                       sizes, host arrays) and the backends: tcp/, nccl/, mock/
    policy.py          the thresholds the data plane decides by outside any one backend (a decision table)

The stores `init_process_group` meets the job through live in `axond.store`.

ops and numerics import nothing else of axond; backends import neither api nor process_group.
"""

from axond.distributed.api import (
    all_gather, all_gather_into_tensor, all_reduce, all_to_all, all_to_all_single, barrier, broadcast, default_group, destroy_process_group, gather, get_backend,
    get_global_rank, get_group_rank, get_local_rank, get_process_group_ranks, get_rank, get_world_size,
    init_process_group, irecv, is_available, is_initialized, is_nccl_available, isend, monitored_barrier, new_group,
    recv, reduce, reduce_scatter, reduce_scatter_tensor, scatter, send,
)
from axond.distributed.backends.base import Backend, BackendOptions
from axond.distributed.backends.shared_arrays import shared_empty
from axond.distributed.forms.batch_p2p import P2POp, batch_isend_irecv
from axond.store.file import FileStore
from axond.distributed.forms.objects import all_gather_object, broadcast_object_list, gather_object, scatter_object_list
from axond.distributed.process_group import ProcessGroup, create_group
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.store.tcp import TCPStore
from axond.distributed.work import Work

__all__ = [
    "Backend", "BackendOptions", "FileStore", "P2POp", "ProcessGroup", "ReduceOp", "TCPStore", "Work", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
    "broadcast_object_list", "create_group", "default_group", "destroy_process_group", "gather", "gather_object",
    "get_backend", "get_global_rank", "get_group_rank", "get_local_rank", "get_process_group_ranks", "get_rank",
    "get_world_size", "init_process_group", "irecv", "is_available", "is_initialized", "is_nccl_available", "isend",
    "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "shared_empty",
]
