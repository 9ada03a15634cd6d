"""A Slurm cluster in network-namespace hosts, for tests/cluster/test_slurm_cluster.py.

Host 0 runs slurmctld and a slurmd, every other host a slurmd; one munged (its own key and socket in the
test's directory) authenticates them all, through a socket path every namespace shares. The
configuration is written into the test's directory; nothing of the machine's own Slurm or munge set-up is
read or changed. `unavailable()` says why such a cluster cannot be built here (None if it can).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from axond.testing.netns import Network
from axond.testing.netns import unavailable as netns_unavailable
from netns import Proc
from axond.testing.netns import Host

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo")
SBIN = os.pathsep.join(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), SBIN]))


def unavailable() -> str | None:
    """Why a Slurm cluster in namespaces cannot run here (root and `ip netns`, munge, slurmctld/slurmd)."""
    reason = netns_unavailable()
    if reason:
        return reason
    missing = [name for name in (*DAEMONS, *CLIENTS, "nsenter", "unshare") if _which(name) is None]
    if missing:
        return f"Slurm or munge is not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge"
    return None


@dataclass
class SlurmCluster:
    """slurmctld + one slurmd per host of `net`, configured under `root`."""

    net: Network
    root: Path
    env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def nodes(self) -> list[str]:
        return [h.hostname for h in self.net.hosts]

    def client_env(self, **extra: str) -> dict[str, str]:
        return dict(self.env, SLURM_CONF=str(self.conf), **extra)

    def run(self, argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command in host 0 (where slurmctld listens)."""
        return self.net.hosts[0].run(argv, env=self.client_env(), timeout=timeout)

    def submit_and_wait(self, script: Path, chdir: Path, timeout: float) -> tuple[str, str, int]:
        """sbatch `script`, then poll slurmctld (every 0.2 s, where `sbatch --wait` sleeps up to 10 s) until the
        job ended: (job id, final state, exit code)."""
        done = self.run(["sbatch", "--parsable", "--chdir", str(chdir), str(script)])
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr}\n{self.logs()}")
        job_id = done.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
            state = re.search(r"\bJobState=(\S+)", shown)
            code = re.search(r"\bExitCode=(\d+):(\d+)", shown)
            if state and code and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return job_id, state.group(1), int(code.group(1))
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} did not end within {timeout} s\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for log in sorted(self.root.glob("*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def wait_idle(self, timeout: float) -> None:
        """Until every node is idle in `sinfo` (its slurmd registered with slurmctld)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            done = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
            last = done.stdout + done.stderr
            states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
            if done.returncode == 0 and len(states) == len(self.nodes) and set(states.values()) == {"idle"}:
                return
            time.sleep(0.5)
        raise TimeoutError(f"the nodes did not become idle within {timeout} s; sinfo said:\n{last}\n{self.logs()}")


class DaemonProc(Proc):
    """A daemon in a host's network namespace, entered with nsenter rather than `ip netns exec`: the latter
    mounts a fresh /sys, without the cgroup file systems slurmd insists on finding."""

    def __init__(self, host: Host, name: str, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.host = host
        self.log = logdir / f"{name}.log"
        wrapped = [_which("nsenter") or "nsenter", f"--net=/run/netns/{host.ns}", _which("unshare") or "unshare",
                   "--uts", "--", "/bin/sh", "-c", 'printf %s "$0" > /proc/sys/kernel/hostname && exec "$@"',
                   host.hostname, *argv]
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(wrapped, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        host.procs.append(self.popen)  # reaped by Network.close, which kills everything in the namespace


def write_config(root: Path, net: Network, cpus: int) -> None:
    """munge key and slurm.conf for `net`: host 0 is the controller, every host a node of partition `axond`."""
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    nodes = "\n".join(f"NodeName={h.hostname} NodeAddr={h.addr} CPUs={cpus} RealMemory=500 State=UNKNOWN"
                      for h in net.hosts)
    names = ",".join(h.hostname for h in net.hosts)
    h0 = net.hosts[0]
    (root / "slurm.conf").write_text(f"""\
ClusterName=axondtest
SlurmctldHost={h0.hostname}({h0.addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
{nodes}
PartitionName=axond Nodes={names} Default=YES MaxTime=INFINITE State=UP
""")


def start(net: Network, root: Path, env: dict[str, str], cpus: int = 2, timeout: float = 60.0) -> SlurmCluster:
    """munged, slurmctld and the slurmds, each in its host; returns once every node is idle."""
    (root / "ctld").mkdir(parents=True)
    for host in net.hosts:
        (root / "spool" / host.hostname).mkdir(parents=True)
    write_config(root, net, cpus)
    cluster = SlurmCluster(net, root, env)
    h0 = net.hosts[0]
    munged = [_which("munged") or "munged", "-F", "--force", f"--socket={root}/munge.sock",
              f"--key-file={root}/munge.key", f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
              f"--seed-file={root}/munged.seed"]
    cluster.procs.append(DaemonProc(h0, "munged-out", munged, env, root))
    deadline = time.monotonic() + timeout
    while not (root / "munge.sock").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"munged did not start:\n{cluster.logs()}")
        time.sleep(0.05)
    ctld = [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(cluster.conf)]
    cluster.procs.append(DaemonProc(h0, "slurmctld-out", ctld, env, root))
    for host in net.hosts:
        slurmd = [_which("slurmd") or "slurmd", "-D", "-f", str(cluster.conf), "-N", host.hostname]
        cluster.procs.append(DaemonProc(host, f"slurmd-{host.hostname}-out", slurmd, env, root))
    cluster.wait_idle(timeout)
    return cluster
