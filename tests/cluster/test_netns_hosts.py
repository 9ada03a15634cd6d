"""Jobs across real network hosts: a coordinator and two workers in separate network namespaces.

Host 0 runs `axond coordinator`, hosts 1 and 2 `axond worker` with one rank each (tests/helpers/netns_job.py),
so every byte between ranks crosses a veth link and a bridge, at the addresses the ranks advertise.
Needs root and `ip netns` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from axond.testing.netns import Host, Network
from axond.worker.launcher import CAUSE_GRACE_S
from netns import AXOND, Proc, base_env, netns  # noqa: F401 - netns is the fixture

pytestmark = pytest.mark.slow  # jobs across network-namespace hosts (real coordinator and workers)

HERE = Path(__file__).resolve().parents[1] / "helpers"
TOKEN = "netns-test-token"
PORT = 29500
JOB = "netns"
STOP_GRACE = 1.0
"""The workers' --stop-grace: seconds their ranks get between SIGTERM and SIGKILL."""


@dataclass
class Cluster:
    """A coordinator in host 0 (and what it needs to start workers against it)."""

    net: Network
    coordinator: Proc
    env: dict[str, str]
    logdir: Path
    dead_after: float

    @property
    def address(self) -> str:
        return f"{self.net.hosts[0].addr}:{PORT}"

    def worker(self, host: Host, **job_env: str) -> Proc:
        """`axond worker` for a 2-node job of one rank per node running netns_job.py, in `host`."""
        workers = ",".join(h.addr for h in self.net.hosts[1:])
        env = dict(self.env, NETNS_EXPECT_ADDR=host.addr, NETNS_HOST_ADDRS=workers, **job_env)
        argv = [*AXOND, "worker", "--coordinator", self.address, "--token", TOKEN, "--nnodes", "2",
                "--nproc-per-node", "1", "--job", JOB, "--stop-grace", str(STOP_GRACE), "--", sys.executable,
                str(HERE / "netns_job.py")]
        return Proc(host, f"worker{host.index}", argv, env, self.logdir)

    def watch(self, seconds: float) -> Proc:
        """A status poller in host 0 printing node-health and job-state changes (tests/helpers/netns_watch.py)."""
        argv = [sys.executable, str(HERE / "netns_watch.py"), self.address, TOKEN, str(seconds)]
        return Proc(self.net.hosts[0], "watch", argv, self.env, self.logdir)


def start_cluster(net: Network, tmp_path: Path, heartbeat: float = 1.0, missed: int = 5) -> Cluster:
    env = base_env(tmp_path / "home")
    h0 = net.hosts[0]
    argv = [*AXOND, "coordinator", "--host", h0.addr, "--port", str(PORT), "--token", TOKEN,
            "--heartbeat-interval", str(heartbeat), "--dead-after-missed", str(missed)]
    coordinator = Proc(h0, "coordinator", argv, env, tmp_path)
    coordinator.wait_for("listening on", timeout=20)
    return Cluster(net, coordinator, env, tmp_path, heartbeat * missed)


def node_of(worker: Proc) -> str:
    """The coordinator's id of the worker's node, from its rank's NETNS-READY line."""
    m = re.search(r"NETNS-READY rank=\d+ node=(\S+)", worker.text())
    assert m, worker.text()
    return m.group(1)


def dead_at(watch: Proc, node: str, timeout: float) -> float:
    """Wall time at which the coordinator reported `node` dead (as seen by the status poller)."""
    watch.wait_for(f"node={node} ", timeout)
    line = f"node={node} host=\\S+ health=dead"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(rf"NETNS-NODE t=(\S+) {line}", watch.text())
        if m:
            return float(m.group(1))
        time.sleep(0.05)
    pytest.fail(f"the coordinator did not declare node {node} dead within {timeout} s; status changes:\n{watch.text()}")


SERVE = "import socket, sys; l = socket.create_server((sys.argv[1], 29600)); print('up', flush=True)\n" \
        "while True: l.accept()[0].close()"
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 29600), timeout=2).close()"


