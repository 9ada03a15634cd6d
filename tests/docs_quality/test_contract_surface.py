"""Every user-facing name of the contract (../shared/CONTRACT.md) exists where users look for it.

A rename anywhere breaks users' scripts; this fails first, naming what went missing.
"""

from __future__ import annotations

import axond
import axond.nn as nn
import axond.nn.optim as optim
import axond.nn.utils as utils
import axond.parallel as parallel

TOP = """init_process_group get_rank get_world_size get_local_rank is_initialized destroy_process_group all_reduce
broadcast reduce all_gather reduce_scatter gather scatter all_to_all send recv isend irecv barrier new_group ReduceOp
ProcessGroup Work DistributedError all_reduce_sum all_reduce_mean all_reduce_min all_reduce_max all_reduce_product
broadcast_from reduce_scatter_sum reduce_scatter_mean gather_tensor scatter_tensor sync_gradient sync_gradients rank
world_size is_main_process World bfloat16""".split()
NN = """Module Parameter Linear Embedding LayerNorm ReLU GELU Tanh Dropout Sequential MSELoss CrossEntropyLoss
GradScaler""".split()
MODULE_METHODS = "forward backward parameters named_parameters state_dict load_state_dict train eval zero_grad".split()
PARALLEL = """DistributedDataParallel DDP DistributedSampler FullyShardedDataParallel FSDP ShardingStrategy CPUOffload
ZeroRedundancyOptimizer Pipeline PipelineSchedule ColumnParallelLinear RowParallelLinear DeviceMesh
MixedPrecision""".split()
COLLECTIVES = "all_reduce broadcast reduce all_gather reduce_scatter gather scatter all_to_all send recv isend irecv barrier".split()


def test_top_level_names() -> None:
    assert [n for n in TOP if not hasattr(axond, n)] == []
    assert [op for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG") if not hasattr(axond.ReduceOp, op)] == []
    assert [m for m in ("wait", "is_completed") if not hasattr(axond.Work, m)] == []
    assert [m for m in ("default_group", "new_group", "rank", "world_size") if not hasattr(axond.World, m)] == []


def test_process_group_has_the_collectives_as_methods() -> None:
    assert [m for m in COLLECTIVES + ["contains"] if not hasattr(axond.ProcessGroup, m)] == []


def test_nn_names() -> None:
    assert [n for n in NN if not hasattr(nn, n)] == []
    assert [m for m in MODULE_METHODS if not hasattr(nn.Module, m)] == []
    assert hasattr(optim, "SGD") and hasattr(optim, "AdamW") and hasattr(utils, "clip_grad_norm_")


def test_parallel_names() -> None:
    assert [n for n in PARALLEL if not hasattr(parallel, n)] == []
    assert parallel.DDP is parallel.DistributedDataParallel and parallel.FSDP is parallel.FullyShardedDataParallel
    strategies = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
    assert [s for s in strategies if not hasattr(parallel.ShardingStrategy, s)] == []
    schedules = ("GPIPE", "ONE_F_ONE_B", "INTERLEAVED_1F1B")
    assert [s for s in schedules if not hasattr(parallel.PipelineSchedule, s)] == []


def test_mixed_precision_surface() -> None:
    import inspect

    import numpy as np

    assert np.dtype(axond.bfloat16).name == "bfloat16"
    fields = ("param_dtype", "reduce_dtype", "buffer_dtype", "keep_low_precision_grads")
    assert [f for f in fields if f not in inspect.signature(parallel.MixedPrecision).parameters] == []
    for wrapper in (parallel.DDP, parallel.FSDP):
        assert "mixed_precision" in inspect.signature(wrapper).parameters
    for owner in (parallel.DDP, parallel.FSDP, parallel.ZeroRedundancyOptimizer):
        assert hasattr(owner, "memory_stats")
