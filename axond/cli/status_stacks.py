"""`axond status --job J --stacks`: every rank's Python stacks (every thread) and what it is blocked in, now.

The request goes to the job generation's coordinator store and each worker of the job answers for its local ranks
(`axond.distributed.diagnostics.stack_requests`), so ranks on every node are shown; a rank whose worker did not
answer within `--stacks-wait` seconds is named with why it may not have. With `--fr-dir DIR` the ranks' Flight
Recorder dumps that came with the answers are written to DIR as `axond_fr_rank_<rank>`, for
`python -m torch.distributed.flight_recorder.fr_trace DIR` (`axond.distributed.diagnostics.flight_recorder`).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from axond.control.client import CoordinatorClient
from axond.distributed.diagnostics.flight_recorder import FILE_PREFIX
from axond.distributed.diagnostics.stack_requests import StackReply, ask, collect
from axond.v1 import coordinator_pb2 as pb


def job_stacks(client: CoordinatorClient, status: pb.GetStatusResponse, job: str, wait_s: float,
               blocked: dict[tuple[str, int], str], fr_dir: str = "") -> str:
    """Ask the workers of `job` for its ranks' stacks; the text to print (the store's errors as they are, OSError
    when `fr_dir` cannot be written)."""
    found = [j for j in status.jobs if j.job == job]
    if not found or found[0].generation < 1 or not found[0].ranks:
        return f"STACKS: job {job!r} has no running ranks to ask"
    j = found[0]
    store = client.store(j.job, j.generation)
    ranks = [r.rank for r in j.ranks]
    replies = collect(store, ask(store), ranks, wait_s)
    lines = [f"STACKS (job {job!r}, generation {j.generation}: every rank's worker asked, {wait_s:g} s to answer)"]
    for r in j.ranks:
        lines.append(_rank(r.rank, r.hostname, replies.get(r.rank), blocked.get((job, r.rank), ""), wait_s))
    if fr_dir:
        lines.append(_write_dumps(Path(fr_dir), replies))
    return "\n".join(lines)


def _write_dumps(directory: Path, replies: dict[int, StackReply]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    written = sorted(rank for rank, reply in replies.items() if reply.dump)
    for rank in written:
        (directory / f"{FILE_PREFIX}{rank}").write_bytes(replies[rank].dump)
    if not written:
        return f"FLIGHT RECORDER: no rank sent a dump (nothing written to {directory})"
    return (f"FLIGHT RECORDER: the dumps of ranks {written} are in {directory}: "
            f"python -m torch.distributed.flight_recorder.fr_trace {directory}")


def _rank(rank: int, host: str, reply: StackReply | None, blocked: str, wait_s: float) -> str:
    where = f"blocked in {blocked}" if blocked else "in no collective for long (computing, or stuck outside axond)"
    if reply is None:
        return (f"rank {rank} ({host}): {where}\n  no answer from its worker within {wait_s:g} s (the worker cannot "
                f"reach the coordinator, or the node is gone: see `axond status` NODES)")
    head = f"rank {rank} ({reply.host or host}, pid {reply.pid}): {where}" if reply.pid else f"rank {rank}: {where}"
    return head + "\n" + textwrap.indent(reply.text, "  ")
