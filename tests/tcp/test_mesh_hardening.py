"""Group formation under attack: strangers on a forming rank's listening port cost the group at most one
handshake deadline, and nothing a stranger sends reaches the object collectives' unpickler.

Real thread ranks over loopback; the stranger opens raw sockets to rank 0's published address (the
`addr/0` key of the group's store) before the other members start, the worst case for a rank
that served connections one at a time.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from axond import ProcessGroup
from axond.distributed import BackendOptions, all_gather_object, broadcast_object_list
from axond.distributed.backends.tcp.options import TcpOptions
from axond.distributed.backends.tcp.transport.handshake import ACCEPTED, CHALLENGE, HELLO, MAGIC, MAX_PENDING, REFUSED, Acceptor
from axond.distributed.backends.tcp.transport.mesh import Mesh
from axond.distributed.process_group import create_group
from axond.distributed.backends.tcp.transport.wire import group_id
from axond.store import InMemoryStore
from axond.testing import run_on
from collective_cases import TRANSPORTS

pytestmark = pytest.mark.timeout(90)

HANDSHAKE = 2.0
"""The handshake deadline of these groups."""
MARGIN = 1.5
"""Slack for thread start-up and a loaded machine."""
SECRET = b"0123456789abcdef"
OPTIONS = BackendOptions(timeout=15.0, job_secret=SECRET, tcp=TcpOptions(handshake_timeout=HANDSHAKE))
WORLD = group_id("world")
REFUSED_HELLO = (MAGIC + bytes([REFUSED]), CHALLENGE.size)
"""The answer to a HELLO that does not belong: a CHALLENGE with status REFUSED."""
REFUSED_PROOF = (bytes([REFUSED]), 1)
"""The verdict on a wrong proof."""
Address = tuple[str, int]
Attack = Callable[[Address], None]


def hello(rank: int = 1, size: int = 2, gid: int = WORLD) -> bytes:
    return HELLO.pack(MAGIC, gid, rank, size, os.urandom(16))


class Stranger:
    """The raw connections of one test's attacker, all closed at the end."""

    def __init__(self) -> None:
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()
        self.cut_after: list[float] = []
        """Seconds each dripping connection lasted before the rank closed it."""

    def connect(self, addr: Address) -> socket.socket:
        s = socket.create_connection(addr, timeout=5.0)
        self.socks.append(s)
        return s

    def drip(self, addr: Address, data: bytes, every: float) -> None:
        """Send `data` one byte every `every` seconds on a new connection (on a thread), noting when it is cut."""
        s = self.connect(addr)

        def run() -> None:
            t0 = time.monotonic()
            try:
                for b in data:
                    s.sendall(bytes([b]))
                    if self.stop.wait(every):
                        return
            except OSError:
                self.cut_after.append(time.monotonic() - t0)

        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5.0)
        for s in self.socks:
            s.close()


@pytest.fixture
def stranger() -> Iterator[Stranger]:
    s = Stranger()
    try:
        yield s
    finally:
        s.close()


def dropped(sock: socket.socket, within: float) -> bytes | None:
    """What the rank answered before closing `sock`, or None if it still held it open after `within` seconds."""
    got = bytearray()
    deadline = time.monotonic() + within
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(4096)
            if not chunk:
                return bytes(got)
            got += chunk
    except ConnectionResetError:
        return bytes(got)
    except TimeoutError:
        pass
    return None


def refused(sock: socket.socket, answer: tuple[bytes, int]) -> bool:
    """Whether the rank refused `sock` at once: it answered (first bytes, size) and closed, or reset the connection
    (it closed with our surplus bytes unread, which may discard its answer before we read it)."""
    t0 = time.monotonic()
    got = dropped(sock, HANDSHAKE + MARGIN)
    prefix, size = answer
    return (got is not None and time.monotonic() - t0 < HANDSHAKE / 2
            and (got == b"" or (got.startswith(prefix) and len(got) == size)))


def form(n: int, attack: Attack, options: BackendOptions = OPTIONS,
         late: float = 0.0) -> tuple[list[ProcessGroup], float]:
    """Start rank 0 of a group of `n`, run `attack` on its address, then start the others (after `late` s);
    return the members and the seconds from their start until every member formed."""
    store = InMemoryStore()
    out: list[Any] = [None] * n

    def make(rank: int) -> None:
        try:
            out[rank] = create_group(store, rank, n, "tcp", options)
        except BaseException as e:
            out[rank] = e

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(n)]
    threads[0].start()
    host, _, port = store.get("pg/world/addr/0", 5.0).decode().rpartition(":")
    attack((host, int(port)))
    time.sleep(late)
    t0 = time.monotonic()
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(options.timeout + 5.0)
    took = time.monotonic() - t0
    groups = [g for g in out if isinstance(g, ProcessGroup)]
    if len(groups) < n:
        for g in groups:
            g.destroy()
        raise AssertionError(f"the group did not form: {out}")
    return groups, took


