"""bench/abuse.py --part capacity: the coordinator, a flood and the calls that must still answer, on three hosts.

Each is a network-namespace host (axond/testing/netns.py) with an address of its own, so the flood comes from one
client address and everything timed from another. Run as `python bench/abuse.py --part capacity`; this module also
runs, inside the hosts, the flood (`--flood`) and the timed calls (`--victim`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from abuse_flood import HeldStreams

TOKEN = "abuse-bench"
HERE = os.path.abspath(__file__)
PORT = 29500


def _env(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin",
                                     "/usr/sbin", "/sbin"]),
            "HOME": str(home), "XDG_STATE_HOME": str(home / "state"), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


def victim(address: str) -> dict[str, float]:
    """Seconds each call took, in this process (imports done): health, status, a new node, another client's KvSet."""
    from axond.control.client import connect

    took: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        t0 = time.monotonic()
        out = fn()
        took[name] = round(time.monotonic() - t0, 3)
        return out

    with connect(address, token=TOKEN, call_timeout=60.0) as c:
        timed("health", lambda: c.check_health(timeout=60))
        timed("status", lambda: c.get_status())
        node = timed("new node", lambda: c.register_node(f"victim-{uuid.uuid4().hex[:6]}")).node_id
        job = f"v-{uuid.uuid4().hex[:6]}"
        timed("join", lambda: c.join(job, node, 1, 1, 1, timeout=60))
        store = c.store(job, 1)
        timed("KvSet", lambda: store.set("k", b"v"))
        store.close()
    return took


def _cli(host: Any, env: dict[str, str], argv: list[str], timeout: float = 120) -> float:
    t0 = time.monotonic()
    done = host.run(argv, env=env, timeout=timeout)
    took = time.monotonic() - t0
    if done.returncode != 0:
        return -1.0  # failed (for `axond health --timeout 2`: no answer within 2 s)
    return round(took, 2)


def _measure(victims: Any, env: dict[str, str], address: str) -> dict[str, float]:
    axond = str(Path(sys.executable).with_name("axond"))
    done = victims.run([sys.executable, HERE, "--victim", address], env=env, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"the timed calls failed: {done.stderr[-2000:]}")
    got: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    # --timeout 2: exit 0 only when the coordinator answered within 2 s (what the time around it adds is the CLI's
    # own start on a busy machine, as the no-flood row shows)
    got["axond health"] = _cli(victims, env, [axond, "health", "--coordinator", address, "--token", TOKEN,
                                              "--timeout", "2"])
    got["axond status"] = _cli(victims, env, [axond, "status", "--coordinator", address, "--token", TOKEN])
    got["new job (axond worker)"] = _cli(victims, env, [
        axond, "worker", "--coordinator", address, "--token", TOKEN, "--nnodes", "1", "--nproc-per-node", "1",
        "--job", f"new-{uuid.uuid4().hex[:6]}", "--", "true"])
    return got


def part_capacity(connections: int, watch: int, kv_streams: int) -> None:
    from axond.testing.netns import Network, unavailable

    reason = unavailable()
    if reason:
        print(f"skipped: {reason}")
        return
    tmp = Path(tempfile.mkdtemp(prefix="axond-abuse-"))
    with Network.create(n_hosts=3) as net:
        server, attacker, victims = net.hosts
        address = f"{server.addr}:{PORT}"
        env = _env(tmp / "home")
        axond = str(Path(sys.executable).with_name("axond"))
        # Idle KvStreams stay held for the whole run (the default stream_idle_s would end them after 60 s).
        coord = server.popen([axond, "coordinator", "--in-memory", "--host", server.addr, "--port", str(PORT),
                              "--token", TOKEN, "--limit", "stream_idle_s=3600"], env=env, stderr=subprocess.PIPE,
                             text=True)
        line = coord.stderr.readline() if coord.stderr else ""
        if "listening" not in line:
            raise RuntimeError(f"the coordinator did not start: {line!r}")
        scenarios = [("no flood", None),
                     (f"{connections} anonymous connections x {watch} Watch", ("-", watch, 0)),
                     (f"one token holder: {connections} connections x ({watch} Watch + {kv_streams} KvStream)",
                      (TOKEN, watch, kv_streams))]
        rows = []
        for name, flood in scenarios:
            proc = None
            held = ""
            if flood is not None:
                token, w, k = flood
                proc = attacker.popen([sys.executable, HERE, "--flood", address, "--token", token, "--connections",
                                       str(connections), "--watch", str(w), "--kv-streams", str(k)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                ready = proc.stdout.readline() if proc.stdout else ""
                held = ready.strip()
            try:
                got = _measure(victims, env, address)
            finally:
                if proc is not None and proc.stdin is not None:
                    proc.stdin.close()
                    proc.wait(120)
            rows.append((name, held, got))
            print(name, held, json.dumps(got), flush=True)
        coord.terminate()
        coord.wait(10)
    keys = list(rows[0][2])
    print("\n| flood | streams held / ended (by code) | " + " | ".join(keys) + " |")
    print("|---|---|" + "---:|" * len(keys))
    for name, held, got in rows:
        print(f"| {name} | {held} | " + " | ".join(f"{got.get(k, -1):.2f} s" for k in keys) + " |")


async def _flood(address: str, token: str | None, connections: int, watch: int, kv_streams: int) -> None:
    streams = HeldStreams(address, token, connections, watch, kv_streams)
    took = await streams.open(settle_s=1.0)
    seen, quiet = -1, 0
    while quiet < 10 and took < 600:  # until the coordinator has answered every stream it refuses
        await asyncio.sleep(1.0)
        took += 1.0
        ended = sum(streams.ended.values())
        quiet, seen = (quiet + 1 if ended == seen and ended > 0 else 0), ended
    print(json.dumps({"opened": len(streams.calls), "held": streams.held(), "ended": dict(streams.ended),
                      "settled_s": round(took, 1)}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes our stdin
    await streams.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--victim", default=None)
    ap.add_argument("--flood", default=None)
    ap.add_argument("--token", default="-")
    ap.add_argument("--connections", type=int, default=26)
    ap.add_argument("--watch", type=int, default=1000)
    ap.add_argument("--kv-streams", type=int, default=0)
    args = ap.parse_args()
    if args.victim:
        print(json.dumps(victim(args.victim)), flush=True)
    elif args.flood:
        asyncio.run(_flood(args.flood, None if args.token == "-" else args.token, args.connections, args.watch,
                           args.kv_streams))


if __name__ == "__main__":
    main()
