"""Live recovery through a link cut between two nodes that both keep their leases (a partial partition): a coordinator
and four `axond worker --live-recovery --nnodes 2:4` hosts in their own network namespaces, one rank each,
DistributedTrainer (ddp, four virtual ranks). Every rank waits at the boundary after step 20 while iptables in the
hosts of ranks 1 and 2 drops every packet between their two addresses, both ways (the coordinator stays reachable from
all: nobody's lease runs out); then they go on. The collective stalls until the group's timeout (set small here), the
workers of both ends find the other unreachable and report it, the coordinator goes on without the end with the higher
node rank (rank 2's node), and the three others re-form live in the same processes: one re-formation, every step's
parameters bit for bit those of an uninterrupted run.

Needs root, `ip netns` and iptables (skipped otherwise, with the reason); the rules live in the test's namespaces.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from axond.fencing import PROBE_TIMEOUT_S, fence_wait
from axond.testing import run_threads
from axond.testing.netns import Host, Network
from live_train import Hashes, build_trainer
from netns import Proc, netns  # noqa: F401 - netns is the fixture
from netns_live import start_live_job
from axond.worker.linkcheck import RECHECK_S

pytestmark = pytest.mark.slow  # a job across five network-namespace hosts (real coordinator and workers)

HEARTBEAT_S, MISSED, FENCE_MARGIN_S = 0.25, 6, 0.5
LEASE_S = HEARTBEAT_S * MISSED
GROUP_TIMEOUT_S = 3.0
"""The default group's timeout in every rank: what bounds the detection of a cut link between nodes that keep their
leases (the collective between them stalls until then)."""
REJOIN_GROUP_TIMEOUT_S = 8.0
"""With a node joining back: it also bounds the survivors' wait, in the re-formed group's forming, for the new rank's
interpreter to start."""
DETECT_S = 2 * PROBE_TIMEOUT_S + HEARTBEAT_S + 1.0
"""Beyond the group's timeout: the worker's two probes of the silent peer, the survivors' next (nudged) heartbeat and
the rank's note (`WATCH_S`, `POLL_S`), with room for the report and a busy machine."""
CUT_STEP, JOIN_STEP, STEPS = 20, 24, 45
"""Every rank waits after step 20 while the link is cut; 240 samples over 4 virtual ranks at batch 4: 45 steps. With
restarts left, the three survivors wait after step 24 for the evicted node's return."""


def need_iptables() -> None:
    if shutil.which("iptables") is None:
        pytest.skip("iptables is not installed (apt-get install iptables)")


def private_tmp(tmp_path: Path) -> str:
    """A TMPDIR of the test's own for every process (the workers' membership notes live there)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return str(tmp_path / "tmp")


def cut(a: Host, b: Host) -> None:
    """Drop every packet between the addresses of hosts `a` and `b`, both ways, in both hosts' own namespaces."""
    for host, other in ((a, b), (b, a)):
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            subprocess.run(["ip", "netns", "exec", host.ns, "iptables", "-A", chain, flag, other.addr, "-j", "DROP"],
                           check=True, capture_output=True, timeout=20)


def started(net: Network, out: Path) -> dict[int, tuple[int, Host]]:
    """Rank -> (pid, host) of the first processes."""
    ranks = {}
    for f in out.glob("start-*"):
        _, rank, pid = f.name.split("-")
        ranks[int(rank)] = (int(pid), next(h for h in net.hosts if int(pid) in h.pids()))
    return ranks


