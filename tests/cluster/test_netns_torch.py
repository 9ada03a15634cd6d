"""torch DDP over "axond" between two network-namespace hosts, joined the way a gloo script joins.

Each host runs one rank of tests/helpers/netns_torch.py, which calls `init_process_group("axond",
init_method="tcp://HOST0:PORT")` with no axond variable set: the ranks must advertise their host's
address (the route to the TCP store's host), not loopback, and train to the same parameters as gloo.
Needs root and `ip netns` (skipped otherwise, with the reason) and torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from netns import Proc, base_env, netns  # noqa: F401 - netns is the fixture

pytest.importorskip("torch", reason="torch is not installed: pip install 'axond[torch]'")

pytestmark = pytest.mark.slow  # torch DDP across network-namespace hosts

HERE = Path(__file__).resolve().parents[1] / "helpers"


@pytest.mark.timeout(120)
def test_torch_ddp_across_hosts_advertises_the_hosts_addresses_and_matches_gloo(netns, tmp_path: Path) -> None:
    net = netns(2)
    out = tmp_path / "result"
    ranks = []
    for rank, host in enumerate(net.hosts):
        env = base_env(tmp_path / f"home{rank}", GLOO_SOCKET_IFNAME=host.ifname, OMP_NUM_THREADS="1")
        argv = [sys.executable, str(HERE / "netns_torch.py"), str(rank), "2", net.hosts[0].addr, "29610", str(out)]
        ranks.append(Proc(host, f"rank{rank}", argv, env, tmp_path))
    for r in ranks:
        assert r.popen.wait(100) == 0, r.text()
    results = [json.loads((tmp_path / f"result.{rank}").read_text()) for rank in range(2)]
    for rank, (host, got) in enumerate(zip(net.hosts, results)):
        other = net.hosts[1 - rank]
        assert got["advertised"] == host.addr, got
        assert got["links"] == {str(1 - rank): [host.addr, other.addr]}, got
        assert got["axond"] == got["gloo"], f"rank {rank}: DDP over axond and over gloo trained different parameters"
    assert results[0]["axond"] == results[1]["axond"], "the replicas drifted apart"
