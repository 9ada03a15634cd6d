"""One fencing run: a worker host cut off from the coordinator in one of several ways, and whether two generations
of its job ever ran at once (used by tests/cluster/test_netns_fencing.py and bench/fencing.py).

Host 0 runs `axond coordinator` (a 2 s lease: 0.5 s heartbeats x 4, short yet robust on a busy machine; the default
--fence-margin and --settle-time), hosts 1 and 2 `axond worker --nnodes 1:2` with one rank each
(tests/helpers/fencing_rank.py: computes only, logs its pid, then the wall time every 10 ms per generation; host
2's ignore SIGTERM, the worst case for fencing, host 1's do not, so that host 1 re-joins at once and the coordinator's
fence, not host 1's stop, is what holds the next generation back).
Once one generation runs on both hosts, host 2 is cut off from the coordinator's address by iptables rules in its
own namespace (it still reaches host 1), in one of the `SHAPES`; the coordinator declares it dead and starts the
next generation on host 1. The run reads the ranks' logs: the margin is the next generation's first start minus
the last sign of life of any rank of the generation before (negative: they overlapped).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from axond.testing.netns import Host, Network

HERE = Path(__file__).resolve().parent
AXOND = [sys.executable, "-c", "from axond.cli.main import main; main()"]
TOKEN = "fencing-token"
PORT = 29500
HEARTBEAT, MISSED = 0.5, 4
LEASE = HEARTBEAT * MISSED

_REJECT = {"reject-icmp": ["-j", "REJECT", "--reject-with", "icmp-port-unreachable"],
           "reject-tcp-reset": ["-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"]}
SHAPES = {
    "drop": [("INPUT", "-s", ["-j", "DROP"]), ("OUTPUT", "-d", ["-j", "DROP"])],
    "reject-icmp": [("INPUT", "-s", _REJECT["reject-icmp"]), ("OUTPUT", "-d", _REJECT["reject-icmp"])],
    "reject-tcp-reset": [("INPUT", "-s", _REJECT["reject-tcp-reset"]), ("OUTPUT", "-d", _REJECT["reject-tcp-reset"])],
    "oneway-out": [("OUTPUT", "-d", ["-j", "DROP"])],
    "oneway-in": [("INPUT", "-s", ["-j", "DROP"])],
    "outage-partition": [("INPUT", "-s", _REJECT["reject-icmp"]), ("OUTPUT", "-d", _REJECT["reject-icmp"])],
}
"""iptables rules (chain, address flag, target) host 2 gets against the coordinator's address. `outage-partition`:
the coordinator is killed (-9) first, both workers ride out the outage, host 2 is cut off (REJECT), and the
coordinator is restarted from its state directory."""


def unavailable() -> str | None:
    """Why the runs cannot cut links here (no iptables), or None."""
    return None if shutil.which("iptables") else "iptables is not installed (apt-get install iptables)"


@dataclass(frozen=True)
class Outcome:
    shape: str
    margin: float
    """Seconds from the last sign of life of any rank of the cut-off generation to the next one's first start (< 0:
    overlap). Host 1's rank of it is stopped by its own worker once the job moved on, so this is often from that."""
    cut_margin: float
    """The same from the cut-off host's rank's last sign of life: how early the fenced side was gone."""
    cut_code: int | None
    """The cut-off worker's exit code (3: it fenced itself)."""
    log: str

    @property
    def overlap(self) -> bool:
        return self.margin <= 0


def _cut(host: Host, coordinator: str, shape: str) -> None:
    for chain, flag, target in SHAPES[shape]:
        subprocess.run(["ip", "netns", "exec", host.ns, "iptables", "-A", chain, flag, coordinator, *target],
                       check=True, capture_output=True, timeout=20)


def _spans(logdir: Path) -> dict[tuple[int, str], tuple[float, float]]:
    """(generation, host) -> (first, last) wall time its rank logged."""
    out = {}
    for f in logdir.glob("g*-*.log"):
        m = re.fullmatch(r"g(\d+)-(.+)\.log", f.name)
        lines = f.read_text().split()
        if m and lines:
            out[(int(m.group(1)), m.group(2))] = (float(lines[0]), float(lines[-1]))
    return out


