"""axond live recovery, today's restart path and torchft on the same model, faults and hosts.

The model is bench/recovery.py's small MLP (tests/helpers/live_train.py; bench/recovery_mlp.py builds it in torch with
the same data, layers, initial weights, AdamW and clipping). Each system trains it data-parallel on one process per
replica, and the process of replica (rank) 2 is faulted while the others wait for it in step 21's gradient
collective:

- **axond live**: bench/recovery.py's live path (`axond worker --live-recovery`, `DistributedTrainer` on virtual
  ranks, no checkpoint): the job goes on without the failed node; **live-rejoin**: the same with `--max-restarts 1`,
  the failed node's worker starts a new rank, which joins the running job;
- **axond restart**: bench/recovery.py's restart path (`--max-restarts 1`, a checkpoint after every step);
- **torchft**: a Lighthouse and one replica group of one process per replica (bench/torchft_replica.py: its
  `Manager`, `ProcessGroupGloo`, `DistributedDataParallel` and `should_commit`); this bench is the launcher that
  starts a replica again when its process dies, as torchx or a Slurm step would.

Faults: `kill` (SIGKILL), `stop` (SIGSTOP for `--fault-s` seconds, then SIGCONT), and with `--netns` (root) `drop`
(the switch drops every frame to and from the host for `--fault-s` seconds). Columns, seconds from the fault
(time.monotonic(), one clock for every namespace): the last survivor's error, the first step committed after it,
the first step at full size again; then the final loss on the whole data set minus a fault-free run's of the same
system, and the batches not trained (torchft drops the batches of a replica that is out). While below full size every
replica sleeps `--pace` s after each step, so that the job is still running when the lost replica comes back.

    python bench/torchft_compare.py --runs 3                        # one host: three replicas
    python bench/torchft_compare.py --netns --runs 3 --lease 1.5    # root: four namespace hosts (and a coordinator's)

torchft is not a dependency of axond: without it (`pip install torchft`) the bench says so and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import recovery
import recovery_mlp as mlp

from axond.coordinator.server import CoordinatorConfig, start_coordinator
from axond.testing.netns import Host, Network, unavailable

REPLICA = Path(__file__).resolve().with_name("torchft_replica.py")
LIGHTHOUSE_PORT = 29510
MAX_RESTARTS = 3
"""The launcher's restarts per job (a replica that keeps failing at start is not restarted for ever)."""
TORCHFT_DEFAULTS = {"timeout": 60.0, "quorum_timeout": 60.0, "heartbeat_timeout": 5.0, "join_timeout": 60.0}
"""torchft's defaults (Manager timeout and quorum_timeout, ProcessGroupGloo timeout; the Lighthouse's
heartbeat_timeout_ms and join_timeout_ms), in seconds."""


def torchft_missing() -> str | None:
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        return f"torchft is not installed ({e}); `pip install torchft` to run this comparison"
    return None


def _records(out: Path, pattern: str) -> list[dict[str, Any]]:
    return [json.loads(line) for p in out.glob(pattern) for line in p.read_text().splitlines()]


def _first(values: list[float]) -> float:
    return min(values) if values else float("nan")


