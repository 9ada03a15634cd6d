"""The environment and files of each local rank of one generation: what `JobRunner` starts its ranks with."""

from __future__ import annotations

from collections.abc import Callable

from axond.v1 import coordinator_pb2 as pb
from axond.worker import live
from axond.worker.launcher import TORCH_ERROR_SUFFIX, RankSpec
from axond.worker.buddy_relay import HELD_MEMORY_ENV
from axond.worker.copy_forward import FORWARD_ENV
from axond.worker.shard_memory import SHARD_MEMORY_ENV
from axond.worker.spec import ConnectOptions, JobSpec
from axond.worker.torch_env import rank_env, torchrun_env


def rank_specs(conn: ConnectOptions, spec: JobSpec, node_id: str, joined: pb.JoinResponse, master: str,
               error_file: Callable[[int, int], str], membership: list[str],
               shard_fd: Callable[[int], int | None] = lambda local_rank: None,
               relay: dict[str, str] | None = None,
               forward_fd: Callable[[int], int | None] = lambda local_rank: None) -> list[RankSpec]:
    """Each local rank's spec in `joined`'s generation: the worker's environment, the job's, the rank variables
    (torchrun's too, `master` their MASTER_ADDR:PORT), its error file (`error_file(generation, rank)`) and, in a
    live job, its membership file (`membership[local_rank]`), the memory the worker keeps for it
    (`shard_fd(local_rank)`, inherited), where the node's relay is and the memory it fills (`relay`: the
    variables of `ShardMemory.serve`, its memory inherited) and the pipe that asks the worker to send the rank's
    buddy copies (`forward_fd(local_rank)`, inherited)."""
    base = dict(conn.env.environ)
    base.update(spec.env or {})
    base.setdefault("PYTHONUNBUFFERED", "1")
    if joined.local_world_size > 1:
        # Like torchrun: one BLAS/OpenMP thread per rank, or the ranks' thread pools spin against
        # each other on shared cores (measured: a 0.5 ms forward took 100 ms with 2 ranks on 2 cores).
        base.setdefault("OMP_NUM_THREADS", "1")
    base.update(conn.rank_env())
    base.update(
        AXOND_JOB=spec.job,
        AXOND_GENERATION=str(joined.generation),
        AXOND_JOB_SECRET=joined.job_secret.hex(),
        AXOND_NODE_ID=node_id,
        NODE_RANK=str(joined.node_rank),
    )
    base.update(torchrun_env(joined, spec.job, spec.max_restarts, master, conn.env))
    if spec.live_recovery:
        base[live.LIVE_ENV] = "1"
        base[live.MAX_WORLD_ENV] = str(spec.max_nodes * spec.nproc_per_node)
    specs = []
    for local_rank in range(joined.local_world_size):
        rank = joined.rank_offset + local_rank
        path = error_file(joined.generation, rank)
        env = dict(base, AXOND_ERROR_FILE=path, TORCHELASTIC_ERROR_FILE=path + TORCH_ERROR_SUFFIX,
                   **rank_env(rank, local_rank))
        fds: tuple[int, ...] = ()
        if spec.live_recovery:
            env[live.MEMBERSHIP_FILE_ENV] = membership[local_rank]
            fd = shard_fd(local_rank)
            if fd is not None:
                env[SHARD_MEMORY_ENV], fds = str(fd), (fd,)
                forward = forward_fd(local_rank) if relay else None
                if relay and forward is not None:
                    env.update(relay, **{FORWARD_ENV: str(forward)})
                    fds += (int(relay[HELD_MEMORY_ENV]), forward)
        specs.append(RankSpec(rank=rank, local_rank=local_rank, env=env, error_file=path, pass_fds=fds))
    return specs