@pytest.mark.timeout(60)
def test_hosts_have_their_own_address_hostname_and_mtu_and_links_can_be_cut(netns, tmp_path: Path) -> None:
    net = netns(2, mtu=9000)
    h0, h1 = net.hosts
    env = base_env(tmp_path / "home")
    routes = h1.run(["ip", "-4", "route"], env=env).stdout
    assert routes.split() == ["10.213.0.0/24", "dev", "eth0", "proto", "kernel", "scope", "link", "src", h1.addr], \
        routes  # no default route: nothing leaves the namespaces
    assert "mtu 9000" in h1.run(["ip", "link", "show", "eth0"], env=env).stdout
    assert h1.run(["hostname"], env=env).stdout.strip() == "nshost1"
    server = Proc(h0, "server", [sys.executable, "-c", SERVE, h0.addr], env, tmp_path)
    server.wait_for("up", timeout=20)
    connect = [sys.executable, "-c", CONNECT, h0.addr]
    assert h1.run(connect, env=env).returncode == 0
    h1.link_down("host")
    cut = h1.run(connect, env=env)
    assert cut.returncode != 0 and "Network is unreachable" in cut.stderr, cut.stderr
    h1.link_up("host")
    assert h1.run(connect, env=env).returncode == 0
    h0.link_down("switch")
    assert h1.run(connect, env=env).returncode != 0  # frames vanish: the connect times out
    h0.link_up("switch")
    assert h1.run(connect, env=env).returncode == 0
    h0.vanish()
    assert server.popen.poll() is not None
    assert h0.ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mtu", [1500, 9000])
def test_two_node_job_runs_every_collective_across_hosts(netns, tmp_path: Path, mtu: int) -> None:
    net = netns(3, mtu=mtu)
    cluster = start_cluster(net, tmp_path)
    workers = [cluster.worker(h, NETNS_MODE="collectives", NETNS_TIMEOUT="30") for h in net.hosts[1:]]
    for w in workers:
        assert w.wait(60) == 0, w.text()
    h1, h2 = net.hosts[1:]
    for w, mine, other in ((workers[0], h1, h2), (workers[1], h2, h1)):
        out = w.text()
        assert "NETNS-OK" in out, out
        # The rank advertised its host's veth address and its socket runs to the other host's.
        assert re.search(rf"NETNS-ADDR rank=\d advertised={re.escape(mine.addr)} links=\{{\d: "
                         rf"\('{re.escape(mine.addr)}', '{re.escape(other.addr)}'\)\}}", out), out
        assert "127.0.0.1" not in out, out


@pytest.mark.timeout(90)
def test_vanished_worker_host_fails_the_survivor_within_the_group_timeout(netns, tmp_path: Path) -> None:
    group_timeout = 1.5
    net = netns(3)
    cluster = start_cluster(net, tmp_path, heartbeat=0.25, missed=16)  # dead after 4 s: the ranks notice first
    watch = cluster.watch(60)
    h1, h2 = net.hosts[1:]
    survivor, doomed = (cluster.worker(h, NETNS_MODE="loop", NETNS_TIMEOUT=str(group_timeout)) for h in (h1, h2))
    for w in (survivor, doomed):
        w.wait_for("NETNS-READY", timeout=40)
    lost = node_of(doomed)
    t0 = time.time()
    h2.vanish()
    code = survivor.wait(group_timeout + 10)
    took = time.time() - t0
    out = survivor.text()
    assert code != 0, out
    # The survivor's rank raised on the silent peer within its group timeout, and its worker said why.
    assert took < group_timeout + 8, (took, out)
    assert "DistributedError" in out and "timed out" in out, out
    assert f"job '{JOB}' failed" in out, out
    # The coordinator declared the vanished node dead once its heartbeats stopped.
    assert dead_at(watch, lost, timeout=cluster.dead_after + 5) - t0 < cluster.dead_after + 2, watch.text()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("side", ["host", "switch"])