@pytest.mark.timeout(180)
def test_a_link_cut_between_two_live_nodes_leaves_out_the_higher_one_and_the_rest_go_on_bit_identical(
        netns, tmp_path: Path) -> None:
    need_iptables()
    net = netns(5)
    job = start_live_job(net, tmp_path, "live", CUT_STEP, HEARTBEAT_S, MISSED, FENCE_MARGIN_S, nnodes="2:4",
                         LIVE_TEST_GROUP_TIMEOUT_S=str(GROUP_TIMEOUT_S), LIVE_TEST_HANG_RANKS="0,1,2,3",
                         LIVE_TEST_START_TOGETHER="1", TMPDIR=private_tmp(tmp_path))
    out = job.out
    deadline = time.monotonic() + 90
    while len(list(out.glob("hang-*"))) < 4:  # every rank at the boundary after step 20: no collective in flight
        assert time.monotonic() < deadline, [w.text()[-2000:] for w in job.workers]
        time.sleep(0.02)
    ranks = started(net, out)
    cut(ranks[1][1], ranks[2][1])
    went = time.monotonic()
    (out / "go").write_text("")

    evicted = next(w for w in job.workers if w.host is ranks[2][1])
    survivors = [w for w in job.workers if w is not evicted]
    codes = [w.wait(90) for w in survivors]
    assert codes == [0, 0, 0], [w.text()[-2500:] for w in job.workers]
    assert evicted.wait(30) != 0, evicted.text()[-2500:]
    said = evicted.text()
    # the evicted side names the unreachable node, and its rank's failed collective: op, group, peer
    assert "cannot reach node rank 1" in said and "goes on without this node" in said, said[-2500:]
    assert "on group 'world'" in said and "peer" in said, said[-2500:]
    # the other end reports too unless the decision came first (either report decides the same)
    kept = next(w for w in survivors if w.host is ranks[1][1])
    assert "re-forms live as generation 2" in kept.text(), kept.text()[-2500:]
    assert not Path(f"/proc/{ranks[2][0]}").exists()

    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference] if g.rank == 0 else [], virtual_ranks=4).fit(3), 1, 120.0)
    assert len(reference.hashes) == STEPS
    ends = [json.loads(p.read_text()) for p in out.glob("end-*.json")]
    assert sorted(e["pid"] for e in ends) == sorted(ranks[r][0] for r in (0, 1, 3))  # the same processes
    assert len(list(out.glob("start-*"))) == 4  # no process started again
    fence = LEASE_S + fence_wait(LEASE_S, HEARTBEAT_S, FENCE_MARGIN_S)  # the evicted node's lease, then the fence
    print("link cut: survivors' error, re-formed (s after the cut):",
          [(round(e["recoveries"][0]["error_at"] - went, 2), round(e["recoveries"][0]["reformed_at"] - went, 2))
           for e in ends])
    for end in ends:
        assert end["world"] == 3 and end["generation"] == "2", end  # one re-formation: no ping-pong
        (recovery,) = end["recoveries"]
        assert (recovery["world_before"], recovery["world_after"]) == (4, 3), recovery
        assert "cannot reach" in recovery["reason"] and ranks[2][1].hostname in recovery["reason"], recovery
        # the stalled collective ended by the group's timeout, not by a lease (no one lost it)
        assert recovery["error_at"] - went < GROUP_TIMEOUT_S + DETECT_S, (recovery, went)
        assert recovery["reformed_at"] - went < GROUP_TIMEOUT_S + DETECT_S + fence + 2.0, (recovery, went)
        log = [json.loads(line) for line in (out / f"steps-{end['pid']}.jsonl").read_text().splitlines()]
        assert [s["step"] for s in log] == list(range(1, STEPS + 1))
        assert [s["hash"] for s in log] == reference.hashes  # every step's parameters, bit for bit


def heal(a: Host, b: Host) -> None:
    """Remove the rules `cut` added."""
    for host in (a, b):
        subprocess.run(["ip", "netns", "exec", host.ns, "iptables", "-F"], check=True, capture_output=True, timeout=20)


@pytest.mark.timeout(180)
def test_with_restarts_left_the_evicted_node_re_joins_only_once_its_link_works_again(netns, tmp_path: Path) -> None:
    need_iptables()
    net = netns(5)
    job = start_live_job(net, tmp_path, "live", CUT_STEP, HEARTBEAT_S, MISSED, FENCE_MARGIN_S, ("--max-restarts", "1"),
                         nnodes="2:4", LIVE_TEST_GROUP_TIMEOUT_S=str(REJOIN_GROUP_TIMEOUT_S),
                         LIVE_TEST_HANG_RANKS="0,1,2,3", LIVE_TEST_START_TOGETHER="1",
                         LIVE_TEST_WAIT_JOIN=f"{JOIN_STEP}:4",
                         TMPDIR=private_tmp(tmp_path))
    out = job.out
    deadline = time.monotonic() + 90
    while len(list(out.glob("hang-*"))) < 4:
        assert time.monotonic() < deadline, [w.text()[-2000:] for w in job.workers]
        time.sleep(0.02)
    ranks = started(net, out)
    cut(ranks[1][1], ranks[2][1])
    (out / "go").write_text("")
    evicted = next(w for w in job.workers if w.host is ranks[2][1])
    evicted.wait_for("to answer again before re-joining", timeout=60)
    time.sleep(4 * RECHECK_S)  # several probes while the link is still cut: no re-join (no new process)
    assert len(list(out.glob("start-*"))) == 4 and evicted.popen.poll() is None, evicted.text()[-2500:]
    heal(ranks[1][1], ranks[2][1])
    codes = [w.wait(90) for w in job.workers]
    assert codes == [0, 0, 0, 0], [w.text()[-2500:] for w in job.workers]
    assert "re-joined after its rank failed: one restart counted" in evicted.text(), evicted.text()[-2500:]

    reference = Hashes()
    run_threads(lambda g: build_trainer(g, [reference], virtual_ranks=4).fit(3), 1, 120.0)
    ends = {e["pid"]: e for e in (json.loads(p.read_text()) for p in out.glob("end-*.json"))}
    assert len(ends) == 4 and all(e["world"] == 4 for e in ends.values())
    assert len(list(out.glob("start-*"))) == 5  # the survivors kept their processes; one new in the evicted host
    kept = {ranks[r][0] for r in (0, 1, 3)}
    assert kept < set(ends)
    for pid, end in ends.items():
        log = [json.loads(line) for line in (out / f"steps-{pid}.jsonl").read_text().splitlines()]
        first = 1 if pid in kept else JOIN_STEP + 1
        assert [s["step"] for s in log] == list(range(first, STEPS + 1))
        assert [s["hash"] for s in log] == reference.hashes[first - 1:]  # every step's parameters, bit for bit
        if pid in kept:
            moves = [(r["world_before"], r["world_after"], r["step"]) for r in end["recoveries"]]
            assert moves == [(4, 3, CUT_STEP), (3, 4, JOIN_STEP)], moves  # one eviction, one return: no ping-pong
