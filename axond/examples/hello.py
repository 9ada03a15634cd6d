"""A tiny job: every rank prints who it is from the environment the worker sets, then exits 0.

Run it with `axond worker --coordinator HOST:PORT --nproc-per-node 2 -- python -m axond.examples.hello`.
"""

from __future__ import annotations

import os
import socket

CONTRACT_VARS = (
    "AXOND_JOB", "AXOND_GENERATION", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
)


def main() -> int:
    """Print this rank's place in the job; exit 1 with a hint when not started by a worker."""
    missing = [name for name in CONTRACT_VARS if name not in os.environ]
    if missing:
        names = ", ".join(missing)
        print(f"hello: {names} not set: start me with `axond worker ... -- python -m axond.examples.hello`")
        return 1
    env = os.environ
    print(
        f"hello from rank {env['RANK']} of {env['WORLD_SIZE']} (local rank {env['LOCAL_RANK']} of "
        f"{env['LOCAL_WORLD_SIZE']}, node rank {env['NODE_RANK']}) on {socket.gethostname()}, "
        f"job {env['AXOND_JOB']} generation {env['AXOND_GENERATION']}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
