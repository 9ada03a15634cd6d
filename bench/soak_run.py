"""One chaos soak (bench/soak.py): a live job across four network-namespace hosts, one random fault every `period`
seconds, then the job ended at one step on every rank; returns what happened (`SoakRun`), analysed by soak_report.py.

A coordinator runs in host 0 (lease `heartbeat` x `missed`), with a small status poller beside it (the coordinator's
goodput book counts a generation productive only once someone reads it); hosts 1-4 run one `axond worker
--live-recovery --nnodes MIN:4 --max-restarts R` each, of one rank (bench/soak_train.py, or bench/soak_train_torch.py
for torch DDP over "axond"). A failed node's own worker re-joins the job as a replacement while restarts are left; a
worker that exits anyway is started again in its host (counted: `respawned`), so that the job can return to full size
after each fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axond.testing.netns import Host, Network

RANK_SCRIPT = Path(__file__).resolve().parent / "soak_train.py"
TORCH_SCRIPT = Path(__file__).resolve().parent / "soak_train_torch.py"
"""The rank program of `--torch`: torch DDP over "axond" through `axond.torch.live.Manager`."""
TOKEN, PORT, JOB = "soak-token", 29500, "soak"
FULL = 4
"""Worker hosts (one rank each): the job's MAX."""
POLLER = """
import json, sys, time
from axond.control.client import connect
client = connect(sys.argv[1], token=sys.argv[2])
while True:
    try:
        for j in client.get_status(job=sys.argv[3]).jobs:
            if j.job == sys.argv[3]:
                print(json.dumps({"mono": time.monotonic(), "wall_s": j.wall_s, "state": j.state,
                                  "parts": {p.cause: p.seconds for p in j.goodput}}), flush=True)
    except Exception as e:  # the coordinator is busy or gone: try again at the next read
        print(json.dumps({"error": str(e)[:200]}), flush=True)
    time.sleep(float(sys.argv[4]))
"""


@dataclass(frozen=True)
class SoakConfig:
    duration: float = 600.0
    """Seconds of faults (the first one `period` after the job first trained at full size)."""
    period: float = 30.0
    faults: tuple[str, ...] = ("kill", "stop", "drop")
    seed: int = 0
    cycle: bool = False
    """Take the kinds of fault in turn (kill, stop, drop, kill, ...) instead of at random (the hosts stay random)."""
    hold: float = 10.0
    """How long a SIGSTOP or a DROP lasts."""
    heartbeat: float = 0.25
    missed: int = 6
    fence_margin: float = 0.5
    min_nodes: int = 2
    max_restarts: int = 1000
    hidden: int = 512
    parallel: str = "ddp"
    copy_every: int = 1
    """ZeRO-1/FSDP: the trainer's `copy_every` (both copies every N steps, the buddy keeping the gradients between)."""
    torch: bool = False
    """torch DDP over "axond" (`axond.torch.live.Manager`, bench/soak_train_torch.py), not `DistributedTrainer`."""
    respawn_after: float = 0.0
    """Seconds after a worker exited before the soak starts it again (the job runs smaller meanwhile)."""
    settle: float = 10.0
    poll_every: float = 5.0
    tail: float = 60.0
    """After the last fault: how long the job gets to return to full size before the soak ends it."""
    log: bool = True

    @property
    def lease(self) -> float:
        return self.heartbeat * self.missed


@dataclass
class Fault:
    kind: str
    host: int
    at: float
    """time.monotonic() of the fault (this machine's clock: the namespaces share it)."""
    pid: int = 0
    world: int = 0
    """The job's world size when it struck (the newest step's)."""
    gen: int = 0
    """The job's generation when it struck."""


@dataclass
class SoakRun:
    config: SoakConfig
    out: Path
    started: float
    first_full: float
    ended: float
    faults: list[Fault] = field(default_factory=list)
    respawned: list[tuple[int, float, int]] = field(default_factory=list)
    """(host, when, exit code) of each worker the soak started again after it exited."""
    statuses: list[dict[str, Any]] = field(default_factory=list)
    stop_step: int = 0
    exit_codes: list[int] = field(default_factory=list)


