"""A flapping link between two namespace hosts while two ranks all_reduce: how long traffic stays stalled after the
link is steady again, and whether every result was exact (tests/cluster/test_netns_flap.py, bench/flap.py).

`run_flap(net, ...)` starts one rank in each of hosts 0 and 1 (`python -m axond.testing.flap rank SPEC`), lets
them all_reduce in a loop, then makes the switch drop every frame of host 1 for `drop_s`, pass them for `pass_s`,
and so on for `flap_s` (as `iptables -j DROP` rules added and removed would), and lets the ranks go on for `after_s`
once the link is steady. Each rank checks every result exactly and rank 0 logs when each op started and ended.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

import axond
from axond.store.file import FileStore
from axond.testing.netns import Network

__all__ = ["FlapResult", "run_flap"]

READY = "FLAP-READY"
FAIL = "FLAP-FAIL"


@dataclass(frozen=True)
class FlapResult:
    """What one flapping run measured (times in seconds)."""

    ops: int
    """Steps rank 0 completed (a one-element all_reduce that says whether to stop, then the checked one), every
    result exact."""
    stall_after_steady: float
    """From the moment the link was steady again to the end of the first step that ended after it."""
    max_op: float
    """The longest step."""
    rto_max_ms: int
    """The ranks' AXOND_TCP_RTO_MAX_MS (0: the kernel's own)."""
    error: str | None = None
    """Why a rank did not finish cleanly (None: both exited 0)."""
    sockets: str = ""
    """What `ss -tin` and `ip neigh` said in both hosts when no step had ended `watch_s` after the link was steady
    (empty when one had): each socket's retransmission timeout, backoff, window and pacing, for a stall's report."""


def _env(extra: dict[str, str]) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "PYTHONPATH")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "PYTHONUNBUFFERED": "1", **extra}


def run_flap(net: Network, flap_s: float = 30.0, drop_s: float = 2.0, pass_s: float = 0.2, after_s: float = 5.0,
             rto_max_ms: int = 1000, count: int = 1 << 16, timeout_s: float = 60.0, watch_s: float = 0.0,
             congestion: str = "system") -> FlapResult:
    """One run over hosts 0 and 1 of `net` (see the module docstring); `count` float32 elements per all_reduce,
    `timeout_s` the group timeout, `congestion` the ranks' AXOND_TCP_CONGESTION. Once the link is steady it waits (up
    to `timeout_s`) for the first step to end, then lets the ranks go on for `after_s`; with `watch_s` > 0 and no step
    ended by then, it records both hosts' sockets (`FlapResult.sockets`)."""
    a, b = net.hosts[0], net.hosts[1]
    with tempfile.TemporaryDirectory(prefix="axond-flap-") as tmp:
        log = os.path.join(tmp, "ops.jsonl")
        stop = os.path.join(tmp, "stop")
        procs, outs = [], []
        for rank, host in enumerate((a, b)):
            spec = {"rank": rank, "addr": host.addr, "store": tmp, "count": count, "timeout": timeout_s,
                    "log": log if rank == 0 else "", "stop": stop}
            out = open(os.path.join(tmp, f"rank{rank}.out"), "w+")
            outs.append(out)
            procs.append(host.popen([sys.executable, "-m", "axond.testing.flap", "rank", json.dumps(spec)],
                                    env=_env({"AXOND_TCP_RTO_MAX_MS": str(rto_max_ms),
                                              "AXOND_TCP_CONGESTION": congestion}), stdout=out,
                                    stderr=subprocess.STDOUT, text=True))
        try:
            _wait_ready(outs, procs, 60.0)
            time.sleep(0.5)
            end = time.monotonic() + flap_s
            while time.monotonic() < end:
                b.drop_frames(True)
                time.sleep(min(drop_s, max(0.0, end - time.monotonic())))
                b.drop_frames(False)
                time.sleep(pass_s)
            steady = time.time()
            sockets = _await_step(log, steady, timeout_s, watch_s, (a, b))
            time.sleep(after_s)
            open(stop, "w").close()
            error = _finish(procs, outs, timeout_s + after_s + 30.0)
        finally:
            b.drop_frames(False)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
            for out in outs:
                out.close()
        ops = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
    after = [end for _, end in ops if end > steady]
    stall = (min(after) - steady) if after else float("inf")
    longest = max((end - start for start, end in ops), default=float("inf"))
    return FlapResult(len(ops), stall, longest, rto_max_ms, error, sockets)


def _await_step(log: str, steady: float, timeout: float, watch_s: float, hosts: tuple[Any, ...]) -> str:
    """Wait until rank 0 logs a step that ended after `steady` (at most `timeout`); what the hosts' sockets looked
    like `watch_s` after `steady` if none had by then."""
    sockets = ""
    while time.time() < steady + timeout:
        if _ended_after(log, steady):
            return sockets
        if watch_s > 0 and not sockets and time.time() >= steady + watch_s:
            sockets = "\n".join(f"{h!r}:\n{h.run(['ss', '-tin']).stdout}{h.run(['ip', 'neigh']).stdout}"
                                for h in hosts)
        time.sleep(0.02)
    return sockets


def _ended_after(log: str, steady: float) -> bool:
    if not os.path.exists(log):
        return False
    with open(log) as f:
        for line in f:
            try:
                _, end = json.loads(line)
            except ValueError:  # a line being written
                continue
            if end > steady:
                return True
    return False


def _wait_ready(outs: list[Any], procs: list[subprocess.Popen[str]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        texts = [_text(o) for o in outs]
        if all(READY in t for t in texts):
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    raise RuntimeError("the ranks did not start:\n" + "\n".join(_text(o)[-3000:] for o in outs))


def _text(out: Any) -> str:
    out.flush()
    with open(out.name, errors="replace") as f:
        return f.read()


def _finish(procs: list[subprocess.Popen[str]], outs: list[Any], timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        try:
            code = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return f"rank {rank} still running after {timeout:.0f} s"
        if code != 0:
            return f"rank {rank} exited with code {code}: {_text(outs[rank])[-2000:]}"
    return None


def _rank(spec: dict[str, Any]) -> None:
    """One rank: all_reduce until the stop file appears, checking each result exactly; rank 0 logs each op."""
    rank, count = spec["rank"], spec["count"]
    pg = axond.init_process_group("tcp", spec["timeout"], rank=rank, world_size=2, store=FileStore(spec["store"]),
                                  host=spec["addr"])
    base = np.arange(count, dtype=np.float32)
    x = np.empty(count, np.float32)
    log = open(spec["log"], "a") if spec["log"] else None
    print(READY, flush=True)
    i = 0
    while True:
        i += 1
        start = time.time()
        stop = np.array([float(os.path.exists(spec["stop"]))], np.float32)
        pg.all_reduce(stop, op=axond.ReduceOp.MAX)  # both ranks stop after the same op
        if stop[0]:
            break
        np.add(base, (i % 1000) * (rank + 1), out=x)
        pg.all_reduce(x)
        end = time.time()
        want = 2 * base + (i % 1000) * 3
        if not np.array_equal(x, want):
            bad = int(np.flatnonzero(x != want)[0])
            print(f"{FAIL} op {i}: element {bad} is {x[bad]}, want {want[bad]}", flush=True)
            sys.exit(2)
        if log is not None:
            log.write(json.dumps([start, end]) + "\n")
            log.flush()
    axond.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "rank":
    _rank(json.loads(sys.argv[2]))
