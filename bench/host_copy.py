"""How fast a host copy runs by the page distance of its destination from its source (the `rep movsb` slow case).

    python bench/host_copy.py [--sizes 16384 65536 262144 1048576] [--distances 0 16 2048]

For each size and distance (destination - source, modulo 4 KiB): the best-of-3 time of `np.copyto` (glibc's
memcpy), of axond's `host_copy.copy` (the vector loop at slow distances), of a raw `process_vm_readv` of this
process, and of the single-copy `Reader.read` (a bounce buffer at slow distances). See
axond/distributed/backends/host_copy.py.
"""

from __future__ import annotations

import argparse
import os
import timeit

import numpy as np

from axond.distributed.backends.host_copy import PAGE, address, copy
from axond.distributed.backends.tcp.shm import single_copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536, 262144, 524288, 1 << 20, 4 << 20])
    p.add_argument("--distances", type=int, nargs="+", default=[0, 16, 24, 32, 2048])
    args = p.parse_args()
    top = max(args.sizes)
    pool = np.ones(2 * top + 4 * PAGE, np.uint8)
    base = (-address(pool)) % PAGE
    usable = single_copy.local_obstacle() is None
    reader = single_copy.Reader() if usable else None
    print("| size | distance | np.copyto | host_copy.copy | process_vm_readv | Reader.read |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        n = max(3, min(2000, (64 << 20) // size))
        src = pool[base : base + size]
        for d in args.distances:
            at = base + -(-size // PAGE) * PAGE + PAGE + d
            dst = pool[at : at + size]

            def best(fn: object) -> str:
                return f"{min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6:.1f} us"  # type: ignore[arg-type]

            raw = read = "-"
            if reader is not None:
                raw = best(lambda: reader._read(os.getpid(), address(src), address(dst), size))
                read = best(lambda: reader.read(os.getpid(), address(src), dst))
            print(f"| {size} | {d} | {best(lambda: np.copyto(dst, src))} | {best(lambda: copy(dst, src))} | {raw} | "
                  f"{read} |", flush=True)
    if reader is None:
        print(f"\nprocess_vm_readv is not usable here: {single_copy.local_obstacle()}")


if __name__ == "__main__":
    main()