def axond_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", "from axond.cli.main import main; main()", *args]


class Steps:
    """The ranks' step logs, read as they grow."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.offsets: dict[Path, int] = {}
        self.last: dict[str, Any] | None = None
        """The newest committed step seen (by its end time)."""

    def poll(self) -> None:
        for path in self.out.glob("steps-*.jsonl"):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + end
            for raw in data[:end].splitlines():
                line = json.loads(raw)
                if line["kind"] == "step" and (self.last is None or line["mono"] > self.last["mono"]):
                    self.last = line


def rank_pid(host: Host, out: Path) -> int:
    """The pid of the rank running in `host` (0 if none: its worker is between ranks)."""
    pids = set(host.pids())
    mine = [int(p.name.removeprefix("start-")) for p in out.glob("start-*")]
    alive = [p for p in mine if p in pids and Path(f"/proc/{p}").exists()]
    return max(alive) if alive else 0


class Soak:
    def __init__(self, config: SoakConfig, net: Network, out: Path) -> None:
        self.c, self.net, self.out = config, net, out
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "SOAK_HIDDEN": str(config.hidden),
                    "SOAK_PARALLEL": config.parallel, "SOAK_COPY_EVERY": str(config.copy_every)}
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.exited: dict[int, float] = {}
        """Host -> when its worker was first seen exited (started again `respawn_after` later)."""
        self.steps = Steps(out)
        self.pending: list[tuple[float, str, int, int]] = []
        """(when, what, host, pid): a SIGCONT or an un-DROP to do."""
        self.say = print if config.log else (lambda *a, **k: None)

    def start(self) -> subprocess.Popen[bytes]:
        h0 = self.net.hosts[0]
        c = self.c
        h0.popen(axond_argv("coordinator", "--host", h0.addr, "--port", str(PORT), "--token", TOKEN, "--in-memory",
                            "--heartbeat-interval", str(c.heartbeat), "--dead-after-missed", str(c.missed),
                            "--settle-time", str(c.settle), "--fence-margin", str(c.fence_margin)),
                 env=self.env, stdout=open(self.out / "coordinator.log", "wb"), stderr=subprocess.STDOUT)
        time.sleep(1.0)
        for host in self.net.hosts[1:]:
            self.start_worker(host)
        return h0.popen([sys.executable, "-c", POLLER, f"{h0.addr}:{PORT}", TOKEN, JOB, str(c.poll_every)],
                        env=self.env, stdout=open(self.out / "status.jsonl", "wb"), stderr=subprocess.DEVNULL)

    def start_worker(self, host: Host) -> None:
        c = self.c
        argv = axond_argv("worker", "--coordinator", f"{self.net.hosts[0].addr}:{PORT}", "--token", TOKEN,
                          "--nnodes", f"{c.min_nodes}:{FULL}", "--job", JOB, "--live-recovery", "--max-restarts",
                          str(c.max_restarts), "--join-timeout", "120", "--", sys.executable,
                          str(TORCH_SCRIPT if c.torch else RANK_SCRIPT), str(self.out))
        log = open(self.out / f"worker{host.index}.log", "ab")
        self.workers[host.index] = host.popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def tick(self, run: SoakRun) -> None:
        """Undo faults whose hold ended; start again a worker that exited; read the step logs."""
        now = time.monotonic()
        for item in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(item)
            _, what, index, pid = item
            if what == "cont":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            else:
                self.net.hosts[index].drop_frames(False)
        for index, w in list(self.workers.items()):
            code = w.poll()
            if code is not None and not (self.out / "stop").exists():
                seen = self.exited.setdefault(index, now)
                if now - seen < self.c.respawn_after:
                    continue  # the job goes on without it for a while first
                del self.exited[index]
                run.respawned.append((index, now, code))
                self.say(f"[soak {now - run.started:6.1f}s] worker of host {index} exited {code}: started again")
                self.start_worker(self.net.hosts[index])
        self.steps.poll()

    def strike(self, run: SoakRun, kind: str, rng: random.Random) -> None:
        hosts = self.net.hosts[1:]
        candidates = [h for h in hosts if rank_pid(h, self.out)]
        host = rng.choice(candidates or hosts)
        last = self.steps.last or {}
        fault = Fault(kind, host.index, 0.0, rank_pid(host, self.out), last.get("world", 0), last.get("gen", 0))
        if kind == "kill" and fault.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(fault.pid, signal.SIGKILL)
        elif kind == "stop" and fault.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(fault.pid, signal.SIGSTOP)
            self.pending.append((time.monotonic() + self.c.hold, "cont", host.index, fault.pid))
        elif kind == "drop":
            host.drop_frames(True)
            self.pending.append((time.monotonic() + self.c.hold, "undrop", host.index, 0))
        fault.at = time.monotonic()
        run.faults.append(fault)
        self.say(f"[soak {fault.at - run.started:6.1f}s] {kind} on host {host.index} (pid {fault.pid}, world "
                 f"{fault.world}, generation {fault.gen})")

    def wait_full(self, run: SoakRun, timeout: float) -> bool:
        """Wait until the job trains at full size, in a generation after the last fault's if it struck a rank."""
        deadline = time.monotonic() + timeout
        last_fault = run.faults[-1] if run.faults else None
        after = last_fault.gen if last_fault is not None and (last_fault.pid or last_fault.kind == "drop") else 0
        while time.monotonic() < deadline:
            self.tick(run)
            last = self.steps.last
            if last is not None and last["world"] == FULL and last["gen"] > after and len(
                    {rank_pid(h, self.out) for h in self.net.hosts[1:]} - {0}) == FULL:
                return True
            time.sleep(0.2)
        return False


