"""The memory the worker keeps for each local rank of a live job (`axond.worker.shard_memory`): a memfd the rank
process inherits, whose contents outlive the rank and reach the next process started for that local rank."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

from axond.worker.launcher import RankSpec, start_ranks
from axond.worker.shard_memory import SHARD_MEMORY_ENV, ShardMemory

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")

WRITE = ("import mmap, os; fd = int(os.environ['AXOND_SHARD_MEMORY_FD']); os.ftruncate(fd, 4096); "
         "m = mmap.mmap(fd, 4096); m[:5] = b'shard'; os.kill(os.getpid(), 9)")
READ = ("import mmap, os; fd = int(os.environ['AXOND_SHARD_MEMORY_FD']); m = mmap.mmap(fd, 4096); "
        "print(bytes(m[:5]).decode())")


def _run(memory: ShardMemory, code: str) -> tuple[int, list[str]]:
    fd = memory.fd(0)
    assert fd is not None
    lines: list[str] = []
    spec = RankSpec(rank=0, local_rank=0, env=dict(os.environ, **{SHARD_MEMORY_ENV: str(fd)}), pass_fds=(fd,))
    ranks = start_ranks([sys.executable, "-c", code], [spec], sink=lambda rank, stream, text: lines.append(text))
    result = ranks.wait(60.0)
    assert result is not None
    ranks.join_readers(timeout=5.0)
    return result.exits[0].exit_code, lines


def test_a_ranks_memory_outlives_it_and_reaches_the_next_rank_of_that_local_rank() -> None:
    memory = ShardMemory()
    try:
        assert memory.fd(0) == memory.fd(0) and memory.fd(1) != memory.fd(0)  # one per local rank, kept
        code, _ = _run(memory, WRITE)
        assert code == 137  # SIGKILLed right after it wrote
        code, lines = _run(memory, READ)  # the replacement the worker starts for local rank 0
        assert code == 0 and lines == ["shard"], lines
        fd = memory.fd(0)
        assert fd is not None
        with mmap.mmap(fd, 4096) as m:  # and the worker itself can read it
            assert bytes(m[:5]) == b"shard"
    finally:
        memory.close()  # freed with the worker's descriptors: nothing left in /dev/shm or anywhere
