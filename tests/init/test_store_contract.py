"""The `Store` contract, run on every store: what a user of any of them sees is the same.

Each test runs on: the in-process store, a PrefixStore over it, the FileStore, the TCPStore (a real server
on loopback), the torch agent store (a client of a real torch TCPStore) and the torch adapter
(`axond.torch.AxondStoreOverTorch`, when torch is installed; also over `axond.torch.TorchStore`, so that both
adapters are held to it), and the coordinator's store (a real coordinator).
Every store is opened twice (`a`, `b`: two clients, two connections where the store has any) so that each
test also checks that one client sees the other's writes. Where a store cannot do what the contract says, the
test says why (`INHERENT`); everything else is a bug of the store.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from axond.control.client import connect
from axond.coordinator.server import RunningCoordinator
from axond.errors import StoreError, StoreTimeout
from axond.store import FileStore, InMemoryStore, PrefixStore, Store, TCPStore, TorchAgentStore
from axond.store.base import MAX_KEY_CHARS, MAX_TIMEOUT, MAX_VALUE_BYTES, MAX_WAIT_KEYS

KINDS = ["memory", "prefix", "file", "tcp", "coordinator", "torch_agent", "torch_adapter", "torch_both_ways"]
SHORT = 0.05
"""The wait a test expects to run out (seconds)."""
LONG = 30.0
"""A bound on a wait that another thread or process ends: never reached unless the store is broken."""

_names = itertools.count()


@dataclass
class Pair:
    """Two clients of one store, and how to open a third in another process (None: the store lives in one)."""

    a: Store
    b: Store
    child: str | None = None
    """Python source that binds `store` to a client of this store in another process."""
    no_child: str = "INHERENT: this store lives in one process; its clients are threads, tested above"
    """Why there is no `child`."""
    key_room: int = MAX_KEY_CHARS
    """The longest key a user may pass: less under a prefix (INHERENT: it counts against the limit below)."""
    closers: list[Callable[[], None]] = field(default_factory=list)


@pytest.fixture(scope="module")
def torch_server() -> Iterator[Any]:
    """A real torch TCPStore server on loopback (what torchrun's agent serves), shared by the module's tests."""
    dist = pytest.importorskip("torch.distributed", reason="the torch extra is not installed")
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=LONG), wait_for_workers=False)
    yield server


def _open(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Pair:
    name = f"t{next(_names)}"
    if kind == "memory":
        same = InMemoryStore()
        return Pair(same, same)  # INHERENT: one object in one process; its "clients" are threads
    if kind == "prefix":
        base = InMemoryStore()
        return Pair(PrefixStore(name, base), PrefixStore(name, base), key_room=MAX_KEY_CHARS - len(name) - 1)
    if kind == "file":
        path = str(tmp_path / "store")
        return Pair(FileStore(path), FileStore(path),
                    child=f"from axond.store import FileStore\nstore = FileStore({path!r})")
    if kind == "tcp":
        server = TCPStore("127.0.0.1", 0, is_server=True, timeout=LONG)
        client = TCPStore("127.0.0.1", server.port, timeout=LONG)
        return Pair(client, server, closers=[client.close, server.close],
                    child=f"from axond.store import TCPStore\nstore = TCPStore('127.0.0.1', {server.port}, "
                          f"timeout={LONG})")
    if kind == "coordinator":
        running: RunningCoordinator = request.getfixturevalue("coordinator")
        one, two = connect(running.address, call_timeout=LONG), connect(running.address, call_timeout=LONG)
        node = one.register_node(name).node_id
        gen = one.join(name, node, 1, 1, 1, 0, timeout=LONG).generation
        return Pair(one.store(name, gen), two.store(name, gen), closers=[one.close, two.close],
                    child=f"from axond.control.client import connect\n"
                          f"store = connect({running.address!r}, call_timeout={LONG}).store({name!r}, {gen})")
    if kind == "torch_both_ways":
        pytest.importorskip("torch", reason="the torch extra is not installed")
        from axond.torch import AxondStoreOverTorch, TorchStore

        shared = InMemoryStore()
        return Pair(AxondStoreOverTorch(TorchStore(shared)), AxondStoreOverTorch(TorchStore(shared)),
                    no_child="INHERENT: over an in-process store")
    server = request.getfixturevalue("torch_server")
    no_child = "a child would spend seconds importing torch to reach torch's own server; two connections are tested"
    if kind == "torch_agent":
        return Pair(TorchAgentStore("127.0.0.1", server.port, 1, LONG, prefix=f"{name}/"),
                    TorchAgentStore("127.0.0.1", server.port, 1, LONG, prefix=f"{name}/"), no_child=no_child)
    import torch.distributed as dist

    from axond.torch import AxondStoreOverTorch

    def adapter() -> AxondStoreOverTorch:
        return AxondStoreOverTorch(dist.PrefixStore(name, dist.TCPStore("127.0.0.1", server.port, None, False,
                                                                           timedelta(seconds=LONG))))
    return Pair(adapter(), adapter(), no_child=no_child)


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pair]:
    opened = _open(request.param, request, tmp_path)
    try:
        yield opened
    finally:
        opened.a.close()
        opened.b.close()
        for close in opened.closers:
            close()


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """`fn` started on a thread; its result (or exception) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test, which asserts on it
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_set_get_and_try_get(pair: Pair) -> None:
    a, b = pair.a, pair.b
    assert b.try_get("k") is None
    a.set("k", b"v1")
    assert b.get("k", LONG) == b"v1" and b.try_get("k") == b"v1"
    b.set("k", b"v2")
    assert a.get("k", 0) == b"v2"
    a.set("empty", b"")
    assert b.try_get("empty") == b"" and b.get("empty", 0) == b""  # an empty value is set, not unset
    a.set("ba", bytearray(b"\x01\x02"))  # type: ignore[arg-type]  # any bytes-like value is taken
    a.set("mv", memoryview(b"\x03\x04"))  # type: ignore[arg-type]
    assert b.try_get("ba") == b"\x01\x02" and b.try_get("mv") == b"\x03\x04"
    assert isinstance(b.get("ba", 0), bytes)


def test_binary_and_the_largest_values(pair: Pair) -> None:
    every_byte = bytes(range(256)) * 3
    pair.a.set("bin", every_byte)
    assert pair.b.get("bin", LONG) == every_byte
    largest = bytes(range(256)) * (MAX_VALUE_BYTES // 256)
    pair.a.set("large", largest)
    assert pair.b.get("large", LONG) == largest
    with pytest.raises(StoreError, match=f"too-large' is {MAX_VALUE_BYTES + 1} bytes; the limit is {MAX_VALUE_BYTES}"):
        pair.a.set("too-large", largest + b"x")
    with pytest.raises(StoreError, match="the limit is"):
        pair.a.compare_set("too-large", None, largest + b"x")
    assert pair.b.try_get("too-large") is None


def test_any_key_text_round_trips_and_stays_distinct(pair: Pair) -> None:
    keys = ["a/b", "a%2Fb", "a", ".", "..", ".lock", ".tmp1", " space ", "ünï-☃", "x" * pair.key_room, "y\x00z"]
    for i, key in enumerate(keys):
        pair.a.set(key, str(i).encode())
    for i, key in enumerate(keys):
        assert pair.b.get(key, LONG) == str(i).encode(), key
    pair.b.wait(keys, LONG)
    assert pair.a.delete("..") and pair.b.try_get("..") is None and pair.b.try_get(".") == b"3"


def test_add_counts_atomically_across_clients(pair: Pair) -> None:
    assert pair.a.add("n", 5) == 5
    assert pair.b.add("n", -2) == 3
    assert pair.a.add("n", 0) == 3
    assert pair.b.get("n", 0) == b"3"  # the count is decimal text, as torch keeps it
    pair.a.set("m", b"40")
    assert pair.b.add("m", 2) == 42

    def count(store: Store) -> None:
        for _ in range(25):
            store.add("shared", 1)

    threads = [threading.Thread(target=count, args=(s,)) for s in (pair.a, pair.b, pair.a, pair.b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LONG)
    assert pair.a.add("shared", 0) == 100


def test_add_to_text_fails_and_leaves_the_store_usable(pair: Pair) -> None:
    pair.a.set("text", b"abc")
    with pytest.raises(StoreError, match="text' holds b'abc', not an integer"):
        pair.b.add("text", 1)
    assert pair.b.try_get("text") == b"abc"
    assert pair.b.add("fine", 1) == 1  # the connection (torch's server drops it on a bad add) still works


def test_compare_set(pair: Pair) -> None:
    a, b = pair.a, pair.b
    assert a.compare_set("c", None, b"x") == (True, b"x")
    assert b.compare_set("c", None, b"y") == (False, b"x")
    assert b.compare_set("c", b"x", b"z") == (True, b"z")
    assert a.compare_set("c", b"nope", b"w") == (False, b"z")
    assert a.compare_set("gone", b"x", b"w") == (False, None)
    assert a.compare_set("gone", b"w", b"w") == (False, None)
    assert b.try_get("gone") is None
    assert a.compare_set("unset", b"", b"v") == (False, None)  # b"" is a value: an unset key does not hold it
    assert b.try_get("unset") is None
    a.set("empty", b"")
    assert b.compare_set("empty", None, b"v") == (False, b"")
    assert b.compare_set("empty", b"", b"v") == (True, b"v")
    assert a.compare_set("same", None, b"s") == (True, b"s")
    assert a.compare_set("same", b"s", b"s") == (True, b"s")
    assert b.get("c", 0) == b"z"


def test_delete(pair: Pair) -> None:
    pair.a.set("d", b"1")
    assert pair.b.delete("d") is True
    assert pair.a.delete("d") is False
    assert pair.a.try_get("d") is None
    with pytest.raises(StoreTimeout):
        pair.a.wait(["d"], SHORT)
    pair.b.set("d", b"again")
    assert pair.a.get("d", LONG) == b"again"


def test_wait_and_get_return_when_another_client_sets(pair: Pair) -> None:
    with pytest.raises(StoreTimeout):
        pair.b.wait(["late"], SHORT)  # not there yet: the waits below must wait
    getter, got = _in_thread(lambda: pair.b.get("late", LONG))
    waiter, waited = _in_thread(lambda: pair.b.wait(["late", "early"], LONG))
    pair.a.set("early", b"e")
    pair.a.set("late", b"\x00late")
    getter.join(LONG)
    waiter.join(LONG)
    assert got == [b"\x00late"] and waited == [None]
    pair.b.wait([], 0)
    pair.b.wait(["late", "early"], 0)  # already set: no wait needed


def test_a_wait_that_runs_out_raises_store_timeout_naming_the_key(pair: Pair) -> None:
    pair.a.set("here", b"1")
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="never-set") as caught:
        pair.b.wait(["here", "never-set"], SHORT)
    assert time.monotonic() - t0 >= SHORT * 0.9
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, StoreError)
    with pytest.raises(StoreTimeout, match="missing-key"):
        pair.b.get("missing-key", SHORT)
    with pytest.raises(StoreTimeout, match="zero-key"):
        pair.a.get("zero-key", 0)
    pair.a.set("after", b"ok")  # a timed-out wait leaves the client usable
    assert pair.b.get("after", LONG) == b"ok"


BAD_CALLS: list[tuple[str, Callable[[Store], Any], type[Exception], str]] = [
    ("empty key", lambda s: s.set("", b"v"), StoreError, "non-empty"),
    ("empty key get", lambda s: s.try_get(""), StoreError, "non-empty"),
    ("empty key wait", lambda s: s.wait([""], 1), StoreError, "non-empty"),
    ("bytes key", lambda s: s.set(b"k", b"v"), TypeError, "keys are str"),  # type: ignore[arg-type]
    ("int key", lambda s: s.add(3, 1), TypeError, "keys are str"),  # type: ignore[arg-type]
    ("NUL first", lambda s: s.set("\x00k", b"v"), StoreError, "NUL"),
    ("long key", lambda s: s.set("k" * (MAX_KEY_CHARS + 1), b"v"), StoreError, f"the limit is {MAX_KEY_CHARS}"),
    ("long key delete", lambda s: s.delete("k" * (MAX_KEY_CHARS + 1)), StoreError, f"the limit is {MAX_KEY_CHARS}"),
    ("str value", lambda s: s.set("k", "text"), TypeError, "must be bytes.*encode"),  # type: ignore[arg-type]
    ("int value", lambda s: s.set("k", 5), TypeError, "must be bytes"),  # type: ignore[arg-type]
    ("str expected", lambda s: s.compare_set("k", "x", b"v"), TypeError, "must be bytes"),  # type: ignore[arg-type]
    ("str desired", lambda s: s.compare_set("k", None, "v"), TypeError, "must be bytes"),  # type: ignore[arg-type]
    ("float delta", lambda s: s.add("k", 1.5), TypeError, "delta must be an int"),  # type: ignore[arg-type]
    ("huge delta", lambda s: s.add("k", 1 << 64), StoreError, "64 bits"),
    ("negative timeout", lambda s: s.wait(["k"], -1), StoreError, "timeout is -1"),
    ("NaN timeout", lambda s: s.get("k", math.nan), StoreError, "timeout is nan"),
    ("endless timeout", lambda s: s.wait(["k"], MAX_TIMEOUT * 2), StoreError, "loop for longer"),
    ("str timeout", lambda s: s.get("k", "1"), TypeError, "seconds"),  # type: ignore[arg-type]
    ("one str for keys", lambda s: s.wait("key", 1), TypeError, "list of keys"),
    ("too many keys", lambda s: s.wait([f"k{i}" for i in range(MAX_WAIT_KEYS + 1)], 1), StoreError, "at most"),
    ("barrier of none", lambda s: s.barrier("b", 0, 1), StoreError, "world_size is 0"),
]


def test_bad_arguments_are_rejected_clearly_and_change_nothing(pair: Pair) -> None:
    for what, call, error, message in BAD_CALLS:
        with pytest.raises(error, match=message):
            call(pair.a)
        assert pair.b.try_get("k") is None, what
    pair.a.set("k", b"still works")
    assert pair.b.get("k", LONG) == b"still works"


def test_barrier(pair: Pair) -> None:
    arrived, out = _in_thread(lambda: pair.b.barrier("b1", 2, LONG))
    pair.a.barrier("b1", 2, LONG)
    arrived.join(LONG)
    assert out == [None]
    with pytest.raises(StoreTimeout):
        pair.a.barrier("alone", 2, SHORT)
    with pytest.raises(StoreError):
        pair.a.barrier("b1", 2, SHORT)  # a name is single-use: a third arrival at a barrier of two is an error


CHILD = """
import sys
{open}
store.set("child/hello", b"\\x00\\xffchild")
store.set("child/echo", store.get("parent/reply", {long}))
print(store.add("both/count", 1))
store.close()
"""


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_two_processes_see_each_others_writes(pair: Pair) -> None:
    if pair.child is None:
        pytest.skip(pair.no_child)
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(open=pair.child, long=LONG)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert pair.a.get("child/hello", LONG) == b"\x00\xffchild"
        pair.a.add("both/count", 1)
        pair.a.set("parent/reply", b"\x01" * 1000)
        assert pair.a.get("child/echo", LONG) == b"\x01" * 1000
        out, err = child.communicate(timeout=LONG)
    finally:
        child.kill()
        child.wait(LONG)
    assert child.returncode == 0, err[-3000:]
    assert pair.b.add("both/count", 0) == 2 and out.strip() in ("1", "2")


def test_each_store_module_imports_first_and_alone() -> None:
    """`import axond.store` brings neither torch nor gRPC, and the coordinator's store imports as a first import
    (it and the control client import each other's packages)."""
    code = ("import sys, axond.store\n"
            "assert 'torch' not in sys.modules and 'grpc' not in sys.modules, sorted(sys.modules)\n"
            "import axond.store.coordinator, axond.store.init_methods\n"
            "from axond.control import connect\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=LONG)
    assert done.returncode == 0, done.stderr[-3000:]