def _alive(pid: int) -> bool:
    """Whether `pid` can still run (a zombie cannot: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(logdir: Path, base: int, until: float) -> None:
    """Until every rank of generations <= `base` is dead, or `until` (monotonic) passed."""
    def pids() -> list[int]:
        out = []
        for f in logdir.glob("g*-*.pid"):
            m = re.fullmatch(r"g(\d+)-.+\.pid", f.name)
            if m and int(m.group(1)) <= base:
                out += [int(p) for p in f.read_text().split()]
        return out

    while time.monotonic() < until and any(_alive(p) for p in pids()):
        time.sleep(0.05)


def _wait(what: str, until: float, check: object) -> None:
    while time.monotonic() < until:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def run_shape(net: Network, shape: str, workdir: Path, timeout: float = 90.0,
              before_cut: Callable[[], object] | None = None) -> Outcome:
    """One run of `shape` on a network of 3 hosts; raises TimeoutError (with the logs) if it does not get through.
    `before_cut` is called once the job runs on both hosts, before any fault (runs at once line their cuts up)."""
    h0, h1, h2 = net.hosts
    workdir.mkdir(parents=True, exist_ok=True)
    ranks = workdir / "ranks"
    ranks.mkdir()
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
           "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "FENCING_DIR": str(ranks)}
    address = f"{h0.addr}:{PORT}"
    coord_argv = [*AXOND, "coordinator", "--host", h0.addr, "--port", str(PORT), "--token", TOKEN,
                  "--heartbeat-interval", str(HEARTBEAT), "--dead-after-missed", str(MISSED), "--settle-time", "0.5",
                  "--state-dir", str(workdir / "state")]
    logs: dict[str, Path] = {}

    def start(host: Host, name: str, argv: list[str], **extra: str) -> subprocess.Popen[bytes]:
        logs[name] = workdir / f"{name}.log"
        with open(logs[name], "ab") as out:
            return host.popen(argv, env=dict(env, **extra), stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)

    def text(name: str) -> str:
        return logs[name].read_text(errors="replace")

    def all_logs() -> str:
        return "\n".join(f"--- {n}\n{text(n)[-4000:]}" for n in logs)

    deadline = time.monotonic() + timeout
    coordinator = start(h0, "coordinator", coord_argv)
    try:
        _wait("coordinator listening", deadline, lambda: "listening on" in text("coordinator"))
        worker_argv = [*AXOND, "worker", "--coordinator", address, "--token", TOKEN, "--nnodes", "1:2",
                       "--nproc-per-node", "1", "--job", "fence", "--max-restarts", "5", "--stop-grace", "1",
                       "--outage-grace", "60", "--", sys.executable, str(HERE / "fencing_rank.py")]
        start(h1, "worker1", worker_argv)
        cut_off = start(h2, "worker2", worker_argv, FENCING_IGNORE_TERM="1")

        def both() -> int | None:
            spans = _spans(ranks)
            gens = {g for g, _ in spans}
            top = max(gens, default=0)
            hosts = {h for g, h in spans if g == top}
            return top if len(hosts) == 2 and time.time() - min(spans[(top, h)][0] for h in hosts) > 2 * LEASE \
                else None

        _wait("one generation on both hosts", deadline, lambda: both() is not None)
        base = both()
        assert base is not None
        if before_cut is not None:
            before_cut()
        if shape == "outage-partition":
            coordinator.kill()
            coordinator.wait(10)
            _wait("both workers ride out the outage", deadline,
                  lambda: all("the coordinator is away" in text(w) for w in ("worker1", "worker2")))
        _cut(h2, h0.addr, shape)
        if shape == "outage-partition":
            time.sleep(LEASE)
            coordinator = start(h0, "coordinator2", coord_argv)
        _wait(f"generation {base + 1} started", deadline, lambda: any(g > base for g, _ in _spans(ranks)))
        cut_code = cut_off.wait(max(1.0, deadline - time.monotonic()))
        # Anything of the old generation still alive would log on meanwhile: wait until none of its ranks is left
        # (a dead rank logs nothing more) or, for one that lives on, long enough for its lines to show the overlap.
        _wait_gone(ranks, base, time.monotonic() + 2 * LEASE)
        spans = _spans(ranks)
        old_last = max(last for (g, _), (_, last) in spans.items() if g <= base)
        cut_last = max(last for (g, host), (_, last) in spans.items() if g <= base and host.endswith("2"))
        new_first = min(first for (g, _), (first, _) in spans.items() if g > base)
        return Outcome(shape, new_first - old_last, new_first - cut_last, cut_code, all_logs())
    except (TimeoutError, subprocess.TimeoutExpired) as e:
        raise TimeoutError(f"fencing run {shape!r}: {e} not within {timeout} s; logs:\n{all_logs()}") from e