def check_and_destroy(groups: list[ProcessGroup]) -> None:
    """An all_reduce over the formed group gives the right sum; then destroy it."""
    n = len(groups)
    try:
        out = run_on(groups, lambda g: (g.all_reduce(x := np.full(5, g.rank + 1.0)), x)[1], timeout=20.0)
        for x in out:
            np.testing.assert_array_equal(x, np.full(5, n * (n + 1) / 2))
    finally:
        for g in groups:
            g.destroy()


@pytest.mark.parametrize("n", [2, 3])
def test_a_slow_drip_does_not_hold_up_the_group(stranger: Stranger, n: int) -> None:
    groups, took = form(n, lambda addr: stranger.drip(addr, hello(), every=1.0))
    assert took < HANDSHAKE + MARGIN, f"the group took {took:.2f} s to form beside a dripping stranger"
    check_and_destroy(groups)


@pytest.mark.slow  # waits out deadlines or runs many rank processes: the full run, not the quick loop
def test_a_slow_drip_is_cut_at_the_handshake_deadline(stranger: Stranger) -> None:
    """Alone with rank 0 (the member comes later), a connection that keeps sending is still dropped in time."""
    groups, _ = form(2, lambda addr: stranger.drip(addr, hello() + bytes(64), every=0.25), late=HANDSHAKE + MARGIN)
    assert len(stranger.cut_after) == 1 and stranger.cut_after[0] < HANDSHAKE + MARGIN, stranger.cut_after
    check_and_destroy(groups)


def test_junk_is_dropped_and_the_group_forms(stranger: Stranger) -> None:
    answers: list[bool] = []

    def attack(addr: Address) -> None:
        stranger.connect(addr).sendall(b"\x16\x03\x01\x02")  # a TLS record header, then silence
        long = stranger.connect(addr)
        long.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(4096))
        answers.append(refused(long, REFUSED_HELLO))

    groups, took = form(2, attack)
    assert answers == [True]
    assert took < HANDSHAKE + MARGIN, f"the group took {took:.2f} s to form beside a silent stranger"
    check_and_destroy(groups)


def test_wrong_proofs_are_refused_and_the_member_is_served_meanwhile(stranger: Stranger) -> None:
    """One stranger claims rank 1 and sends a wrong proof; another claims rank 1 and never sends its proof."""
    verdicts: list[bool] = []

    def attack(addr: Address) -> None:
        liar = stranger.connect(addr)
        liar.sendall(hello())
        magic, status, _, _ = CHALLENGE.unpack(liar.recv(CHALLENGE.size, socket.MSG_WAITALL))
        assert (magic, status) == (MAGIC, ACCEPTED)
        liar.sendall(os.urandom(32))
        verdicts.append(refused(liar, REFUSED_PROOF))
        stranger.connect(addr).sendall(hello())

    groups, took = form(2, attack)
    assert verdicts == [True]
    assert took < HANDSHAKE + MARGIN, f"the member waited {took:.2f} s behind a stalled claim of its rank"
    check_and_destroy(groups)


@pytest.mark.parametrize("claim", [
    dict(rank=2**31 - 1, size=2**31 - 1), dict(rank=-1), dict(rank=1, size=-5), dict(gid=0xFFFFFFFF),
])
def test_huge_or_negative_declared_counts_are_refused(stranger: Stranger, claim: dict[str, int]) -> None:
    answers: list[bool] = []

    def attack(addr: Address) -> None:
        s = stranger.connect(addr)
        t0 = time.monotonic()
        try:
            s.sendall(hello(**claim) + bytes(1 << 20))
        except (ConnectionResetError, BrokenPipeError):
            # The rank read the hello, refused it and closed with our surplus unread while we still sent it.
            answers.append(time.monotonic() - t0 < HANDSHAKE / 2)
            return
        answers.append(refused(s, REFUSED_HELLO))

    groups, took = form(2, attack)
    assert answers == [True]
    assert took < HANDSHAKE + MARGIN
    check_and_destroy(groups)


