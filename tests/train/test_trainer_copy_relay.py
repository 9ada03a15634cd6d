"""Buddy copies through the workers (`axond.worker.copy_forward`, `axond.worker.buddy_relay`, `axond.train.relay`): a
rank's copy in its worker's memory is sent, on the rank's request, by that worker's forwarder to a real relay on
loopback, kept in the node's held memory and read back by a rank of that node, double-buffered and tagged; a caller
without the job's secret, or with a request that does not fit together, has nothing kept; a copy cut half-way, or
said torn by its sender, is never offered."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from axond import nn
from axond.copy_layout import (ACK, AUTH_CONTEXT, NONCE_BYTES, REFUSED_MALFORMED, REFUSED_TORN, RELAY_MAGIC, REQUEST,
                               VERDICT)
from axond.distributed import ProcessGroup
from axond.nn.optim import AdamW
from axond.parallel.zero.virtual import VirtualZero
from axond.train.daemon_copy import DaemonCopy
from axond.train.relay import RelayedCopies, address_words, held_slots, words_address
from axond.worker.buddy_relay import BuddyRelay
from axond.worker.copy_forward import Forwarder, RelayClient, split_address

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")
SECRET = b"s" * 16


@pytest.fixture
def relay() -> Iterator[BuddyRelay]:
    r = BuddyRelay("127.0.0.1")
    r.admit(SECRET)
    yield r
    r.close()


@pytest.fixture
def fd() -> Iterator[int]:
    fd = os.memfd_create("axond-test-shards")
    yield fd
    os.close(fd)


def _zero(seed: int = 1, virtual: int = 3) -> VirtualZero:
    rng = np.random.default_rng(seed)
    params = list(nn.Sequential(nn.Linear(5, 9, rng=rng), nn.Linear(9, 4, rng=rng)).parameters())
    return VirtualZero(params, AdamW, ProcessGroup.mock(), virtual, lr=0.05)


def _step(zero: VirtualZero, step: int) -> None:
    rng = np.random.default_rng(100 + step)
    for p in zero.params:
        p.grad = rng.standard_normal(p.shape).astype(np.float32)
    zero.step()


def _packed(zero: VirtualZero) -> tuple[np.ndarray, np.ndarray]:
    rows_shape, scalars_shape = zero.rows_shape(len(zero.mine))
    rows, scalars = np.empty(rows_shape, zero.flat.dtype), np.empty(scalars_shape)
    for i, v in enumerate(zero.mine):
        zero.pack(v, rows[i], scalars[i])
    return rows, scalars


def _sender(fd: int, zero: VirtualZero, relay: BuddyRelay, local_rank: int = 0,
            secret: bytes = SECRET) -> DaemonCopy:
    """A rank's `DaemonCopy` on `fd`, and its worker's forwarder (closed with the copy) sending to `relay`."""
    forwarder = Forwarder(fd, local_rank, 0x5EED, lambda: secret)
    daemon = DaemonCopy(fd, zero)
    RelayedCopies(daemon, relay.held.fd, forwarder.write_fd, lambda: 0).target(relay.address)
    close = daemon.close

    def closing() -> None:
        close()
        forwarder.close()

    daemon.close = closing  # type: ignore[method-assign]
    return daemon


def test_a_relayed_copy_is_kept_in_the_nodes_held_memory_and_read_back_double_buffered(fd: int,
                                                                                       relay: BuddyRelay) -> None:
    zero = _zero()
    daemon = _sender(fd, zero, relay)
    snapshots: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for step in (1, 2, 3):
        _step(zero, step)
        daemon.post(lineage=0)
        work = daemon.forward(zero.tag)
        assert work is not None and work.result(timeout=30) == step
        snapshots[step] = _packed(zero)
    reader = _zero(seed=2)  # a rank of the buddy's node: another process, the same layout
    found = sorted(held_slots(relay.held.fd, reader, 0), key=lambda f: f[0])
    assert [(tag, shards) for tag, _, shards in found] == [(2, range(0, 3)), (3, range(0, 3))]  # two slots
    for tag, slot, _ in found:
        rows, scalars = snapshots[tag]
        assert np.array_equal(slot.rows, rows) and np.array_equal(slot.scalars, scalars) and slot.tag == tag
    assert held_slots(relay.held.fd, reader, 1) == []  # another lineage (after a fall-back): never offered
    assert held_slots(relay.held.fd, _zero(virtual=2), 0) == []  # another layout
    assert relay.kept == 3
    daemon.close()


def test_two_sources_get_a_region_each_and_a_new_layout_replaces_a_sources_region(relay: BuddyRelay) -> None:
    fds = [os.memfd_create("a"), os.memfd_create("b")]
    try:
        zeros = [_zero(), _zero(seed=3)]
        daemons = [_sender(f, z, relay, local_rank=i) for i, (f, z) in enumerate(zip(fds, zeros))]
        for z, d in zip(zeros, daemons):
            _step(z, 1)
            d.post(lineage=0)
            assert d.forward(1).result(timeout=30) == 1  # type: ignore[union-attr]
        assert len(held_slots(relay.held.fd, zeros[0], 0)) == 2
        bigger = _zero(virtual=2)  # another geometry from the second source: a new region for it, in the same key
        daemons[1].close()
        d2 = _sender(fds[1], bigger, relay, local_rank=1)
        _step(bigger, 1)
        d2.post(lineage=0)
        assert d2.forward(1).result(timeout=30) == 1  # type: ignore[union-attr]
        assert len(held_slots(relay.held.fd, zeros[0], 0)) == 1 and len(held_slots(relay.held.fd, bigger, 0)) == 1
        d2.close()
        daemons[0].close()
    finally:
        for f in fds:
            os.close(f)


def test_a_caller_without_the_jobs_secret_has_nothing_kept(fd: int, relay: BuddyRelay) -> None:
    zero = _zero()
    daemon = _sender(fd, zero, relay, secret=b"x" * 16)
    _step(zero, 1)
    daemon.post(lineage=0)
    with pytest.raises(ValueError, match="the worker could not send it"):  # its worker's log says: secret refused
        daemon.forward(1).result(timeout=30)  # type: ignore[union-attr]
    assert relay.kept == 0 and held_slots(relay.held.fd, zero, 0) == []
    with socket.create_connection(split_address(relay.address), timeout=10) as raw:  # a stranger, no proof at all
        raw.recv(NONCE_BYTES)
        raw.sendall(REQUEST.pack(RELAY_MAGIC, 1, 0, 0, 1, 0, 3, 0, 3, 2, 1 << 20) + b"\0" * 4096)
        assert raw.recv(1) == b"\x00"  # its first bytes taken as a proof, refused, and the connection closed
        try:
            assert raw.recv(16) == b""
        except ConnectionResetError:  # the rest of what it sent was never read
            pass
    assert relay.kept == 0 and os.fstat(relay.held.fd).st_size == 4096  # nothing sized for it either
    daemon.close()


def _proven(relay: BuddyRelay) -> socket.socket:
    sock = socket.create_connection(split_address(relay.address), timeout=10)
    nonce = sock.recv(NONCE_BYTES)
    sock.sendall(hmac.new(SECRET, AUTH_CONTEXT + nonce, hashlib.sha256).digest())
    assert sock.recv(1) == b"\x01"
    return sock


@pytest.mark.parametrize("fields", [
    (0xBAD, 1, 0, 7, 1, 0, 3, 0, 3, 2, 4096),  # not the relay's magic
    (RELAY_MAGIC, 1, 0, 7, 1, 0, 0, 0, 3, 2, 4096),  # no shards
    (RELAY_MAGIC, 1, 0, 7, 1, 0, 3, 0, 3, 2, 8),  # a payload smaller than its own scalars
    (RELAY_MAGIC, 1, 0, 7, -5, 0, 3, 0, 3, 2, 4096),  # a negative step
])
def test_a_request_whose_fields_do_not_fit_is_refused_and_the_relay_goes_on(relay: BuddyRelay,
                                                                            fields: tuple[int, ...]) -> None:
    with _proven(relay) as sock:
        sock.sendall(REQUEST.pack(*fields))
        (answer,) = ACK.unpack(sock.recv(ACK.size))
        assert answer == REFUSED_MALFORMED and sock.recv(1) == b""
    assert relay.kept == 0 and os.fstat(relay.held.fd).st_size == 4096
    with _proven(relay):  # still serving
        pass


def test_a_copy_its_sender_says_torn_is_never_kept_and_the_connection_goes_on(fd: int, relay: BuddyRelay) -> None:
    zero = _zero()
    _step(zero, 1)
    rows_shape, scalars_shape = zero.rows_shape(len(zero.mine))
    need = int(np.prod(rows_shape)) * 4 + int(np.prod(scalars_shape)) * 8
    request = REQUEST.pack(RELAY_MAGIC, 0x5EED, 0, _fingerprint(zero), 1, 0, 3, 0, rows_shape[1], scalars_shape[1],
                           need)
    with _proven(relay) as sock:
        sock.sendall(request + b"\1" * need + VERDICT.pack(-1))  # the slot changed while it was read
        assert ACK.unpack(sock.recv(ACK.size)) == (REFUSED_TORN,)
        assert relay.kept == 0 and _tags(relay, zero) == []
        sock.sendall(request + b"\1" * need + VERDICT.pack(1))  # the next one on the same connection is kept
        assert ACK.unpack(sock.recv(ACK.size)) == (1,)
    assert relay.kept == 1


def test_a_copy_cut_half_way_is_never_offered(fd: int, relay: BuddyRelay) -> None:
    zero = _zero()
    daemon = _sender(fd, zero, relay)
    _step(zero, 1)
    daemon.post(lineage=0)
    assert daemon.forward(1).result(timeout=30) == 1  # type: ignore[union-attr]
    _step(zero, 2)
    daemon.post(lineage=0)
    daemon.settle()
    rows_shape, scalars_shape = zero.rows_shape(len(zero.mine))
    need = int(np.prod(rows_shape)) * 4 + int(np.prod(scalars_shape)) * 8
    with _proven(relay) as sock:  # the same source, step 2's copy cut after half its bytes
        sock.sendall(REQUEST.pack(RELAY_MAGIC, 0x5EED, 0, _fingerprint(zero), 2, 0, 3, 0, rows_shape[1],
                                  scalars_shape[1], need) + b"\1" * (need // 2))
    _wait(lambda: relay.kept == 1 and _tags(relay, zero) == [1])
    assert _tags(relay, zero) == [1]  # step 1's copy intact, the cut one never offered
    daemon.close()


def _fingerprint(zero: VirtualZero) -> int:
    from axond.train.daemon_copy import fingerprint

    return fingerprint(zero)


def _tags(relay: BuddyRelay, zero: VirtualZero) -> list[int]:
    return sorted(tag for tag, _, _ in held_slots(relay.held.fd, zero, 0))


def _wait(ok: object, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not ok() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_addresses_go_through_the_gather_as_words() -> None:
    for address in ("127.0.0.1:29500", "[fd00::1]:4000", None):
        assert words_address(address_words(address)) == address
    assert split_address("[fd00::1]:4000") == ("fd00::1", 4000)
    with pytest.raises(ValueError, match="longer than"):
        address_words("h" * 70)
    assert RelayClient("127.0.0.1:1", SECRET, 1, 0, 1.0).sent == 0
    with pytest.raises(ValueError, match="host:port"):
        split_address("nowhere")


def test_strangers_hold_no_more_than_the_unproven_connections_and_go_at_their_deadline(relay: BuddyRelay) -> None:
    """MAX_UNPROVEN connections that prove nothing: the next is closed at once (no nonce); once they are gone a rank's
    connection proves the secret as before."""
    from axond.worker.buddy_relay import MAX_UNPROVEN

    strangers = [socket.create_connection(split_address(relay.address), timeout=10) for _ in range(MAX_UNPROVEN)]
    try:
        for s in strangers:
            assert len(s.recv(NONCE_BYTES)) == NONCE_BYTES  # each was taken in, and waits for its proof
        with socket.create_connection(split_address(relay.address), timeout=10) as late:
            try:
                assert late.recv(NONCE_BYTES) == b""  # over the bound: closed without a word
            except ConnectionResetError:
                pass
    finally:
        for s in strangers:
            s.close()
    _wait(lambda: _proven_ok(relay))
    assert _proven_ok(relay)


def _proven_ok(relay: BuddyRelay) -> bool:
    try:
        with _proven(relay):
            return True
    except (AssertionError, OSError):
        return False


def test_a_copy_the_buddys_worker_did_not_keep_is_counted_and_said_never_raised(fd: int) -> None:
    """The buddy's relay is gone: the worker cannot send; the rank's wait ends with the copy counted as unsent and a
    RuntimeWarning, and training is not interrupted (its own state is whole)."""
    from axond.train.buddy import BuddyCopies

    gone = BuddyRelay("127.0.0.1")
    gone.close()
    zero = _zero()
    daemon = _sender(fd, zero, gone)
    copies = BuddyCopies(zero, 1)
    copies.place(ProcessGroup.mock(), [0])
    copies.relayed = RelayedCopies(daemon, os.memfd_create("held"), daemon.forward_fd or -1, lambda: 0)
    copies.buddy = 0  # a buddy on the relay that is gone
    _step(zero, 1)
    daemon.post(lineage=0)
    copies.post()
    with pytest.warns(RuntimeWarning, match="buddy copy of step 1 was not kept"):
        copies.settle()
    assert copies.unsent == 1 and "could not send" in copies.why_unsent
    daemon.close()


def test_a_send_stalled_on_a_lost_buddys_link_is_given_up_at_the_next_request(fd: int, relay: BuddyRelay) -> None:
    """The buddy's link stalls (its relay took the proof, then reads nothing more and never answers): the worker's
    send waits, and the rank's next request (to the next generation's buddy) ends it at once rather than after the
    send timeout (`SEND_TIMEOUT_S`)."""
    import threading
    import time

    from axond.worker.copy_forward import SEND_TIMEOUT_S

    stalled = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def take_proof_then_stall() -> None:
        conn, _ = stalled.accept()
        held.append(conn)
        conn.sendall(b"n" * NONCE_BYTES)
        conn.recv(64)
        conn.sendall(b"\x01")  # in; then nothing is read or answered

    threading.Thread(target=take_proof_then_stall, daemon=True).start()
    zero = _zero()
    daemon = _sender(fd, zero, relay)
    daemon.forward_to = f"127.0.0.1:{stalled.getsockname()[1]}"
    _step(zero, 1)
    daemon.post(lineage=0)
    first = daemon.forward(1)
    assert first is not None
    with pytest.raises(TimeoutError):
        first.result(timeout=0.5)  # stalled
    daemon.forward_to = relay.address  # the next generation's buddy
    _step(zero, 2)
    daemon.post(lineage=0)
    began = time.monotonic()
    second = daemon.forward(2)
    assert second is not None and second.result(timeout=SEND_TIMEOUT_S) == 2
    assert time.monotonic() - began < SEND_TIMEOUT_S / 2  # not after the stalled send's timeout
    daemon.close()
    stalled.close()
    for conn in held:
        conn.close()
