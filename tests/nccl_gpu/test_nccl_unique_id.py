"""The NCCL unique-ID exchange, run for real (no GPU needed): rank 0 publishes, the others wait.

Against an `InMemoryStore` and against the real coordinator's job-generation KV store on loopback.

`make_id` here returns seeded random bytes in place of `nccl.get_unique_id()`: the exchange treats
the 128 bytes as opaque, which is exactly what these tests check (NUL bytes, non-UTF-8, scoping).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest

from axond.control.client import CoordinatorClient, connect
from axond.coordinator.server import RunningCoordinator
from axond.distributed.backends.nccl.support import (
    UNIQUE_ID_BYTES,
    UNIQUE_ID_KEY,
    exchange_unique_id,
    communicator_id_forms,
    unique_id_from_bytes,
    unique_id_to_bytes,
)
from axond.errors import DistributedError
from axond.store import InMemoryStore, PrefixStore, Store


def opaque_id(seed: int) -> bytes:
    """128 bytes that are not text: NUL bytes, 0xFF, a lone UTF-8 continuation byte, then seeded noise."""
    head = b"\x00\xff\x80\x00\xc3\x28\x00"
    return head + random.Random(seed).randbytes(UNIQUE_ID_BYTES - len(head))


def run_ranks(
    size: int, store_of: Callable[[int], Store], make_id: Callable[[], bytes], timeout: float = 5.0
) -> list[bytes]:
    """Run `exchange_unique_id` on `size` threads (rank 0 last, so the others really wait) and return what each got."""
    results: list[bytes | BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = exchange_unique_id(store_of(rank), rank, make_id, timeout, group_name="g")
        except BaseException as e:
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(1, size)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    body(0)
    for t in threads:
        t.join(timeout=timeout + 5)
        assert not t.is_alive(), "an exchange thread did not finish"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, bytes)]


def test_every_rank_gets_rank0s_opaque_bytes() -> None:
    store = InMemoryStore()
    uid = opaque_id(1)
    calls = []

    def make_id() -> bytes:
        calls.append(1)
        return uid

    got = run_ranks(4, lambda r: PrefixStore("job/1/world", store), make_id)
    assert got == [uid] * 4
    assert calls == [1], "only group rank 0 may call get_unique_id"
    assert store.try_get(f"job/1/world/{UNIQUE_ID_KEY}") == uid


def test_subgroups_get_their_own_ids() -> None:
    store = InMemoryStore()
    ids = {"world": opaque_id(2), "tp0": opaque_id(3), "tp1": opaque_id(4)}
    got = {}
    for name, uid in ids.items():
        group_store = PrefixStore(f"job/1/{name}", store)
        got[name] = run_ranks(2, lambda r: group_store, lambda: uid)
    assert got == {name: [uid, uid] for name, uid in ids.items()}
    assert len(set(ids.values())) == 3


def test_generations_do_not_share_ids() -> None:
    """After a restart (new generation) the same group must not pick up the old generation's ID."""
    store = InMemoryStore()
    first = run_ranks(2, lambda r: PrefixStore("job/1/world", store), lambda: opaque_id(5))
    second = run_ranks(2, lambda r: PrefixStore("job/2/world", store), lambda: opaque_id(6))
    assert first == [opaque_id(5)] * 2 and second == [opaque_id(6)] * 2


def test_waiting_rank_times_out_when_rank0_never_publishes() -> None:
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        exchange_unique_id(PrefixStore("job/1/g", InMemoryStore()), 3, lambda: opaque_id(7), 0.3, group_name="g")
    assert 0.25 < time.monotonic() - started < 3
    e = info.value
    assert (e.op, e.group, e.rank, e.peer) == ("nccl_init", "g", 3, 0)
    assert "rank 0" in str(e) and "unique id" in str(e)


def test_wrong_sized_value_is_a_clear_error() -> None:
    store = InMemoryStore()
    store.set(UNIQUE_ID_KEY, b"tcp-address:1234")
    with pytest.raises(DistributedError, match="16-byte value"):
        exchange_unique_id(store, 1, lambda: opaque_id(8), 1.0, group_name="g")
    with pytest.raises(DistributedError, match="5-byte unique id"):
        exchange_unique_id(InMemoryStore(), 0, lambda: b"short", 1.0, group_name="g")