def test_many_bogus_connections_do_not_stop_the_group(stranger: Stranger) -> None:
    def attack(addr: Address) -> None:
        for i in range(50):
            s = stranger.connect(addr)
            s.sendall([b"", b"junk", hello()[:20], hello(rank=1)][i % 4])

    groups, took = form(3, attack)
    assert took < HANDSHAKE + MARGIN, f"the group took {took:.2f} s to form beside 50 bogus connections"
    check_and_destroy(groups)


def test_a_flood_beyond_the_bound_is_shed_and_the_group_forms(stranger: Stranger) -> None:
    """More idle connections than a rank holds: the oldest are closed at once, and members still get in."""
    extra = 20
    shed: list[bool] = []

    def attack(addr: Address) -> None:
        socks = [stranger.connect(addr) for _ in range(MAX_PENDING + extra)]
        shed.extend(dropped(s, 1.0) is not None for s in socks[:extra])
        shed.extend(dropped(s, 0.05) is None for s in socks[-8:])

    groups, took = form(2, attack)
    assert all(shed), "the rank held more than MAX_PENDING strangers, or dropped newer ones first"
    assert took < HANDSHAKE + MARGIN
    check_and_destroy(groups)


PWNED: list[str] = []


def pwn(what: str) -> str:
    PWNED.append(what)
    return what


class Evil:
    """Unpickling it calls `pwn`: the detector of bytes that reached an unpickler."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return pwn, ("pwned",)


def test_a_stranger_never_reaches_the_unpickler(stranger: Stranger) -> None:
    """A stranger claims rank 1, fails the proof and sends pickles behind it: the rank drops it unread, the group
    forms with the real member only, its object collectives see none of the stranger's bytes, and once the group
    formed its port is closed. The control: a member's Evil() is unpickled (members are trusted)."""
    payload = pickle.dumps([Evil()]) * 64
    answers: list[bool] = []
    where: list[Address] = []

    def attack(addr: Address) -> None:
        s = stranger.connect(addr)
        s.sendall(hello())
        s.recv(CHALLENGE.size, socket.MSG_WAITALL)
        s.sendall(os.urandom(32) + payload)
        answers.append(refused(s, REFUSED_PROOF))
        where.append(addr)

    PWNED.clear()
    groups, _ = form(2, attack, dataclasses.replace(OPTIONS, tcp=dataclasses.replace(TRANSPORTS["sockets"], handshake_timeout=HANDSHAKE)))
    try:
        assert answers == [True]
        def gather(g: ProcessGroup) -> list[Any]:
            out: list[Any] = [None, None]
            all_gather_object(out, {"rank": g.rank}, group=g)
            return out

        def evil_from_1(g: ProcessGroup) -> list[Any]:
            objs: list[Any] = [Evil() if g.rank == 1 else None]
            broadcast_object_list(objs, 1, group=g)
            return objs

        got = run_on(groups, gather)
        assert got == [[{"rank": 0}, {"rank": 1}]] * 2
        assert PWNED == []
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(where[0], timeout=2.0).close()
        lists = run_on(groups, evil_from_1)
        assert lists[0] == ["pwned"] and PWNED == ["pwned"]
    finally:
        for g in groups:
            g.destroy()


def test_handshake_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="handshake_timeout must be positive"):
        create_group(InMemoryStore(), 0, 2, "tcp", BackendOptions(timeout=1.0, tcp=TcpOptions(handshake_timeout=0.0)))


def test_a_member_cut_off_mid_handshake_connects_again() -> None:
    """Rank 1's first connection is closed after its HELLO (as when a flood pushes it out): it connects again and
    rank 0's acceptor, on the same listener, authenticates the second attempt."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5.0)
    host, port = listener.getsockname()[:2]
    member = Mesh(InMemoryStore(), 1, 2, WORLD, SECRET, "127.0.0.1", 0, 10.0, "member", HANDSHAKE)
    got: list[Any] = []

    def connect() -> None:
        try:
            got.append(member._connect_to(0, host, port, time.monotonic() + 10.0))
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    socks: dict[int, socket.socket] = {}
    try:
        first, _ = listener.accept()
        first.settimeout(5.0)
        first.recv(HELLO.size, socket.MSG_WAITALL)
        first.close()
        Acceptor(listener, SECRET, WORLD, 0, 2, HANDSHAKE).run({1}, socks, time.monotonic() + 10.0, threading.Event())
        t.join(10.0)
        assert list(socks) == [1] and len(got) == 1 and isinstance(got[0], socket.socket), got
    finally:
        listener.close()
        for s in [*socks.values(), *(g for g in got if isinstance(g, socket.socket))]:
            s.close()
