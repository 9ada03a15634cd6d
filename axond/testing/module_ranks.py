"""Ranks as `python -m module` subprocesses sharing a FileStore directory, the way `axond worker` starts them."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from axond.testing.failures import RankFailed
from axond.testing.waits import communicate_all


def rank_env(rank: int, world_size: int, store_dir: str, env: Mapping[str, str] | None) -> dict[str, str]:
    """This process's environment plus `env`, with the variables `init_process_group` reads for `rank`."""
    child = dict(os.environ, **(env or {}), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                 LOCAL_WORLD_SIZE=str(world_size), AXOND_FILE_STORE=store_dir)
    child.pop("AXOND_COORDINATOR", None)
    return child


def _start(module: str, args: Sequence[str], envs: Sequence[Mapping[str, str] | None], store_dir: str,
           stderr: int) -> list[subprocess.Popen[str]]:
    """One `python -m module args...` per rank (`len(envs)` of them), stdout piped, stderr to `stderr`."""
    world_size = len(envs)
    return [subprocess.Popen([sys.executable, "-m", module, *args], env=rank_env(r, world_size, store_dir, envs[r]),
                             stdout=subprocess.PIPE, stderr=stderr, text=True)
            for r in range(world_size)]


def run_module(module: str, world_size: int, timeout: float, store_dir: str, args: Sequence[str],
               env: Mapping[str, str] | None) -> list[int]:
    """Run the module as `world_size` ranks; return their exit codes (all 0), or raise `RankFailed` for the
    first rank that failed, with its output."""
    procs = _start(module, args, [env] * world_size, store_dir, subprocess.STDOUT)
    outputs = [out for out, _ in communicate_all(procs, timeout)]
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise RankFailed(f"rank {r} of {world_size} ({module}) exited with {p.returncode}:\n{outputs[r][-4000:]}", r)
    return [p.returncode for p in procs]


def run_module_ranks(module: str, world_size: int, timeout: float = 60.0, *, args: Sequence[str] = (),
                     env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None
                     ) -> list[subprocess.CompletedProcess[str]]:
    """Run `python -m module args...` as `world_size` ranks sharing a FileStore, as `run_processes` does, and
    return each rank's exit code, stdout and stderr without judging them (for tests of failing ranks).

    `env`: added to every rank's environment, or one mapping per rank. Ranks still running after `timeout`
    are killed (their return code is then negative)."""
    envs = [env] * world_size if env is None or isinstance(env, Mapping) else list(env)
    with tempfile.TemporaryDirectory(prefix="axond-store-") as store_dir:
        procs = _start(module, args, envs, store_dir, subprocess.PIPE)
        outputs = communicate_all(procs, timeout)
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
