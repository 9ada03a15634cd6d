"""Joining back: how fast a rank that joins a running live job receives the training state, against the link.

Three processes on loopback (`axond.testing.run_processes`, tcp backend), each with a `DistributedTrainer` on
virtual ranks over an MLP of `--hidden` units (3 layers) and AdamW. Ranks 0 and 1 hold a trained state (AdamW's
moments allocated); rank 2 plays the newcomer (no optimizer state, parameters zeroed, position 0). Per run:

- state transfer: `axond.train.join.transfer` from rank 0 (the manifest, then every parameter and optimizer array
  broadcast in place), seconds on the newcomer; the newcomer's parameters are then checked equal to rank 0's;
- data-plane broadcast: one `broadcast` from rank 0 of a contiguous buffer of the same byte count;
- link: a plain TCP socket from rank 0 to rank 2 on loopback carrying the same bytes (sendall / recv_into).

    python bench/join_back.py --hidden 1536 --runs 3
    python bench/join_back.py --hidden 512 --runs 5 --coalesce-ab 4   # small arrays packed vs each alone
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

import axond
from axond import nn
from axond.nn.optim import AdamW
from axond.train import DistributedTrainer
from axond.train import join
from axond.train.join import transfer
from axond.testing import run_processes

NEW = 2


def _trainer(hidden: int) -> DistributedTrainer:
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(hidden, hidden, rng=rng), nn.Tanh(), nn.Linear(hidden, hidden, rng=rng), nn.Tanh(),
                          nn.Linear(hidden, hidden, rng=rng))
    x = rng.standard_normal((24, hidden)).astype(np.float32)
    return DistributedTrainer(model, lambda p: AdamW(p, lr=1e-3), nn.MSELoss(), (x, x), batch_size=8,
                              progress=False, virtual_ranks=3)


def _link(group: Any, nbytes: int) -> float:
    """Seconds to carry `nbytes` over one plain loopback TCP connection from rank 0 to rank NEW (on NEW)."""
    port = np.zeros(1, np.int64)
    listener = None
    if group.rank == NEW:
        listener = socket.create_server(("127.0.0.1", 0))
        port[0] = listener.getsockname()[1]
    group.broadcast(port, NEW)
    seconds = 0.0
    if group.rank == 0:
        with socket.create_connection(("127.0.0.1", int(port[0]))) as s:
            s.sendall(np.ones(nbytes, np.uint8).data)
            s.recv(1)
    elif listener is not None:
        buf = np.empty(nbytes, np.uint8)
        view = buf.data
        conn, _ = listener.accept()
        with conn, listener:
            got = conn.recv_into(view, nbytes)
            began = time.perf_counter()
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)
            seconds = time.perf_counter() - began
            conn.sendall(b"k")
    group.barrier()
    return seconds


@dataclass(frozen=True)
class _Run:
    hidden: int
    runs: int
    coalesce_below: int = join.COALESCE_BELOW

    def __call__(self) -> dict[str, Any]:
        join.COALESCE_BELOW = self.coalesce_below
        group = axond.distributed.default_registry.require("join_back bench")
        trainer = _trainer(self.hidden)
        steps = trainer.virtual
        assert steps is not None
        out: dict[str, list[float]] = {"transfer": [], "broadcast": [], "link": []}
        nbytes = 0
        for _ in range(self.runs):
            for p in trainer.optimizer.params:
                p.grad = np.full_like(p.data, 1e-3)
            trainer.optimizer.step()
            trainer.position.global_step += 1
            if group.rank == NEW:  # the newcomer: no optimizer state, no position, other parameters
                trainer.optimizer.state = [{} for _ in trainer.optimizer.params]
                trainer.position.global_step = 0
                for p in trainer.optimizer.params:
                    p.data[...] = 0
            group.barrier()
            moved = transfer(steps, group, 0, (NEW,))
            nbytes = moved.nbytes
            digest = np.array([float(sum(float(p.data.sum()) for p in trainer.optimizer.params))], np.float64)
            every = group.all_gather(digest)
            if every[0, 0] != every[NEW, 0] or trainer.position.global_step == 0:
                raise RuntimeError(f"the newcomer's state differs after the transfer: {every[:, 0]}")
            out["transfer"].append(moved.seconds)
            big = np.ones(nbytes // 4, np.float32)
            group.barrier()
            began = time.perf_counter()
            group.broadcast(big, 0)
            out["broadcast"].append(time.perf_counter() - began)
            del big
            out["link"].append(_link(group, nbytes))
        return {"nbytes": nbytes, **{k: statistics.median(v) for k, v in out.items()}}


def coalesce_ab(hidden: int, runs: int, rounds: int) -> None:
    """The transfer's seconds with small arrays packed (default) and with each array alone, alternated."""
    got: dict[str, list[float]] = {"packed": [], "alone": []}
    for _ in range(rounds):
        for name, below in (("packed", join.COALESCE_BELOW), ("alone", 0)):
            got[name].append(run_processes(_Run(hidden, runs, below), 3, timeout=600)[NEW]["transfer"])
    print(f"transfer seconds, MLP {hidden}: median of {rounds} alternating rounds (each a median of {runs})")
    print("| arrays under 1 MiB | seconds | vs alone |")
    print("|---|---:|---:|")
    alone = statistics.median(got["alone"])
    for name, values in got.items():
        print(f"| {name} | {statistics.median(values):.4f} | {statistics.median(values) / alone:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--coalesce-ab", type=int, default=0,
                        help="instead: this many alternating rounds of the transfer with arrays under 1 MiB packed "
                             "together (the default) and with every array broadcast alone")
    args = parser.parse_args()
    if args.coalesce_ab:
        coalesce_ab(args.hidden, args.runs, args.coalesce_ab)
        return
    results = run_processes(_Run(args.hidden, args.runs), 3, timeout=600)
    new = results[NEW]
    mib = new["nbytes"] / 2**20
    print(f"3 ranks on loopback (tcp), MLP {args.hidden}x{args.hidden} x3 + AdamW: state of {mib:.1f} MiB "
          f"(parameters and both moments); median of {args.runs} runs, seconds on the newcomer")
    print("| what | seconds | MiB/s | vs link |")
    print("|---|---:|---:|---:|")
    link = new["nbytes"] / new["link"]
    for name, key in (("plain TCP socket, rank 0 -> newcomer (the link)", "link"),
                      ("one data-plane broadcast of a contiguous buffer", "broadcast"),
                      ("state transfer (axond.train.join.transfer)", "transfer")):
        rate = new["nbytes"] / new[key]
        print(f"| {name} | {new[key]:.3f} | {rate / 2**20:.0f} | {rate / link:.0%} |")


if __name__ == "__main__":
    main()
