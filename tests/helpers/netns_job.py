"""A rank of the cross-host tests (tests/cluster/test_netns_hosts.py), started by `axond worker` in a namespace host.

NETNS_MODE=collectives: check the addresses this rank advertises and connects over, then run every
collective with exact numeric checks and print `NETNS-OK`. NETNS_MODE=loop: print `NETNS-READY`, then
all_reduce until a peer is lost (the DistributedError ends the rank with code 1) or NETNS_LOOP_SECONDS pass
(code 3). NETNS_EXPECT_ADDR is this host's address, NETNS_HOST_ADDRS every worker host's (comma-separated),
NETNS_MODE=train: print `NETNS-READY`, all-reduce for NETNS_LOOP_SECONDS, then exit 0.
NETNS_TIMEOUT the group timeout in seconds.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import axond

CHUNK = 1 << 20
"""Elements of the large arrays: 4 MiB of float32, far above the MTU and the small-message paths."""


def check(name: str, got: np.ndarray | None, want: np.ndarray) -> None:
    if got is None or got.shape != want.shape or not np.array_equal(got, want):
        raise SystemExit(f"NETNS-FAIL {name}: got {got!r:.200}, want {want!r:.200}")


def check_addresses(pg: axond.ProcessGroup) -> None:
    """This rank advertises its host's veth address, and every peer socket runs between two hosts' addresses."""
    mine = os.environ["NETNS_EXPECT_ADDR"]
    hosts = set(os.environ["NETNS_HOST_ADDRS"].split(","))
    advertised = pg.backend.placement.host  # type: ignore[union-attr]
    links = {p: (peer.sock.getsockname()[0], peer.sock.getpeername()[0])
             for p, peer in pg.backend.g.peers.items()}  # type: ignore[union-attr]
    print(f"NETNS-ADDR rank={pg.rank} advertised={advertised} links={links}", flush=True)
    if advertised != mine:
        raise SystemExit(f"NETNS-FAIL rank {pg.rank} advertises {advertised}, not its host's address {mine}")
    for p, (local, remote) in links.items():
        if local != mine or remote not in hosts or remote == mine:
            raise SystemExit(f"NETNS-FAIL rank {pg.rank}'s link to rank {p} runs {local} -> {remote}; "
                             f"want {mine} -> another of {sorted(hosts)}")


def collectives(pg: axond.ProcessGroup) -> None:
    """Every collective across the hosts, small and large, with exact results."""
    r, n = pg.rank, pg.size
    for count in (13, CHUNK):
        x = np.arange(count, dtype=np.float32) + r
        pg.all_reduce(x)
        check(f"all_reduce({count})", x, n * np.arange(count, dtype=np.float32) + n * (n - 1) / 2)
    y = np.full(7, r + 1, np.int64)
    pg.all_reduce(y, op=axond.ReduceOp.MAX)
    check("all_reduce MAX", y, np.full(7, n, np.int64))
    z = np.full(CHUNK, float(r), np.float64)
    pg.all_reduce(z, op=axond.ReduceOp.AVG, async_op=True).wait(60)  # type: ignore[union-attr]
    check("all_reduce AVG async", z, np.full(CHUNK, (n - 1) / 2))
    b = np.arange(CHUNK, dtype=np.float32) if r == n - 1 else np.zeros(CHUNK, np.float32)
    pg.broadcast(b, src=n - 1)
    check("broadcast", b, np.arange(CHUNK, dtype=np.float32))
    red = np.full(CHUNK, r + 1.0, np.float32)
    pg.reduce(red, dst=0)
    if r == 0:
        check("reduce", red, np.full(CHUNK, n * (n + 1) / 2, np.float32))
    g = pg.all_gather(np.full((3, CHUNK // 4), r, np.int32))
    check("all_gather", g, np.repeat(np.arange(n, dtype=np.int32), 3 * (CHUNK // 4)).reshape(n, 3, CHUNK // 4))
    rs = pg.reduce_scatter(np.arange(n * CHUNK, dtype=np.float32))
    check("reduce_scatter", rs, n * np.arange(r * CHUNK, (r + 1) * CHUNK, dtype=np.float32))
    gathered = pg.gather(np.full(CHUNK // 2, r, np.float32), dst=n - 1)
    if r == n - 1:
        check("gather", gathered, np.repeat(np.arange(n, dtype=np.float32), CHUNK // 2).reshape(n, CHUNK // 2))
    src = np.arange(n * 5, dtype=np.float64).reshape(n, 5) if r == 0 else None
    check("scatter", pg.scatter(src, src=0), np.arange(r * 5, r * 5 + 5, dtype=np.float64))
    a2a = pg.all_to_all(np.arange(n * CHUNK, dtype=np.float32) + 1000 * r)
    want = np.concatenate([np.arange(r * CHUNK, (r + 1) * CHUNK, dtype=np.float32) + 1000 * i for i in range(n)])
    check("all_to_all", a2a, want)
    msg = np.zeros(CHUNK, np.float32)
    if r == 0:
        pg.send(np.arange(CHUNK, dtype=np.float32), 1, tag=5)
        pg.recv(msg, 1, tag=6)
        check("recv from 1", msg, np.arange(CHUNK, dtype=np.float32) * 2)
    elif r == 1:
        pg.recv(msg, 0, tag=5)
        pg.send(msg * 2, 0, tag=6)
    ring = np.zeros(CHUNK, np.int64)
    work = [pg.isend(np.full(CHUNK, r, np.int64), (r + 1) % n), pg.irecv(ring, (r - 1) % n)]
    for w in work:
        w.wait(60)
    check("isend/irecv ring", ring, np.full(CHUNK, (r - 1) % n, np.int64))
    pg.barrier()


def loop(pg: axond.ProcessGroup, seconds: float) -> int:
    """All-reduce until a peer is lost (raises DistributedError) or `seconds` pass (exit code 3)."""
    x = np.ones(1024, np.float32)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        x[...] = 1
        pg.all_reduce(x)
        time.sleep(0.02)
    print(f"NETNS-FAIL rank {pg.rank}: no peer was lost in {seconds} s", flush=True)
    return 3


def main() -> int:
    pg = axond.init_process_group(timeout=float(os.environ.get("NETNS_TIMEOUT", "30")))
    node = os.environ.get("AXOND_NODE_ID", "?")
    check_addresses(pg)
    mode = os.environ.get("NETNS_MODE", "collectives")
    if mode == "train":
        x = np.ones(4, np.float32)
        pg.all_reduce(x)
        print(f"NETNS-READY rank={pg.rank} node={node} addr={os.environ['NETNS_EXPECT_ADDR']}", flush=True)
        deadline = time.monotonic() + float(os.environ.get("NETNS_LOOP_SECONDS", "8"))
        while True:
            x[...] = 1
            pg.all_reduce(x)
            assert x[0] == pg.size
            # Every rank stops at the same step (each one's own deadline would let one exit while another
            # starts one more all_reduce with it).
            done = np.array([time.monotonic() >= deadline], np.int32)
            pg.all_reduce(done, op=axond.ReduceOp.MAX)
            if done[0]:
                break
            time.sleep(0.02)
        axond.destroy_process_group()
        print(f"NETNS-DONE rank={pg.rank}", flush=True)
        return 0
    if mode == "loop":
        x = np.ones(4, np.float32)
        pg.all_reduce(x)
        print(f"NETNS-READY rank={pg.rank} node={node} addr={os.environ['NETNS_EXPECT_ADDR']}", flush=True)
        return loop(pg, float(os.environ.get("NETNS_LOOP_SECONDS", "60")))
    collectives(pg)
    print(f"NETNS-OK rank={pg.rank} node={node}", flush=True)
    axond.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