def run_soak(config: SoakConfig, out: Path) -> SoakRun:
    """The soak; `out` receives the logs (steps, workers, coordinator, status)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(config.seed)
    with Network.create(FULL + 1) as net:
        soak = Soak(config, net, out)
        started = time.monotonic()
        poller = soak.start()
        run = SoakRun(config, out, started, 0.0, 0.0)
        if not soak.wait_full(run, 300.0):
            raise RuntimeError(f"the job did not train at full size within 300 s; see {out}/worker*.log")
        run.first_full = time.monotonic()
        soak.say(f"[soak {run.first_full - started:6.1f}s] training at full size")
        at = run.first_full + config.period
        while at <= run.first_full + config.duration:
            while time.monotonic() < at:
                soak.tick(run)
                time.sleep(0.05)
            kind = config.faults[len(run.faults) % len(config.faults)] if config.cycle else rng.choice(config.faults)
            soak.strike(run, kind, rng)
            at += config.period
        while soak.pending:
            soak.tick(run)
            time.sleep(0.05)
        back = soak.wait_full(run, config.tail)
        soak.say(f"[soak {time.monotonic() - started:6.1f}s] {'back at full size' if back else 'NOT back at full size'}"
                 "; ending the job")
        last = soak.steps.last or {"step": 0}
        run.stop_step = int(last["step"]) + 40
        (out / "stop").write_text(str(run.stop_step))
        deadline = time.monotonic() + 180
        for w in soak.workers.values():
            try:
                run.exit_codes.append(w.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                run.exit_codes.append(-999)
        run.ended = time.monotonic()
        time.sleep(min(config.poll_every, 5.0) + 0.5)  # the poller's last read of the finished job
        poller.kill()
        status = out / "status.jsonl"
        run.statuses = [json.loads(line) for line in status.read_text().splitlines() if line.startswith("{")]
    save(run)
    return run


def save(run: SoakRun) -> None:
    """`run.json` in the run's directory: what `load` reads back (analyse a run again: `bench/soak.py --analyse`)."""
    data = dataclasses.asdict(run)
    data["out"] = str(run.out)
    (run.out / "run.json").write_text(json.dumps(data))


def load(out: Path) -> SoakRun:
    data = json.loads((out / "run.json").read_text())
    raw = data.pop("config")
    config = SoakConfig(**{**raw, "faults": tuple(raw["faults"])})
    faults = [Fault(**f) for f in data.pop("faults")]
    respawned = [tuple(r) for r in data.pop("respawned")]
    return SoakRun(config=config, out=Path(data.pop("out")), faults=faults, respawned=respawned, **data)
