"""A flapping link between two network-namespace hosts: the data plane resumes soon after the link is steady.

While a link drops packets, TCP doubles the wait before each retransmission (up to 120 s), so once the link is steady
the next retransmission, and all traffic with it, can be far away; the tcp backend caps that wait on its sockets
(AXOND_TCP_RTO_MAX_MS). Needs root and `ip netns` (skipped otherwise, with the reason); bench/flap.py measures more.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from axond.distributed.backends.tcp.transport.sockets import RTO_MAX_MS
from axond.testing.flap import run_flap
from axond.testing.netns import Network
from netns import netns  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_traffic_resumes_within_the_retransmission_cap_after_a_flapping_link_is_steady(
        netns: Callable[..., Network]) -> None:
    net = netns(n_hosts=2)
    # The next retransmission comes at most RTO_MAX_MS after the link is steady. The congestion window then grows
    # back from one segment, from a slow-start threshold that the losses cut to a few segments, so the 256 KiB the
    # step still has to move may take a few more round trips of retransmission and growth (up to 2 s on a busy
    # 2-core machine: bench/results/2026-12-06-flap.md). 4 x RTO_MAX_MS stays below what this guards against, the
    # kernel's own backoff (24 s measured there). Cubic: BBR, the kernel's default here, can pace at the few kbit/s
    # a lossy spell leaves it measuring for seconds more (docs/fault-tolerance.md#a-flapping-link): the congestion
    # control's doing, not that of the retransmissions this test is about.
    bound = 4 * RTO_MAX_MS / 1000
    result = run_flap(net, flap_s=12.0, drop_s=2.0, pass_s=0.2, after_s=1.0, rto_max_ms=RTO_MAX_MS, timeout_s=60.0,
                      watch_s=bound, congestion="cubic")
    assert result.error is None, result.error  # every result exact on both ranks (a wrong one exits 2)
    assert result.ops > 0
    assert result.stall_after_steady <= bound, f"traffic resumed {result.stall_after_steady:.2f} s after the link " \
                                               f"was steady (bound {bound:.1f} s): {result}\n{result.sockets}"


@pytest.mark.timeout(120)
def test_a_timeout_on_a_link_that_drops_every_packet_says_the_network_drops_them(
        netns: Callable[..., Network]) -> None:
    net = netns(n_hosts=2)
    result = run_flap(net, flap_s=6.0, drop_s=6.0, pass_s=0.0, after_s=0.0, timeout_s=3.0)  # twice the timeout
    assert result.error is not None and "timed out after 3.0 s waiting for peer" in result.error, result
    # The hint needs bytes in flight when the wait ends: a drop that began between two ops leaves none to
    # retransmit, and the message then says what the peer is blocked in instead.
    assert ("the link to it is retransmitting" in result.error and "the network between the hosts drops packets"
            in result.error) or "is blocked in all_reduce" in result.error, result.error
