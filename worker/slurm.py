"""A job's shape from a Slurm allocation: the step's nodes, this node's place, the head's address and the token.

`axond slurm` runs as one Slurm task per node (`srun --ntasks-per-node=1 axond slurm -- CMD`). Everything it
needs comes from the variables srun sets (`Allocation.from_env`): the step's node list in Slurm's compressed
hostlist syntax (`expand_hostlist`), this node's index in it, the number of GPUs or CPUs Slurm gave the
node. The first node of the step runs the coordinator; `head_address` finds the address every node reaches
it at. The token travels in a file on storage every node shares, written by the head (`publish_token`) and
read by the others (`wait_for_token`), unless the batch script hands one to every task itself (AXOND_TOKEN).
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from axond.control.credentials import read_token_file
from axond.coordinator.state.rendezvous import natural_order
from axond.errors import CoordinatorError

__all__ = ["Allocation", "SlurmError", "default_token_path", "expand_hostlist", "head_address", "publish_token",
           "wait_for_token"]

PORT_BASE = 29500
"""The coordinator of Slurm job J listens on PORT_BASE + J % PORT_SPAN unless --port says otherwise."""
PORT_SPAN = 1000
"""Jobs whose ids differ by less than this never share a default port (two jobs on one head node)."""
MAX_HOSTS = 65536
"""A hostlist expanding to more names than this is refused (a typo like [1-99999999] must not eat memory)."""
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class SlurmError(ValueError):
    """The Slurm environment is missing, malformed or not what `axond slurm` can run under (the message says
    what to do)."""


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split `text` at `sep` outside brackets; raises on unbalanced brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmError(f"hostlist {text!r}: nested '[' at offset {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"hostlist {text!r}: ']' without '[' at offset {i}")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmError(f"hostlist {text!r}: '[' is never closed")
    parts.append(text[start:])
    return parts


def _expand_ranges(spec: str, whole: str) -> list[str]:
    """`01-03,07` -> ['01', '02', '03', '07']: each range keeps the width of its lower bound (Slurm's padding)."""
    out: list[str] = []
    for item in spec.split(","):
        m = _RANGE.fullmatch(item.strip())
        if not m:
            raise SlurmError(f"hostlist {whole!r}: {item!r} in [{spec}] is not N or N-M")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise SlurmError(f"hostlist {whole!r}: range {item!r} runs backwards")
        if hi - lo + 1 + len(out) > MAX_HOSTS:
            raise SlurmError(f"hostlist {whole!r} names more than {MAX_HOSTS} hosts")
        width = len(lo_text) if lo_text.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_name(name: str, whole: str) -> list[str]:
    """One hostlist item, possibly with several bracket groups (`r[1-2]n[01-02]`, Slurm's multi-dimensional form)."""
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        if "[" in name or "]" in name:
            raise SlurmError(f"hostlist {whole!r}: unbalanced brackets in {name!r}")
        return [name]
    head, tail = name[: m.start()], name[m.end():]
    tails = _expand_name(tail, whole)
    names = [head + n + t for n in _expand_ranges(m.group(1), whole) for t in tails]
    if len(names) > MAX_HOSTS:
        raise SlurmError(f"hostlist {whole!r} names more than {MAX_HOSTS} hosts")
    return names


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed hostlist (`node[01-03,07],gpu-a[1-2]-ib,login1`) as host names, in order.

    Bracketed ranges keep the zero padding of their lower bound (`[08-11]` -> 08 09 10 11); several bracket
    groups in one name expand as a product, the last fastest. Raises SlurmError on malformed text.
    """
    text = text.strip()
    if not text:
        raise SlurmError("the hostlist is empty")
    names: list[str] = []
    for part in _split_top(text):
        part = part.strip()
        if not part:
            raise SlurmError(f"hostlist {text!r} has an empty item")
        names.extend(_expand_name(part, text))
        if len(names) > MAX_HOSTS:
            raise SlurmError(f"hostlist {text!r} names more than {MAX_HOSTS} hosts")
    return names


def _int(env: Mapping[str, str], name: str) -> int | None:
    """The integer in env[name] (None if unset or empty); `2(x3)` forms count their first number."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    m = re.match(r"\d+", raw)
    if m is None:
        raise SlurmError(f"{name}={raw!r} is not a number")
    return int(m.group(0))


def _tasks_per_node(text: str) -> int | None:
    """The most tasks on one node in Slurm's per-node count list (`2(x3),1` -> 2); None if `text` is empty."""
    if not text.strip():
        return None
    counts = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise SlurmError(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not a list like 2(x3),1")
        counts.append(int(m.group(1)))
    return max(counts)


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    return None


@dataclass(frozen=True)
class Allocation:
    """The part of a Slurm job step one `axond slurm` task sees."""

    job_id: str
    """SLURM_JOB_ID."""
    job_name: str
    """SLURM_JOB_NAME ("" if unset)."""
    step_id: str
    """SLURM_STEP_ID."""
    nodes: tuple[str, ...]
    """The step's nodes in Slurm's order (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST / SLURM_NODELIST)."""
    node_id: int
    """This node's index in `nodes` (SLURM_NODEID)."""
    gpus_on_node: int
    """SLURM_GPUS_ON_NODE (0 if unset)."""
    cpus_on_node: int
    """CPUs this task may use: SLURM_CPUS_PER_TASK, else SLURM_CPUS_ON_NODE (1 if neither is set)."""
    restart_count: int = 0
    """SLURM_RESTART_COUNT: how often Slurm requeued the job."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation:
        """Read the allocation from srun's variables in `env` (`RuntimeEnv.environ`); SlurmError says what is missing
        or inconsistent."""
        job_id = env.get("SLURM_JOB_ID", "").strip() or env.get("SLURM_JOBID", "").strip()
        if not job_id:
            raise SlurmError("SLURM_JOB_ID is not set: run this inside a Slurm job, e.g. in an sbatch script: "
                             "srun --ntasks-per-node=1 axond slurm -- python train.py")
        step = _first(env, "SLURM_STEP_ID", "SLURM_STEPID")
        if step is None or not env.get("SLURM_NODEID", "").strip():
            raise SlurmError("this is not a job step (no SLURM_STEP_ID or SLURM_NODEID): start `axond slurm` with "
                             "srun, one task per node, not directly in the batch script: "
                             "srun --ntasks-per-node=1 axond slurm -- CMD")
        found = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if found is None:
            raise SlurmError("none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set")
        nodes = tuple(expand_hostlist(found[1]))
        if len(set(nodes)) != len(nodes):
            raise SlurmError(f"{found[0]}={found[1]!r} names a node twice")
        node_id = _int(env, "SLURM_NODEID") or 0
        counted = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        if counted is not None and found[0] != "SLURM_STEP_NODELIST" and _int(env, counted[0]) != len(nodes):
            raise SlurmError(f"{counted[0]}={counted[1]} but {found[0]}={found[1]!r} names {len(nodes)} nodes")
        if not 0 <= node_id < len(nodes):
            raise SlurmError(f"SLURM_NODEID={node_id} is outside the {len(nodes)} nodes of {found[0]}={found[1]!r}")
        tasks = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
        local_id = _int(env, "SLURM_LOCALID") or 0
        per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
        if local_id > 0 or (tasks is not None and tasks > len(nodes)) or (per_node is not None and per_node > 1):
            raise SlurmError(
                f"this step runs more than one task per node (SLURM_NTASKS={tasks}, SLURM_STEP_TASKS_PER_NODE="
                f"{env.get('SLURM_STEP_TASKS_PER_NODE', '')!r}, SLURM_LOCALID={local_id}); `axond slurm` starts the "
                "ranks itself: run it once per node with "
                "`srun --ntasks-per-node=1 axond slurm --nproc-per-node N -- CMD`"
            )
        cpus = _int(env, "SLURM_CPUS_PER_TASK") or _int(env, "SLURM_CPUS_ON_NODE") or 1
        return cls(
            job_id=job_id, job_name=env.get("SLURM_JOB_NAME", "").strip(), step_id=step[1],
            nodes=nodes, node_id=node_id, gpus_on_node=_int(env, "SLURM_GPUS_ON_NODE") or 0, cpus_on_node=cpus,
            restart_count=_int(env, "SLURM_RESTART_COUNT") or 0,
        )

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def head(self) -> str:
        """The step's first node: it runs the coordinator."""
        return self.nodes[0]

    @property
    def is_head(self) -> bool:
        return self.node_id == 0

    def default_job(self) -> str:
        """The axond job name: `<SLURM_JOB_NAME>-<SLURM_JOB_ID>` (characters outside [A-Za-z0-9._-] become '-')."""
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", self.job_name).strip("-")[:64]
        return f"{name or 'slurm'}-{self.job_id}"

    def default_port(self) -> int:
        """The coordinator's port unless --port says otherwise (different for jobs with nearby ids)."""
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return PORT_BASE + int(digits) % PORT_SPAN

    def nproc(self, choice: str) -> int:
        """Ranks per node for `--nproc-per-node`: a number, `gpu` (SLURM_GPUS_ON_NODE), `cpu` (the task's CPUs) or
        `auto` (the GPUs if Slurm gave any, else 1)."""
        if choice == "auto":
            return self.gpus_on_node or 1
        if choice == "gpu":
            if not self.gpus_on_node:
                raise SlurmError("--nproc-per-node gpu: SLURM_GPUS_ON_NODE is unset or 0; ask Slurm for GPUs "
                                 "(--gpus-per-node N) or pass a number")
            return self.gpus_on_node
        if choice == "cpu":
            return self.cpus_on_node
        try:
            n = int(choice)
        except ValueError as e:
            raise SlurmError(f"--nproc-per-node takes a number, auto, gpu or cpu; got {choice!r}") from e
        if n < 1:
            raise SlurmError(f"--nproc-per-node must be >= 1, got {n}")
        return n

    def rank_order_notice(self) -> str | None:
        """A line saying node ranks differ from SLURM_NODEID, or None when they agree: the coordinator numbers
        nodes by host name with digit runs compared as numbers, which matches Slurm's order of a sorted list."""
        ordered = sorted(self.nodes, key=_host_order)
        if list(self.nodes) == ordered:
            return None
        return (f"node ranks follow host names ({', '.join(ordered[:4])}...), which differs from Slurm's "
                "node order here; NODE_RANK may differ from SLURM_NODEID")


def _host_order(host: str) -> tuple[tuple[str | int, ...], int]:
    return natural_order((host, 0))


def _resolve(name: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _slurm_node_addr(name: str, timeout: float = 10.0) -> str | None:
    """NodeAddr of `name` as slurmctld knows it (`scontrol show node`), or None without scontrol."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        done = subprocess.run([scontrol, "show", "node", "-o", name], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", done.stdout)
    return m.group(1) if done.returncode == 0 and m else None


def _route_to(address: str) -> str | None:
    """This machine's address on the route to `address` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def _node_address(name: str) -> str | None:
    """An IPv4 address of Slurm node `name`: its NodeAddr from slurmctld, resolved, else its name resolved."""
    for candidate in (_slurm_node_addr(name), name):
        if candidate:
            found = _resolve(candidate)
            if found:
                return found[0]
    return None


def head_address(alloc: Allocation) -> str:
    """The IPv4 address every node reaches the head (the coordinator) at.

    The head's own name often resolves to loopback on the head itself (Debian's 127.0.1.1 line): there the
    address is the head's interface on the route to the second node, so its ranks advertise an address the
    other nodes can reach."""
    address = _node_address(alloc.head)
    if address is None:
        raise SlurmError(f"cannot resolve the head node {alloc.head!r} (neither DNS nor `scontrol show node` knows "
                         "its address)")
    if not ipaddress.ip_address(address).is_loopback or alloc.nnodes == 1:
        return address
    if not alloc.is_head:
        raise SlurmError(f"the head node {alloc.head!r} resolves to {address} (loopback) on {socket.gethostname()}; "
                         "fix the name resolution of the cluster's nodes")
    other = _node_address(alloc.nodes[1])
    routed = _route_to(other) if other else None
    if routed is None or ipaddress.ip_address(routed).is_loopback:
        raise SlurmError(f"this node's name {alloc.head!r} resolves to {address} (loopback) and no route to "
                         f"{alloc.nodes[1]!r} shows another address of it")
    return routed


def default_token_path(alloc: Allocation, home: str | None = None) -> Path:
    """~/.axond/slurm/<job>.<step>[.r<restarts>].token: private to the user, on the home directory every node of
    most clusters shares."""
    base = Path(home or os.path.expanduser("~")) / ".axond" / "slurm"
    name = f"{alloc.job_id}.{alloc.step_id}"
    if alloc.restart_count:
        name += f".r{alloc.restart_count}"
    return base / f"{name}.token"


def publish_token(path: Path) -> str:
    """A fresh token written to `path` (mode 0600, directory 0700 if created), replacing any stale file
    atomically so that a reader never sees half a token."""
    token = secrets.token_hex(16)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def wait_for_token(path: Path, timeout: float, poll: float = 0.2) -> str:
    """The token the head wrote to `path`, waiting up to `timeout` seconds for it to appear."""
    deadline = time.monotonic() + timeout
    while True:
        if path.is_file():
            try:
                return read_token_file(path)
            except CoordinatorError:
                pass  # written but not yet renamed into place on a slow shared file system: look again
        if time.monotonic() >= deadline:
            raise SlurmError(
                f"the head node wrote no token to {path} within {timeout:g} s: the directory must be on storage "
                "every node shares (pass --token-file PATH there), or set AXOND_TOKEN in the batch script "
                "before srun, e.g. export AXOND_TOKEN=$(openssl rand -hex 16)"
            )
        time.sleep(poll)
