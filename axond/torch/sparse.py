"""Sparse (COO) all_reduce, as gloo runs it: every rank's indices and values are gathered, and the sum is their
coalesced concatenation (duplicates summed), written into the caller's sparse tensor.

Three all_gathers on the axond group: the ranks' nonzero counts, then the indices and the values padded to the
largest count (fixed-size frames, no pickling). Only SUM, as gloo.
"""

from __future__ import annotations

import numpy as np
import torch

from axond.distributed.process_group import ProcessGroup
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.torch.tensors import from_numpy, readonly


def sparse_all_reduce(group: ProcessGroup, t: torch.Tensor, op: ReduceOp, where: str) -> torch.Tensor:
    """Sum sparse COO tensor `t` over `group` in place (its indices and values are replaced); returns `t`."""
    if op is not ReduceOp.SUM:
        raise ValueError(f"{where}: sparse all_reduce takes ReduceOp.SUM only (as gloo), got {op.name}")
    if t.layout is not torch.sparse_coo:
        raise TypeError(f"{where}: sparse all_reduce takes sparse COO tensors, got layout {t.layout}")
    mine = t.detach().coalesce()
    indices = mine.indices().numpy()  # (sparse_dim, nnz) int64
    values = readonly(mine.values().contiguous(), f"{where} values")  # (nnz, *dense); bfloat16 as its bits
    nnz = indices.shape[1]
    counts = group.all_gather(np.array([nnz], np.int64)).reshape(-1)
    most = int(counts.max())
    padded = np.zeros((indices.shape[0], most), np.int64)
    padded[:, :nnz] = indices
    all_indices = group.all_gather(padded)
    padded_values = np.zeros((most, *values.shape[1:]), values.dtype)
    padded_values[:nnz] = values
    all_values = group.all_gather(padded_values)
    joined_indices = np.concatenate([all_indices[r][:, : counts[r]] for r in range(len(counts))], axis=1)
    joined_values = np.concatenate([all_values[r][: counts[r]] for r in range(len(counts))], axis=0)
    total = torch.sparse_coo_tensor(torch.from_numpy(joined_indices), from_numpy(joined_values, t.dtype), t.shape)
    with torch.no_grad():
        t.copy_(total.coalesce())
    return t
