"""The tcp backend's route policy and options: one call answers which path and schedule any op takes, every
knob is a field of `TcpOptions` read from the environment in one place, and the documented table matches it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from axond.distributed import BackendOptions
from axond.distributed.backends.tcp import TcpOptions
from axond.distributed.backends.tcp.options import AUTO, ENVIRONMENT, NOT_FROM_ENV
from axond.distributed.backends.tcp.policy import ORDERED_STORES, Path as P, Shape, candidates, route
from axond.distributed.backends.tcp.transport.wire import Op
from axond.testing import node_hosts, run_on, thread_groups

KiB, MiB = 1 << 10, 1 << 20
ONE_HOST = Shape(4)
CROWDED = Shape(4, oversubscribed=True)
PAIR = Shape(2)
SPREAD = Shape(4, hosts=2, per_host=2)
UNEVEN = Shape(3, hosts=2, per_host=0, largest_host=2)
SOCKETS = TcpOptions(shm=False)
NO_MAILBOX = TcpOptions(shm_mailbox=False)
ARENA = TcpOptions(shm_single_copy=False)

ROUTES = [
    # op, bytes per rank, group, options -> route
    (Op.ALL_REDUCE, 8, ONE_HOST, None, "mailbox"),
    (Op.ALL_REDUCE, 256 * KiB, ONE_HOST, None, "mailbox"),  # up to 256 KiB per rank in groups of up to 5
    (Op.ALL_REDUCE, 256 * KiB + 8, ONE_HOST, None, "arena"),
    (Op.ALL_REDUCE, 128 * KiB, Shape(11), None, "mailbox"),  # larger groups: smaller slots (mailbox_bytes)
    (Op.ALL_REDUCE, 128 * KiB + 8, Shape(11), None, "arena"),
    (Op.ALL_REDUCE, 20 * KiB, Shape(64), None, "mailbox"),
    (Op.ALL_REDUCE, 20 * KiB + 8, Shape(64), None, "arena"),
    (Op.ALL_REDUCE, 4 * KiB + 8, Shape(256), None, "sockets:doubling"),  # 4 KiB slots; arena from 2 x 4 KiB
    (Op.ALL_REDUCE, 1 * MiB, ONE_HOST, None, "arena"),
    (Op.ALL_REDUCE, 8 * KiB, ONE_HOST, NO_MAILBOX, "sockets:doubling"),  # arena from 2 x 64 KiB without it
    (Op.ALL_REDUCE, 128 * KiB, ONE_HOST, NO_MAILBOX, "arena"),
    (Op.ALL_REDUCE, 1 * MiB, ONE_HOST, SOCKETS, "sockets:ring"),
    (Op.ALL_REDUCE, 1 * MiB, CROWDED, SOCKETS, "sockets:halving_doubling"),
    (Op.ALL_REDUCE, 200 * KiB, CROWDED, SOCKETS, "sockets:doubling"),
    (Op.ALL_REDUCE, 8 * MiB, CROWDED, SOCKETS, "sockets:ring"),
    (Op.ALL_REDUCE, 1 * MiB, PAIR, SOCKETS, "sockets:doubling"),  # two ranks: one round up to 1 MiB
    (Op.ALL_REDUCE, 1 * MiB + 8, PAIR, SOCKETS, "sockets:ring"),
    (Op.ALL_REDUCE, 1 * MiB, PAIR, TcpOptions(shm=False, algorithm="ring"), "sockets:ring"),
    (Op.ALL_REDUCE, 1 * MiB, Shape(4, hosts=4, per_host=1), None, "sockets:ring"),  # one rank per host
    (Op.ALL_REDUCE, 64 * KiB, SPREAD, None, "two_level"),  # two per host: from 1 x 64 KiB
    (Op.ALL_REDUCE, 128 * KiB, UNEVEN, None, "two_level"),  # hosts of 2 and 1: through the leaders, from 2 x 64 KiB
    (Op.ALL_REDUCE, 128 * KiB - 8, UNEVEN, None, "sockets:doubling"),
    (Op.BROADCAST, 256 * KiB, UNEVEN, None, "two_level"),  # 4 x 64 KiB
    (Op.BROADCAST, 256 * KiB - 8, UNEVEN, None, "sockets:chain"),
    (Op.BROADCAST, 1 * MiB, dataclasses.replace(UNEVEN, oversubscribed=True), None, "two_level"),  # 4 x 256 KiB
    (Op.ALL_REDUCE, 512 * KiB - 8, dataclasses.replace(UNEVEN, oversubscribed=True), None, "sockets:ring"),
    (Op.ALL_GATHER, 4 * MiB, UNEVEN, None, "sockets:ring"),  # blocks per host of different sizes: sockets
    (Op.REDUCE_SCATTER, 1 * MiB, UNEVEN, None, "sockets:ring"),
    (Op.ALL_REDUCE, 1 * MiB, Shape(3, hosts=3, per_host=1, largest_host=1), None, "sockets:ring"),
    (Op.ALL_REDUCE, 64 * KiB - 8, SPREAD, None, "sockets:doubling"),
    (Op.ALL_REDUCE, 64 * KiB, Shape(6, hosts=2, per_host=3), None, "sockets:doubling"),  # three per host: 2 x 64 KiB
    (Op.ALL_REDUCE, 128 * KiB, Shape(6, hosts=2, per_host=3), None, "two_level"),
    (Op.ALL_REDUCE, 1 * MiB, Shape(6, hosts=3, per_host=0), None, "sockets:ring"),  # uneven hosts
    (Op.ALL_REDUCE, 1 * MiB, Shape(4, hosts=0), None, "sockets:ring"),  # members' arena sizes differ
    (Op.BROADCAST, 4 * KiB, ONE_HOST, None, "mailbox"),
    (Op.BROADCAST, 4 * KiB, CROWDED, None, "mailbox"),
    (Op.BROADCAST, 256 * KiB, CROWDED, None, "mailbox"),
    (Op.BROADCAST, 256 * KiB + 8, CROWDED, None, "mailbox"),  # past a slot: in chunks of a slot
    (Op.BROADCAST, 6 * MiB, CROWDED, None, "mailbox"),  # up to 24 slots
    (Op.BROADCAST, 6 * MiB + 8, CROWDED, None, "arena"),  # past the mailbox (and 16 x 4 KiB)
    (Op.BROADCAST, 6 * MiB, ONE_HOST, None, "mailbox"),
    (Op.BROADCAST, 3 * MiB, Shape(11), None, "mailbox"),  # larger groups: smaller slots (24 x 128 KiB)
    (Op.BROADCAST, 3 * MiB + 8, Shape(11), None, "arena"),
    (Op.BROADCAST, 16 * MiB, ONE_HOST, None, "single_copy"),
    (Op.BROADCAST, 512 * KiB, PAIR, None, "mailbox"),  # 2 ranks: 512 KiB slots
    (Op.BROADCAST, 512 * KiB + 8, PAIR, None, "arena"),
    (Op.ALL_REDUCE, 256 * KiB + 8, PAIR, None, "arena"),  # all_reduce: at most 256 KiB through the mailbox
    (Op.BROADCAST, 4 * MiB, CROWDED, SOCKETS, "sockets:tree"),
    (Op.BROADCAST, 4 * MiB + 8, CROWDED, SOCKETS, "sockets:chain"),
    (Op.BROADCAST, 256 * KiB, ONE_HOST, SOCKETS, "sockets:chain"),
    (Op.BROADCAST, 128 * KiB, SPREAD, None, "two_level"),  # 2 x 64 KiB
    (Op.BROADCAST, 64 * KiB, SPREAD, None, "sockets:tree"),
    (Op.ALL_GATHER, 1 * KiB, ONE_HOST, None, "mailbox"),
    (Op.ALL_GATHER, 256 * KiB + 8, ONE_HOST, None, "arena"),  # the arena counts the output
    (Op.ALL_GATHER, 16 * KiB, SPREAD, None, "two_level"),  # 64 KiB of output
    (Op.ALL_GATHER, 1 * MiB, ONE_HOST, SOCKETS, "sockets:direct"),
    (Op.ALL_GATHER, 1 * MiB + 8, ONE_HOST, SOCKETS, "sockets:ring"),  # over 4 MiB of output
    (Op.ALL_GATHER, 1 * MiB + 8, CROWDED, SOCKETS, "sockets:doubling"),
    (Op.ALL_GATHER, 8 * MiB, PAIR, SOCKETS, "sockets:exchange"),  # two ranks: always straight, past inline: exchange
    (Op.REDUCE_SCATTER, 4 * KiB, ONE_HOST, None, "mailbox"),
    (Op.REDUCE_SCATTER, 256 * KiB + 8, ONE_HOST, None, "arena"),
    (Op.REDUCE_SCATTER, 128 * KiB, ONE_HOST, SOCKETS, "sockets:direct"),
    (Op.REDUCE_SCATTER, 1 * MiB, CROWDED, SOCKETS, "sockets:halving"),
    (Op.REDUCE_SCATTER, 1 * MiB, ONE_HOST, SOCKETS, "sockets:ring"),
    (Op.REDUCE_SCATTER, 1 * MiB, PAIR, SOCKETS, "sockets:direct"),
    (Op.REDUCE, 1 * MiB, ONE_HOST, None, "sockets:tree"),
    (Op.GATHER, 1 * MiB, ONE_HOST, None, "sockets:direct"),
    (Op.ALL_TO_ALL, 1 * MiB, ONE_HOST, None, "sockets:direct"),
    (Op.BARRIER, 0, ONE_HOST, None, "mailbox"),
    (Op.BARRIER, 0, ONE_HOST, NO_MAILBOX, "sockets:direct"),
    (Op.ALL_REDUCE, 8, Shape(1), None, "sockets:doubling"),
    # the single-copy path: one host, from SINGLE_COPY_MIN_BYTES (all_gather: of the output) or `shm_min_bytes`
    (Op.ALL_REDUCE, 16 * MiB, ONE_HOST, None, "single_copy"),
    (Op.ALL_REDUCE, 16 * MiB - 8, ONE_HOST, None, "arena"),
    (Op.ALL_REDUCE, 256 * MiB, PAIR, None, "arena"),  # two ranks: the arena in 1 MiB steps at every size
    (Op.ALL_REDUCE, 6 * MiB, PAIR, TcpOptions(shm_single_copy_min_bytes=6 * MiB), "single_copy"),
    (Op.ALL_REDUCE, 16 * MiB, ONE_HOST, NO_MAILBOX, "single_copy"),
    (Op.ALL_REDUCE, 16 * MiB, ONE_HOST, ARENA, "arena"),
    (Op.ALL_REDUCE, 16 * MiB, SPREAD, None, "two_level"),  # one host only
    (Op.ALL_REDUCE, 16 * MiB, ONE_HOST, SOCKETS, "sockets:ring"),
    (Op.BROADCAST, 16 * MiB, CROWDED, None, "single_copy"),
    (Op.BROADCAST, 16 * MiB, PAIR, None, "single_copy"),
    (Op.BROADCAST, 16 * MiB - 8, PAIR, None, "single_copy"),  # two ranks: compiled from 4 MiB (test_single_copy_native)
    (Op.BROADCAST, 4 * MiB - 8, PAIR, None, "arena"),
    (Op.ALL_GATHER, 4 * MiB, PAIR, None, "single_copy"),  # two ranks: from 8 MiB of output
    (Op.ALL_GATHER, 2 * MiB - 8, PAIR, None, "arena"),  # compiled from 4 MiB of output
    (Op.REDUCE_SCATTER, 4 * MiB, PAIR, None, "single_copy"),  # two ranks: from 4 MiB
    (Op.REDUCE_SCATTER, 4 * MiB - 8, PAIR, None, "arena"),
    (Op.ALL_REDUCE, 2 * MiB, PAIR, TcpOptions(shm_single_copy_min_bytes=2 * MiB), "single_copy"),  # its own threshold
    (Op.ALL_REDUCE, 2 * MiB - 8, PAIR, TcpOptions(shm_single_copy_min_bytes=2 * MiB), "arena"),
    (Op.ALL_GATHER, MiB // 2 + 8, PAIR, TcpOptions(shm_single_copy_min_bytes=MiB, shm_min_bytes=8 * MiB), "single_copy"),
    (Op.ALL_GATHER, 128 * KiB, PAIR, TcpOptions(shm_single_copy_min_bytes=0), "mailbox"),  # the mailbox first
    (Op.ALL_GATHER, 2 * MiB, ONE_HOST, None, "single_copy"),  # more ranks: from 8 MiB of output
    (Op.ALL_GATHER, MiB // 2 - 8, CROWDED, None, "arena"),  # compiled from 2 MiB of output
    (Op.REDUCE_SCATTER, 16 * MiB, PAIR, None, "single_copy"),
    (Op.REDUCE_SCATTER, 16 * MiB, ONE_HOST, None, "single_copy"),
    (Op.REDUCE_SCATTER, 16 * MiB - 8, ONE_HOST, None, "arena"),
    (Op.REDUCE_SCATTER, 256 * KiB + 8, ONE_HOST, TcpOptions(shm_min_bytes=0), "single_copy"),  # the threshold given
    (Op.ALL_REDUCE, 256 * KiB + 8, PAIR, TcpOptions(shm_min_bytes=0), "single_copy"),
    (Op.REDUCE, 64 * MiB, ONE_HOST, None, "sockets:tree"),
]


@pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox needs x86 store order")
@pytest.mark.parametrize("op, nbytes, shape, options, want", ROUTES,
                         ids=[f"{o.name.lower()}-{n}-{s.size}r{s.hosts}h-{i}" for i, (o, n, s, _, _) in enumerate(ROUTES)])
def test_route_of_every_op_size_and_group(op: Op, nbytes: int, shape: Shape, options: TcpOptions | None,
                                          want: str) -> None:
    assert str(route(op, nbytes, shape, options)) == want


def test_unknown_hosts_list_every_path_the_hosts_could_allow() -> None:
    """Before the members tell each other where they are, a large op may take the arena or two levels: the backend
    learns the hosts first. Small ops that only the sockets take never make it wait."""
    unknown = Shape(4, hosts=None)
    assert candidates(Op.ALL_REDUCE, 1 * MiB, unknown, TcpOptions()) == (P.ARENA, P.TWO_LEVEL, P.SOCKETS)
    assert candidates(Op.ALL_REDUCE, 16 * MiB, unknown, TcpOptions()) == (P.SINGLE_COPY, P.ARENA, P.TWO_LEVEL,
                                                                          P.SOCKETS)
    assert candidates(Op.ALL_REDUCE, 1 * MiB, unknown, SOCKETS) == (P.SOCKETS,)
    assert candidates(Op.REDUCE, 1 * MiB, unknown, TcpOptions()) == (P.SOCKETS,)


@pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox needs x86 store order")
def test_the_backend_takes_the_route_the_policy_names() -> None:
    """Real groups: the route each backend reports is the one its ops take (the memory they map says which)."""
    one_host = thread_groups(2, options=BackendOptions(timeout=10.0, tcp=TcpOptions(oversubscribed=False)))
    spread = thread_groups(4, options=BackendOptions(timeout=10.0, tcp=TcpOptions(oversubscribed=False)),
                           hosts=node_hosts(4, 2))
    try:
        b = one_host[0].backend
        assert str(b.route(Op.ALL_REDUCE, 8)) == "mailbox"  # type: ignore[union-attr]
        run_on(one_host, lambda pg: pg.all_reduce(np.ones(1)))
        assert all(pg.backend.placement.mailbox is not None and pg.backend.placement.arena is None  # type: ignore[union-attr]
                   for pg in one_host)
        assert str(b.route(Op.ALL_REDUCE, 1 * MiB)) == "arena"  # type: ignore[union-attr]
        run_on(one_host, lambda pg: pg.all_reduce(np.ones(MiB // 8)))
        assert all(pg.backend.placement.arena is not None for pg in one_host)  # type: ignore[union-attr]
        assert str(b.route(Op.BROADCAST, 16 * MiB)) == "single_copy"  # type: ignore[union-attr]
        run_on(one_host, lambda pg: pg.broadcast(np.ones(16 * MiB // 8), 0))
        assert all(pg.backend.placement.single_copy is not None for pg in one_host)  # type: ignore[union-attr]
        run_on(spread, lambda pg: pg.all_reduce(np.ones(1)))  # learns the hosts
        assert str(spread[0].backend.route(Op.ALL_REDUCE, 1 * MiB)) == "two_level"  # type: ignore[union-attr]
        run_on(spread, lambda pg: pg.all_reduce(np.ones(MiB // 8)))
        assert all(pg.backend.placement.levels is not None for pg in spread)  # type: ignore[union-attr]
    finally:
        for g in one_host + spread:
            g.destroy()


def test_options_from_the_environment() -> None:
    env = {"AXOND_SHM": "off", "AXOND_TCP_SPIN_YIELD": "false", "AXOND_SHM_MIN_BYTES": "auto",
           "AXOND_TCP_ALGORITHM": "ring", "AXOND_TCP_SPIN_US": "12.5", "AXOND_TCP_CHUNK_BYTES": " "}
    assert TcpOptions.from_env(env) == TcpOptions(shm=False, spin_yield=False, algorithm="ring", spin_us=12.5)
    assert TcpOptions.from_env({}) == TcpOptions()
    assert TcpOptions.from_env({"LOCAL_WORLD_SIZE": "8"}).local_ranks == 8
    for var, value, says in [("AXOND_TCP_SPIN_YIELD", "maybe", "use 1 or 0"), ("AXOND_TCP_SMALL_BYTES", "1k", "number"),
                             ("AXOND_TCP_CHUNK_BYTES", "-5", "must not be negative")]:
        with pytest.raises(ValueError, match=f"bad {var}='{value}': .*{says}"):
            TcpOptions.from_env({var: value})
    with pytest.raises(ValueError, match="algorithm='tree'"):
        TcpOptions(algorithm="tree")  # type: ignore[arg-type]


def test_every_option_has_a_variable_and_a_documented_row() -> None:
    """ENVIRONMENT names every field but NOT_FROM_ENV (detected, LOCAL_WORLD_SIZE, or given in code), with the dataclass's
    default; the table in docs/environment.md has the same rows."""
    fields = {f.name: f.default for f in dataclasses.fields(TcpOptions)}
    assert sorted(field for field, _, _ in ENVIRONMENT.values()) == sorted(set(fields) - set(NOT_FROM_ENV))
    for var, (field, default, _) in ENVIRONMENT.items():
        value = TcpOptions.from_env({var: default})
        assert getattr(value, field) == fields[field], f"{var}: default {default!r} is not {fields[field]!r}"
    page = (Path(__file__).resolve().parents[2] / "docs" / "environment.md").read_text()
    rows = dict(re.findall(r"^\| `(AXOND_(?:TCP|SHM)\w*)` \| (`\w+` \| \S+) \|", page, flags=re.M))
    want = {var: f"`{field}` | " + (default if field in AUTO else f"`{default}`")
            for var, (field, default, _) in ENVIRONMENT.items()}
    assert rows == want


def test_socket_buffers_are_set_only_where_the_kernel_allows_the_size() -> None:
    """auto: 4 MiB where net.core.{r,w}mem_max allow it, else the kernel's autotuning (a set size would be capped
    and stop the autotuning); an explicit size is used as given, 0 is autotuning."""
    from axond.distributed.backends.tcp.policy import SOCKET_BUFFER_BYTES, socket_buffer_bytes
    auto = TcpOptions()
    assert socket_buffer_bytes(auto, SOCKET_BUFFER_BYTES) == SOCKET_BUFFER_BYTES
    assert socket_buffer_bytes(auto, 8 * SOCKET_BUFFER_BYTES) == SOCKET_BUFFER_BYTES
    assert socket_buffer_bytes(auto, 212992) == 0  # a stock kernel's limit
    assert socket_buffer_bytes(auto, 0) == 0  # the limit is not known
    assert socket_buffer_bytes(TcpOptions(socket_buffer_bytes=1 * MiB), 212992) == 1 * MiB
    assert socket_buffer_bytes(TcpOptions(socket_buffer_bytes=0), 64 * MiB) == 0
    assert TcpOptions.from_env({"AXOND_TCP_SOCKET_BUFFER_BYTES": "0"}).socket_buffer_bytes == 0
    with pytest.raises(ValueError, match="AXOND_TCP_SOCKET_BUFFER_BYTES='big'"):
        TcpOptions.from_env({"AXOND_TCP_SOCKET_BUFFER_BYTES": "big"})


@pytest.mark.parametrize("size", [0, 256 * KiB])
def test_a_group_sets_its_sockets_buffers(size: int) -> None:
    """The option reaches every socket of a real group: a set size is what the kernel reports (it doubles it for
    its bookkeeping; 256 KiB is under any limit), 0 leaves the kernel's default (autotuned) buffers, which differ."""
    import socket
    gs = thread_groups(2, options=BackendOptions(timeout=10.0, tcp=TcpOptions(socket_buffer_bytes=size)))
    try:
        with socket.socket() as fresh:
            default = fresh.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        for pg in gs:
            sock = pg.backend.g.peers[1 - pg.rank].sock  # type: ignore[union-attr]
            got = [sock.getsockopt(socket.SOL_SOCKET, opt) for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF)]
            if size:
                assert got == [2 * size, 2 * size]
            else:
                assert got[1] != 2 * 256 * KiB and got[1] >= default
        run_on(gs, lambda pg: pg.all_reduce(np.ones(4)))
    finally:
        for g in gs:
            g.destroy()
