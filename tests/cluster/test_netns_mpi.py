"""The mpi backend between two network-namespace hosts over Open MPI's tcp transport: `mpirun` in host 0 starts
the rank of host 1 through a launch agent that enters host 1's namespace (as ssh would enter a machine), and the
collective contract cases (tests/helpers/mpi_cases.py) pass across the hosts. Skipped without root and `ip netns`,
or without Open MPI and mpi4py."""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from axond.testing.netns import Network
from mpi_launch import RENDEZVOUS, mpirun_or_skip
from netns import base_env, netns  # noqa: F401 -- the fixture

CASES = Path(__file__).resolve().parents[1] / "helpers" / "mpi_cases.py"


def launch_agent(net: Network, path: Path) -> Path:
    """An rsh-style agent for `mpirun`: `agent HOSTNAME COMMAND...` runs COMMAND in that namespace host's shell."""
    prefixes = {h.hostname: h.command([]) for h in net.hosts}
    path.write_text(f"#!{sys.executable}\nimport os, sys\nPREFIXES = {prefixes!r}\n"
                    "prefix = PREFIXES[sys.argv[1]]\n"
                    "os.execv(prefix[0], [*prefix, '/bin/sh', '-c', ' '.join(sys.argv[2:])])\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [3, 4])
def test_contract_cases_between_two_namespace_hosts_over_mpi_tcp(n: int, netns: Callable[..., Network],
                                                                   tmp_path: Path) -> None:
    """n ranks, the first two in host 0 (Open MPI fills a host's slots first), the rest in host 1: uneven and even
    hosts, pairs within a host and across (every pair on tcp; tests/collectives/test_mpi_backend.py runs 2 ranks)."""
    mpirun = mpirun_or_skip()
    net = netns(n_hosts=2)
    h0, h1 = net.hosts
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{h0.hostname} slots={1 if n == 2 else 2}\n{h1.hostname} slots=2\n")
    agent = launch_agent(net, tmp_path / "agent.sh")
    out = tmp_path / "result.json"
    env = base_env(tmp_path / "home", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   MASTER_ADDR=h0.addr)
    env = {k: v for k, v in env.items() if k not in RENDEZVOUS or k == "MASTER_ADDR"}
    # The hosts share this machine's cores, but each sees no more ranks than cores, so MPI's and the backend's polls
    # would never yield and starve the peer they wait for: both yield (tests/collectives/test_mpi_backend.py keeps
    # the spinning path, which is no different across hosts).
    env["AXOND_MPI_SPIN"] = "0"
    argv = [mpirun, "--hostfile", str(hostfile), "-n", str(n), "--mca", "plm_rsh_agent", str(agent),
            "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", h0.ifname, "--mca", "oob_tcp_if_include",
            h0.ifname, "-x", "PATH", "-x", "HOME", "-x", "MASTER_ADDR", "-x", "PYTHONUNBUFFERED",
            "-x", "AXOND_MPI_SPIN", "--mca", "mpi_yield_when_idle", "1",
            sys.executable, str(CASES), "mpi", str(out)]
    proc = h0.run(argv, env=env, timeout=360)
    assert proc.returncode == 0 and out.is_file(), f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    first = 1 if n == 2 else 2
    assert result["hosts"] == [h0.hostname] * first + [h1.hostname] * (n - first), result["hosts"]
    assert not result["failures"], "\n\n".join(f"rank {r} {case}: {msg}" for r, case, msg in result["failures"])
