"""What an unexpected frame says: the text of the error a rank raises when a peer's frame is not the one its call
expects (another op, size, dtype or root; another sequence number; another group; split sizes that disagree), or when
a receive timed out while the peer's sends of other tags wait."""

from __future__ import annotations

from typing import TYPE_CHECKING

from axond.distributed.backends.splits import disagreement
from axond.distributed.backends.tcp.transport.wire import Kind, Op, describe, uneven_back

if TYPE_CHECKING:
    from axond.distributed.backends.tcp.transport.framing import Call


def unexpected(c: Call, peer: int, h: tuple[int, ...], nbytes: int | None, gid: int) -> str:
    """Why header `h` (the 9 fields of a frame header, not an abort) from group rank `peer` does not belong to call
    `c` of the group with id `gid` (`nbytes`: the payload size expected, None: any)."""
    mine = describe(c.op, c.dtype, c.count, c.redop, c.aux)
    if h[0] not in (Kind.COLLECTIVE, Kind.P2P) or h[5] != gid:
        return (f"peer rank {peer} sent a frame that is not from this group (kind {h[0]}, group id {h[5]:#x}); the "
                "stream is out of step")
    theirs = describe(h[1], h[2], h[7], h[3], h[6])
    if h[:4] + h[5:8] == c.expect[:4] + c.expect[5:8] and (nbytes is None or h[8] == nbytes):
        return (f"peer rank {peer} is at operation #{h[4]} but this rank is at #{c.seq} (both in {mine}); a rank "
                "skipped or added a call")
    if theirs == mine and c.op == Op.ALL_TO_ALL and c.aux < 0 and h[4] == c.seq:
        why = disagreement(peer, h[7], c.count, uneven_back(h[6]), uneven_back(c.aux))
        return why or f"peer rank {peer} sent an all_to_all frame this rank did not expect"
    if theirs == mine:
        theirs += f" [frame of {h[8]} bytes, expected {nbytes}]"
    return f"peer rank {peer} called {theirs} but this rank called {mine}"


def unmatched(c: Call, peer: int, early: list[tuple[int, ...]], timeout: float) -> str | None:
    """Why a receive of call `c` from `peer` timed out while sends of other tags from it wait unreceived (the headers
    of its frames set aside, `early`); None when none does."""
    others = [describe(h[1], h[2], h[7], h[3], h[6]) for h in early if h[0] == Kind.P2P]
    if not others:
        return None
    mine = describe(c.op, c.dtype, c.count, c.redop, c.aux)
    return (f"timed out after {timeout:.1f} s waiting for peer rank {peer} to send {mine.replace('recv', 'send', 1)}; "
            f"it sent {', '.join(others[:4])} instead (not received: sends and receives match per tag)")