@pytest.mark.parametrize("signed", [True, False])
def test_unique_id_bytes_round_trip(signed: bool) -> None:
    """CuPy returns the ID as C chars: -128..127 on x86, 0..255 where char is unsigned (ARM)."""
    uid = opaque_id(9)
    as_tuple = unique_id_from_bytes(uid, signed=signed)
    assert len(as_tuple) == UNIQUE_ID_BYTES
    assert min(as_tuple) < 0 if signed else max(as_tuple) > 127
    assert unique_id_to_bytes(as_tuple) == uid
    with pytest.raises(ValueError, match="128"):
        unique_id_to_bytes(as_tuple[:-1])
    with pytest.raises(ValueError, match="128"):
        unique_id_from_bytes(uid + b"\x00", signed=signed)


def test_unique_id_as_bytes_from_cupy_14() -> None:
    """CuPy >= 14 returns the ID as bytes and its NcclCommunicator takes bytes: tried first, then the tuples."""
    uid = opaque_id(10)
    assert unique_id_to_bytes(uid) == uid and unique_id_to_bytes(bytearray(uid)) == uid
    forms = communicator_id_forms(uid)
    assert forms[0] == uid and isinstance(forms[0], bytes)
    assert forms[1:] == [unique_id_from_bytes(uid, signed=True), unique_id_from_bytes(uid, signed=False)]


def test_installed_cupy_takes_our_unique_id_form() -> None:
    """With the real CuPy (no GPU needed): its unique id round-trips through our bytes and the first form
    NcclCommunicator accepts gets past argument parsing. Only ncclCommInitRank itself needs a device."""
    nccl = pytest.importorskip("cupy.cuda.nccl", reason="needs CuPy with NCCL (pip install 'axond[gpu]')")
    uid = unique_id_to_bytes(nccl.get_unique_id())
    assert len(uid) == UNIQUE_ID_BYTES
    accepted = []
    for comm_id in communicator_id_forms(uid):
        try:
            nccl.NcclCommunicator(1, comm_id, 0)
        except (TypeError, OverflowError):
            continue
        except nccl.NcclError:
            pass  # no usable GPU here: NCCL itself refused, after CuPy took the argument
        accepted.append(type(comm_id))
        break
    assert accepted, "this CuPy's NcclCommunicator accepts none of the unique id forms we pass"


def coordinator_ranks(
    address: str, job: str, generation: int, size: int, group: str, make_id: Callable[[], bytes], timeout: float = 10.0
) -> list[bytes]:
    """Each rank with its own client connection, as rank processes have."""
    clients = [connect(address, call_timeout=5.0) for _ in range(size)]
    try:
        stores = [PrefixStore(f"pg/{group}", c.store(job, generation)) for c in clients]
        return run_ranks(size, lambda r: stores[r], make_id, timeout)
    finally:
        for c in clients:
            c.close()


def test_exchange_through_the_coordinator_per_group_and_generation(
    coordinator: RunningCoordinator, client: CoordinatorClient
) -> None:
    node = client.register_node("gpu-host").node_id
    gen1 = client.join("nccl-job", node, 4, 1, 1, max_restarts=1, timeout=10.0).generation
    world = coordinator_ranks(coordinator.address, "nccl-job", gen1, 4, "world", lambda: opaque_id(11))
    pair = coordinator_ranks(coordinator.address, "nccl-job", gen1, 2, "world/1[2,3]", lambda: opaque_id(12))
    assert world == [opaque_id(11)] * 4 and pair == [opaque_id(12)] * 2

    client.report_failure("nccl-job", node, gen1, 3, 1, "rank 3 died")
    gen2 = client.join("nccl-job", node, 4, 1, 1, max_restarts=1, timeout=10.0).generation
    assert gen2 == gen1 + 1
    fresh = client.store("nccl-job", gen2)
    assert fresh.try_get(f"pg/world/{UNIQUE_ID_KEY}") is None, "a new generation starts without the old ID"
    again = coordinator_ranks(coordinator.address, "nccl-job", gen2, 4, "world", lambda: opaque_id(13))
    assert again == [opaque_id(13)] * 4


def test_coordinator_wait_times_out_when_rank0_never_publishes(
    coordinator: RunningCoordinator, client: CoordinatorClient
) -> None:
    node = client.register_node("gpu-host").node_id
    generation = client.join("lonely", node, 2, 1, 1, timeout=10.0).generation
    store = PrefixStore("pg/world", client.store("lonely", generation))
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        exchange_unique_id(store, 1, lambda: opaque_id(14), 0.5, group_name="world")
    assert 0.4 < time.monotonic() - started < 5
    assert (info.value.op, info.value.group, info.value.rank, info.value.peer) == ("nccl_init", "world", 1, 0)