def test_partition_both_sides_stop_within_the_lease(netns, tmp_path: Path, side: str) -> None:
    """A partition (host 2's link down on its own side, or on the switch's): the coordinator declares the cut-off
    node dead when its lease runs out, the job fails and the connected worker stops its ranks; the cut-off worker
    cannot renew its lease, stops its ranks and exits 3 saying so. The ranks' group timeout (60 s) is far longer
    than the lease (2 s), so only the leases can explain both sides stopping within a few leases."""
    group_timeout = 60.0
    net = netns(3)
    cluster = start_cluster(net, tmp_path, heartbeat=0.25, missed=8)
    lease = cluster.dead_after
    watch = cluster.watch(60)
    h1, h2 = net.hosts[1:]
    connected, cut_off = (cluster.worker(h, NETNS_MODE="loop", NETNS_TIMEOUT=str(group_timeout)) for h in (h1, h2))
    for w in (connected, cut_off):
        w.wait_for("NETNS-READY", timeout=40)
    lost = node_of(cut_off)
    t0 = time.time()
    h2.link_down(side)
    assert dead_at(watch, lost, timeout=lease + 5) - t0 < lease + 2, watch.text()
    # The cut-off worker stops its ranks when its lease runs out, gives them the stop grace and the wait for their
    # exits and error files (CAUSE_GRACE_S), and exits; two more leases are room for a busy machine (where this took
    # 7.5 s), still far below the ranks' 60 s group timeout.
    bound = lease + STOP_GRACE + CAUSE_GRACE_S + 2 * lease
    assert connected.wait(bound) != 0, connected.text()
    assert f"job '{JOB}' failed" in connected.text(), connected.text()
    code = cut_off.wait(bound)
    took = time.time() - t0
    out = cut_off.text()
    assert code == 3 and took < bound < group_timeout / 4, (code, took, out)
    assert "lost contact with the coordinator" in out and "lost the coordinator's lease" in out, out


@pytest.mark.timeout(120)
def test_coordinator_kill_9_and_restart_mid_job_disturbs_nothing(netns, tmp_path: Path) -> None:
    """kill -9 of the coordinator while a 2-node job trains, restarted at once from the same state directory:
    the job finishes exit 0 on both workers (a worker that lost contact says so, and that it is back), and the restarted
    coordinator reports it SUCCEEDED (what it restores is tested in detail in test_coordinator_persistence.py)."""
    net = netns(3)
    h0 = net.hosts[0]
    env = base_env(tmp_path / "home")
    argv = [*AXOND, "coordinator", "--host", h0.addr, "--port", str(PORT), "--token", TOKEN,
            "--heartbeat-interval", "0.5", "--dead-after-missed", "12", "--state-dir", str(tmp_path / "state")]
    first = Proc(h0, "coordinator", argv, env, tmp_path)
    first.wait_for("listening on", timeout=20)
    cluster = Cluster(net, first, env, tmp_path, 6.0)
    workers = [cluster.worker(h, NETNS_MODE="train", NETNS_LOOP_SECONDS="10") for h in net.hosts[1:]]
    for w in workers:
        w.wait_for("NETNS-READY", timeout=40)
    first.popen.kill()
    first.popen.wait(10)
    second = Proc(h0, "coordinator2", argv, env, tmp_path)
    second.wait_for("listening on", timeout=20)
    for w in workers:
        assert w.wait(40) == 0, w.text()
        # A heartbeat retried across a short restart never reports a loss; one that did, reports the return.
        assert ("lost contact with the coordinator" in w.text()) <= ("is back" in w.text()), w.text()
        assert "NETNS-DONE" in w.text(), w.text()
    status = h0.run([*AXOND, "status", "--coordinator", cluster.address, "--token", TOKEN, "--all"],
                    env=env, timeout=30)
    assert status.returncode == 0 and "netns  succeeded" in status.stdout, status.stdout + status.stderr