class Torchft:
    """One torchft job: a Lighthouse and `replicas` replica groups of one process each, started again when they die."""

    def __init__(self, out: Path, replicas: int, timeout: float, lease: float, pace: float,
                 hosts: list[Host] | None, hang: bool) -> None:
        self.out, self.replicas, self.hosts = out, replicas, hosts
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts: list[float] = []
        self.done = threading.Event()
        lease_ms = int(lease * 1000)
        self.env = {**os.environ, "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
        if hosts is None:
            from torchft.coordination import LighthouseServer

            self.server: Any = LighthouseServer(bind="[::]:0", min_replicas=replicas - 1, join_timeout_ms=lease_ms,
                                                heartbeat_timeout_ms=lease_ms)
            self.lighthouse, self.addr = self.server.address(), ["127.0.0.1"] * replicas
        else:
            self.env["GLOO_SOCKET_IFNAME"] = hosts[0].ifname  # Gloo's address: the host's own, not its hostname's
            binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or "torchft_lighthouse"
            hosts[0].popen([binary, "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}", "--min_replicas", str(replicas - 1),
                            "--join_timeout_ms", str(lease_ms), "--heartbeat_timeout_ms", str(lease_ms)],
                           env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.server, self.lighthouse = None, f"http://{hosts[0].addr}:{LIGHTHOUSE_PORT}"
            self.addr = [h.addr for h in hosts[1:]]
        self.args = ["--lighthouse", self.lighthouse, "--timeout", str(timeout), "--replicas", str(replicas),
                     "--min-replicas", str(replicas - 1), "--hang-step", str(recovery.HANG_STEP if hang else -1),
                     "--pace", str(pace)]
        for r in range(replicas):
            self.start(r)
        self.watch = threading.Thread(target=self._supervise, daemon=True)
        self.watch.start()

    def start(self, r: int) -> None:
        argv = [sys.executable, str(REPLICA), str(self.out), str(r), "--addr", self.addr[r], *self.args]
        with open(self.out / f"log-{r}-{len(self.restarts)}.txt", "wb") as log:  # the child keeps its own copy
            if self.hosts is None:
                proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            else:
                proc = self.hosts[r + 1].popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[r] = proc

    def _supervise(self) -> None:
        """The launcher: a replica whose process died is started again (what torchx or a Slurm step does)."""
        while not self.done.wait(0.02):
            with self.lock:
                for r, proc in list(self.procs.items()):
                    if proc.poll() not in (None, 0) and len(self.restarts) < MAX_RESTARTS:
                        self.restarts.append(time.monotonic())
                        self.start(r)

    def wait(self, timeout: float) -> None:
        """Until the replicas other than 2 finished; replica 2 then gets 10 s (a replica that is not back in the job
        when the others end waits for a quorum that never comes)."""
        deadline = time.monotonic() + timeout
        while any(p.poll() != 0 for r, p in self.procs.items() if r != 2):
            if time.monotonic() > deadline or len(self.restarts) >= MAX_RESTARTS:
                tails = [p.read_text()[-1500:] for p in sorted(self.out.glob("log-*.txt"))]
                raise RuntimeError(f"torchft replicas did not finish within {timeout:.0f} s (or restarted "
                                   f"{len(self.restarts)} times):\n" + "\n".join(tails))
            time.sleep(0.05)
        try:
            self.procs[2].wait(10)
        except subprocess.TimeoutExpired:
            pass  # close() kills it

    def close(self) -> None:
        self.done.set()
        self.watch.join(5)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if self.server is not None:
            self.server.shutdown()


def torchft_run(fault: str | None, replicas: int, timeout: float, lease: float, pace: float, fault_s: float,
                net: Network | None) -> dict[str, float]:
    """One torchft job, replica 2 faulted by `fault` (None: a fault-free run): seconds from the fault to each
    milestone, the final loss and the batches not trained."""
    out = Path(tempfile.mkdtemp(prefix="torchft-"))
    job = Torchft(out, replicas, timeout, lease, pace, net.hosts if net else None, hang=fault is not None)
    timers: list[threading.Timer] = []
    try:
        at = time.monotonic()
        if fault is not None:
            pid = recovery._hung_pid(out)
            at = _fault(fault, pid, out, fault_s, timers, net.hosts[3] if net else None)
        job.wait(240)
        commits = _records(out, "steps-*.jsonl")
        first = [c["mono"] for c in commits if c["mono"] > at]
        errors = [_first([e["mono"] for e in _records(out, f"errors-{r}-*.jsonl") if e["mono"] > at])
                  for r in range(replicas) if r != 2]  # each survivor's first
        full = [c["mono"] for c in commits if c["mono"] > at and c["participants"] == replicas]
        (end,) = out.glob("end-0-*.json")
        (params,) = out.glob("end-0-*.npz")
        seen = [e for e in errors if e == e]
        return {"error": max(seen) - at if seen else float("nan"), "first_step": _first(first) - at,
                "full": _first(full) - at, "loss": mlp.full_loss(dict(np.load(params))),
                "dropped": mlp.steps(replicas) * replicas - json.loads(end.read_text())["batches_committed"]}
    finally:
        for timer in timers:
            timer.cancel()
        job.close()
        shutil.rmtree(out, ignore_errors=True)


def _fault(fault: str, pid: int, out: Path, fault_s: float, timers: list[threading.Timer], host: Host | None) -> float:
    """Fault replica 2 (its process `pid`, its `host`); returns when, on time.monotonic()."""
    if fault == "kill":
        at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
    elif fault == "stop":
        os.kill(pid, signal.SIGSTOP)
        at = time.monotonic()
        (out / "go").write_text("")
        timers.append(threading.Timer(fault_s, recovery._resume, (pid,)))
    else:
        assert host is not None
        host.drop_frames(True)
        at = time.monotonic()
        (out / "go").write_text("")  # the process goes on: its link is what failed
        timers.append(threading.Timer(fault_s, host.drop_frames, (False,)))
    for timer in timers:
        timer.start()
    return at


def axond_extra(world: int, reference: float) -> Any:
    """bench/recovery.py's `extra`: the first step at full size again, the final loss against the fault-free run's."""

    def extra(out: Path, at: float) -> dict[str, float]:
        steps = recovery._steps(out)
        full = [s["mono"] for s in steps if s["mono"] > at and s["step"] > recovery.HANG_STEP and s["world"] == world]
        losses = [mlp.full_loss(dict(np.load(p))) for p in out.glob("params-*.npz")]
        return {"full": _first(full) - at, "loss": max(losses, key=lambda v: abs(v - reference)), "dropped": 0.0}
    return extra


def axond_reference(virtual_ranks: int | None, world: int) -> float:
    """The final loss of a fault-free axond run (in this process, on threads): on `virtual_ranks`, or plain DDP."""
    from axond.testing import run_threads

    live_train = mlp.live_train()
    options = {"virtual_ranks": virtual_ranks} if virtual_ranks else {}
    states = run_threads(lambda g: _fit(live_train.build_trainer(g, [], **options)), world, 120.0)
    return mlp.full_loss(states[0])


def _fit(trainer: Any) -> dict[str, np.ndarray]:
    trainer.fit(3)
    return {k: np.array(v) for k, v in trainer.module.state_dict().items()}


def _cell(values: list[float], digits: int = 2) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    if min(values) == max(values):
        return f"{statistics.median(values):.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _row(name: str, runs: list[dict[str, float]], reference: float) -> str:
    if not runs:
        return f"| {name} | - | - | - | - | - |"
    worst = max((r["loss"] - reference for r in runs), key=abs)
    return (f"| {name} | {_cell([r['error'] for r in runs])} | {_cell([r['first_step'] for r in runs])} | "
            f"{_cell([r['full'] for r in runs])} | {worst:+.2e} | {_cell([r['dropped'] for r in runs], 0)} |")


FAULT_NAMES = {"kill": "SIGKILL", "stop": "SIGSTOP {s:g} s", "drop": "DROP both ways {s:g} s"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", default="kill,stop", help="kill, stop and (--netns) drop, comma-separated")
    parser.add_argument("--fault-s", type=float, default=10.0, help="how long a stop or a drop lasts (s)")
    parser.add_argument("--netns", action="store_true", help="four namespace hosts (root), as recovery.py --part cut")
    parser.add_argument("--lease", type=float, default=0.0, help="axond's lease (s); torchft's timeouts are set to it "
                        "(default: 5 on one host, the coordinator's 1 s x 5; 1.5 with --netns: 0.25 s x 6)")
    parser.add_argument("--torchft-timeout", type=float, default=0.0,
                        help="torchft's Manager and Gloo timeout (s); default: the lease (torchft's own: 60)")
    parser.add_argument("--pace", type=float, default=0.0,
                        help="sleep after each step below full size (s); default 0.3 on one host, 1 with --netns")
    parser.add_argument("--systems", default="live,live-rejoin,restart,torchft",
                        help="live: the job goes on without the node; live-rejoin: its worker starts a rank that joins")
    args = parser.parse_args()
    missing = torchft_missing()
    if missing:
        raise SystemExit(f"bench/torchft_compare.py: {missing}")
    faults = args.faults.split(",")
    systems = args.systems.split(",")
    if not set(faults) <= set(FAULT_NAMES) or ("drop" in faults and not args.netns):
        parser.error(f"--faults takes kill, stop (and drop with --netns), got {args.faults!r}")
    if args.netns and (reason := unavailable()):
        raise SystemExit(f"--netns needs network namespaces: {reason}")
    replicas = 4 if args.netns else 3
    lease = args.lease or (1.5 if args.netns else 5.0)
    timeout = args.torchft_timeout or lease
    args.pace = args.pace or (1.0 if args.netns else 0.3)
    os.environ.setdefault("RUST_LOG", "warn")  # the in-process Lighthouse logs every quorum at info
    os.environ["LIVE_TEST_PACE_S"] = str(args.pace)  # read by live_train.py in the workers' ranks
    os.environ["LIVE_TEST_WAIT_JOIN"] = f"-1:{replicas}"  # its full world size (the pace applies below it)
    os.environ["LIVE_TEST_PARALLEL"] = "ddp"
    live_reference = axond_reference(replicas, 1)
    references = {"live": live_reference, "live-rejoin": live_reference, "restart": axond_reference(None, replicas)}
    print(f"{replicas} replicas {'on namespace hosts' if args.netns else 'on one host'}; axond lease {lease:g} s; "
          f"torchft timeout {timeout:g} s, Lighthouse heartbeat and join timeouts {lease:g} s; pace {args.pace:g} s "
          f"below full size; seconds from the fault, median (min-max) of {args.runs} runs", flush=True)
    coord = None
    if not args.netns:
        coord = start_coordinator(CoordinatorConfig(host="127.0.0.1", port=0, in_memory=True, insecure=True,
                                                    heartbeat_interval=lease / 5, dead_after_missed=5,
                                                    settle_time=5.0))
    try:
        if "torchft" in systems:
            references["torchft"] = _torchft(None, args.netns, replicas, timeout, lease, args)["loss"]
        print("fault-free final loss: " + ", ".join(f"{k} {v:.4f}" for k, v in references.items()), flush=True)
        print("| fault on replica 2 | system | survivors' error | first step after | full size again | "
              "final loss vs fault-free | batches not trained |")
        print("|---|---|---:|---:|---:|---:|---:|", flush=True)
        for fault in faults:
            name = FAULT_NAMES[fault].format(s=args.fault_s)
            for system in systems:
                if system == "restart" and args.netns:
                    continue  # bench/recovery.py's restart path runs on one host only
                runs, failed = [], 0
                for i in range(args.runs):
                    try:
                        runs.append(_one(system, fault, f"{fault}-{system}-{i}", replicas, lease, timeout, args, coord,
                                         references[system]))
                    except Exception as e:  # noqa: BLE001 (a failed run is counted in the table, the others go on)
                        failed += 1
                        print(f"{fault} {system} run {i} failed: {e}"[:3000], file=sys.stderr, flush=True)
                label = f"{system} ({failed} of {args.runs} runs failed)" if failed else system
                print(_row(f"{name} | {label}", runs, references[system]), flush=True)
    finally:
        if coord is not None:
            coord.stop(grace=0.2)


def _torchft(fault: str | None, netns: bool, replicas: int, timeout: float, lease: float,
             args: argparse.Namespace) -> dict[str, float]:
    if not netns:
        return torchft_run(fault, replicas, timeout, lease, args.pace, args.fault_s, None)
    with Network.create(replicas + 1) as net:
        return torchft_run(fault, replicas, timeout, lease, args.pace, args.fault_s, net)


def _one(system: str, fault: str, job: str, replicas: int, lease: float, timeout: float, args: argparse.Namespace,
         coord: Any, reference: float) -> dict[str, float]:
    if system == "torchft":
        return _torchft(fault, args.netns, replicas, timeout, lease, args)
    extra = axond_extra(replicas, reference)
    if args.netns:
        return recovery.cut_run(fault, lease / 6, 6, rejoin=system == "live-rejoin", fault_s=args.fault_s, extra=extra)
    stop_s = args.fault_s if fault == "stop" else 0.0
    return recovery.one_run(coord.address, system != "restart", job, rejoin=system == "live-rejoin", stop_s=stop_s,
                            extra=extra)


if __name__ == "__main__":
    main()
