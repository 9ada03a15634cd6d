"""The compiled prepared mailbox ops (`_fastbox`): built by the install, the same numbers bit for bit as one process
reducing in rank order, the same protocol as the Python path (ranks with and without it share a mailbox), the Python
wait when a member is late, and their argument checks.

test_mailbox's prepared-op tests (mismatches, silent peers) run through it too wherever it is built.
"""

from __future__ import annotations

import functools
import mmap
import shutil
import sysconfig
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from axond import DistributedError, ProcessGroup, ReduceOp
from axond.distributed import BackendOptions
from axond.distributed.backends.tcp import TcpOptions
from axond.distributed.backends.tcp.policy import MAILBOX_BROADCAST_SLOTS, ORDERED_STORES
from axond.distributed.backends.tcp.shm import mailbox, mailbox_ops
from axond.distributed.backends.tcp.transport.wire import Op
from axond.distributed.numerics.reducers import accumulator
from axond.testing import run_on, thread_groups
from collective_cases import check_other_call_raises

pytestmark = [pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox needs x86 store order"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]  # the wrapping inputs
fastbox = mailbox._fastbox
needs_fastbox = pytest.mark.skipif(fastbox is None, reason="the compiled helper was not built (no C compiler)")

UFUNCS: dict[ReduceOp, Callable[..., Any]] = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add,
                                               ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
                                               ReduceOp.MAX: np.maximum, ReduceOp.BXOR: np.bitwise_xor}


def test_the_install_built_the_compiled_helper() -> None:
    """`pip install -e .` builds it wherever a C compiler and Python's headers exist (it is optional elsewhere)."""
    compiler = sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None:
        pytest.skip(f"no C compiler ({compiler}): the install skips the helper and the Python path runs alone")
    assert fastbox is not None, "the C compiler exists but the install did not build _fastbox: see pip's output"


def groups_with(natives: list[bool], timeout: float = 10.0) -> list[ProcessGroup]:
    """A group of threads whose rank r uses the compiled ops if natives[r]."""
    return thread_groups(len(natives), options=[BackendOptions(timeout=timeout, tcp=TcpOptions(shm_native=n))
                                                 for n in natives])


def data_for(dtype: type, op: ReduceOp, rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """Rank `rank`'s input: random values and, on floats, NaN, infinities and both zeros; on integers, values whose
    sum or product wraps."""
    rng = np.random.default_rng(100 + rank)
    if np.dtype(dtype).kind == "f":
        big = np.finfo(dtype).max / np.asarray(2, dtype)
        x = (rng.standard_normal(shape) * 10).astype(dtype)
        flat = x.reshape(-1)
        flat[0] = np.nan if rank == 1 else 1.0
        flat[1] = -0.0 if rank % 2 else 0.0
        flat[2] = np.inf if rank == 0 else -1.0
        flat[3] = big if op is ReduceOp.SUM else 2.0  # the sum overflows
        return x
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
    flat = x.reshape(-1)
    flat[0] = info.max - rank
    flat[1] = info.min + rank
    return x


def rank_order(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """What one process gets reducing every rank's input in rank order (float16 sums in float32, rounded once)."""
    wide = accumulator(inputs[0].dtype, op) or inputs[0].dtype
    with np.errstate(all="ignore"):
        out = functools.reduce(lambda a, b: UFUNCS[op](a, b), [x.astype(wide) for x in inputs])
        if op is ReduceOp.AVG:
            out = np.true_divide(out, len(inputs), dtype=out.dtype)
        return out.astype(inputs[0].dtype)


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes(), (got, want)


CASES = [(dtype, op) for dtype in (np.float32, np.float64)
         for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)]
CASES += [(dtype, op) for dtype in (np.int32, np.int64)
          for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)]
CASES += [(np.float16, ReduceOp.SUM), (np.uint8, ReduceOp.BXOR)]  # reduced in NumPy on every rank


@pytest.mark.parametrize("dtype, op", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_compiled_and_python_ranks_share_a_mailbox_with_the_numbers_of_one_process(dtype: type, op: ReduceOp) -> None:
    """Ranks 0 and 2 run the compiled ops, rank 1 the Python ones: every prepared all_reduce and reduce_scatter
    gives, on every rank, the bits one process gets reducing in rank order (NaN, both zeros, infinities, wrapping
    integers), and broadcast, all_gather and barrier run between them."""
    natives = [True, False, True]
    gs = groups_with(natives)
    try:
        inputs = [data_for(dtype, op, r, (6, 5)) for r in range(3)]
        want = rank_order(inputs, op)

        def body(pg: ProcessGroup) -> list[np.ndarray]:
            got = []
            for i in range(4):  # the first call prepares; the next ones run prepared
                x = inputs[pg.rank].copy()
                pg.all_reduce(x, op)
                got.append(x)
                got.append(pg.reduce_scatter(inputs[pg.rank].copy(), op))
                b = inputs[pg.rank][0].copy()
                pg.broadcast(b, i % 3)
                got.append(b)
                got.append(pg.all_gather(inputs[pg.rank][1]))
                pg.barrier()
            return got

        results = run_on(gs, body)
        for rank, got in enumerate(results):
            for i in range(4):
                all_reduced, scattered, broadcast, gathered = got[4 * i : 4 * i + 4]
                same_bits(all_reduced, want)
                same_bits(scattered, want[2 * rank : 2 * rank + 2])
                same_bits(broadcast, inputs[i % 3][0])
                same_bits(gathered, np.stack([inputs[r][1] for r in range(3)]))
        compiled = NATIVE_REDUCTIONS_OF.get(np.dtype(dtype), ())
        for pg, native in zip(gs, natives):
            small = {key: r.form for key, r in pg.fast_path.runners().items()}  # type: ignore[attr-defined]
            reductions = [p for key, p in small.items() if key[0] in ("all_reduce", "reduce_scatter")]
            others = [p for key, p in small.items() if key[0] not in ("all_reduce", "reduce_scatter")]
            if accumulator(np.dtype(dtype), op) is None:  # float16 sums take low_precision's ops instead
                assert len(reductions) == 2 and len(others) == 5  # 3 broadcast roots, the all_gather, the barrier
            assert all((p.native is not None) == (native and op in compiled) for p in reductions)
            assert all((p.native is not None) == native for p in others)
    finally:
        for g in gs:
            g.destroy()


NATIVE_REDUCTIONS_OF = {np.dtype(t): (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
                        for t in (np.float32, np.float64)}
NATIVE_REDUCTIONS_OF.update({np.dtype(t): (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
                             for t in (np.int32, np.int64)})


@needs_fastbox
def test_a_late_member_makes_the_compiled_op_take_the_python_wait() -> None:
    """Rank 1 comes 20 ms late to every prepared op: the others' compiled ops post, give up after their turns, wait
    as the Python path does and then read the result."""
    gs = groups_with([True, True, True])
    try:
        def body(pg: ProcessGroup) -> list[np.ndarray]:
            got = []
            for i in range(3):
                if pg.rank == 1:
                    time.sleep(0.02)
                x = np.full(4, pg.rank + 1 + i, np.float32)
                pg.all_reduce(x)
                got.append(x)
                got.append(pg.reduce_scatter(np.arange(6, dtype=np.int64) * (pg.rank + 1), ReduceOp.MAX))
                got.append(pg.all_gather(np.full(2, pg.rank + i, np.float64)))
                b = np.full(3, pg.rank, np.int32)
                pg.broadcast(b, 1)
                got.append(b)
                pg.barrier()
            return got

        for rank, got in enumerate(run_on(gs, body)):
            for i in range(3):
                np.testing.assert_array_equal(got[4 * i], np.full(4, 6 + 3 * i, np.float32))
                np.testing.assert_array_equal(got[4 * i + 1], np.arange(6)[2 * rank : 2 * rank + 2] * 3)
                np.testing.assert_array_equal(got[4 * i + 2], [[r + i] * 2 for r in range(3)])
                np.testing.assert_array_equal(got[4 * i + 3], [1, 1, 1])
        forms = [r.form for pg in gs for r in pg.fast_path.runners().values()]  # type: ignore[attr-defined]
        assert forms and all(p.native is not None for p in forms)
    finally:
        for g in gs:
            g.destroy()


@needs_fastbox
def test_a_read_only_or_strided_array_leaves_the_compiled_op_untouched() -> None:
    """An array the compiled op cannot take (not contiguous, read-only where it writes) is not posted: `run` answers
    -1 and the Python path runs the call, raising what it raises."""
    mapping = mmap.mmap(-1, 4096)
    box = fastbox.Box(mapping, 4)
    header = bytes(72)
    op = fastbox.Op(box, fastbox.ALL_REDUCE, 0, 2, [0, 256, 512, 768], header, 16, 16, 0, fastbox.FLOAT32,
                    fastbox.SUM, False, 4, 0, 0)
    frozen = np.ones(4, np.float32)
    frozen.flags.writeable = False
    assert op.run(1, frozen) == -1
    assert op.run(1, np.ones(8, np.float32)[::2]) == -1
    assert op.run(1, np.ones(5, np.float32)) == -1  # another size
    assert box.ops == 0  # none of them was posted
    assert op.run(1, np.ones(4, np.float32)) == 1  # posted in buffer 1; no peer within 4 turns: the caller settles
    assert box.ops == 1
    box.close()
    assert op.run(2, np.ones(4, np.float32)) == -1  # a closed box posts nothing
    with pytest.raises(RuntimeError, match="closed"):
        op.finish(1, np.ones(4, np.float32))
    mapping.close()  # the box let go of it


@needs_fastbox
@pytest.mark.parametrize("change, match", [
    ({"kind": 99}, "out of range"), ({"size": 1}, "out of range"), ({"rank": 2}, "out of range"),
    ({"header": bytes(8)}, "out of range"), ({"posted": 12}, "do not fit"), ({"dtype": 0}, "do not fit"),
    ({"slots": [0, 256, 512]}, "2 \\* size"), ({"slots": [0, 256, 512, 4090]}, "outside the mapping"),
    ({"slots": [0, 4, 512, 768]}, "unaligned"),
])
def test_an_op_with_fields_that_do_not_fit_is_refused(change: dict[str, Any], match: str) -> None:
    mapping = mmap.mmap(-1, 4096)
    box = fastbox.Box(mapping, 4)
    fields: dict[str, Any] = dict(box=box, kind=fastbox.ALL_REDUCE, rank=0, size=2, slots=[0, 256, 512, 768],
                                  header=bytes(72), posted=16, nbytes=16, root=0, dtype=fastbox.FLOAT32,
                                  redop=fastbox.SUM, average=False, count=4, part=0, out_bytes=0)
    fields.update(change)
    with pytest.raises(ValueError, match=match):
        fastbox.Op(**fields)
    with pytest.raises(BufferError):
        fastbox.Box(b"read-only bytes", 4)
    box.close()
    mapping.close()


@needs_fastbox
def test_closing_the_box_waits_for_an_op_that_waits_without_the_gil() -> None:
    """An op spinning (without the GIL) for a member that never posts, while another thread closes the box: the close
    waits until the op's turns are over, so the op never reads an unmapped mailbox, and then lets go of it."""
    import threading

    mapping = mmap.mmap(-1, 4096)
    box = fastbox.Box(mapping, 200_000)  # turns enough to be mid-wait when the close comes
    op = fastbox.Op(box, fastbox.BARRIER, 0, 2, [0, 256, 512, 768], bytes(72), 0, 0, 0, fastbox.NO_DTYPE, 0, False, 0,
                    0, 0)
    got: list[Any] = []
    waiting = threading.Thread(target=lambda: got.append(op.run(1)))
    waiting.start()
    deadline = time.monotonic() + 10.0
    while box.ops == 0 and time.monotonic() < deadline:  # until it has posted: it is spinning now
        time.sleep(0.0005)
    box.close()
    assert got == [1]  # the op was over (its member never came) before the close returned
    waiting.join(10.0)
    assert op.run(2) == -1
    mapping.close()


@needs_fastbox
@pytest.mark.parametrize("late_root", [False, True])
def test_a_large_broadcast_is_copied_out_while_the_root_writes_it(late_root: bool) -> None:
    """A compiled root publishes a broadcast of more than a chunk (16 KiB) chunk by chunk and its members copy out
    what is there; a root on the Python path (rank 1) publishes it whole, and a late root sends its members to the
    Python wait: every member gets the root's bytes either way."""
    gs = groups_with([True, False, True])
    try:
        def body(pg: ProcessGroup) -> list[np.ndarray]:
            got = []
            for i in range(6):
                root = i % 3
                if late_root and pg.rank == root:
                    time.sleep(0.02)
                x = np.full(50_000, pg.rank * 100 + i, np.float32)  # 200 KB: 13 chunks
                x[::997] = -i
                pg.broadcast(x, root)
                got.append(x)
            return got

        for got in run_on(gs, body):
            for i, x in enumerate(got):
                want = np.full(50_000, (i % 3) * 100 + i, np.float32)
                want[::997] = -i
                same_bits(x, want)
    finally:
        for g in gs:
            g.destroy()


@needs_fastbox
def test_a_large_broadcast_against_another_call_raises_on_every_rank() -> None:
    """The members check the root's call before they copy a byte: a root broadcasting another size raises on every
    rank, naming the broadcast."""
    gs = groups_with([True, True, True], timeout=5.0)
    try:
        for size in (50_000, 60_000):  # both prepared on every rank: the root publishes the other one chunk by chunk
            run_on(gs, lambda pg: pg.broadcast(np.zeros(size, np.float32), 0))
        errors = run_on(gs, lambda pg: pg.broadcast(np.zeros(50_000 if pg.rank else 60_000, np.float32), 0),
                        return_exceptions=True)
        assert all(isinstance(e, DistributedError) and "broadcast" in str(e) for e in errors), errors
    finally:
        for g in gs:
            g.destroy()


def test_a_broadcast_past_the_slot_is_cut_into_whole_blocks_of_at_most_a_slot() -> None:
    slot = 256 << 10
    assert mailbox_ops.broadcast_chunks(1000, slot) == [(0, 1000)]
    assert mailbox_ops.broadcast_chunks(slot, slot) == [(0, slot)]
    assert mailbox_ops.broadcast_chunks(300_000, slot) == [(0, 151_552), (151_552, 300_000)]  # 37 blocks, then less
    assert mailbox_ops.broadcast_chunks(3 * slot - 4, slot) == [(0, slot), (slot, 2 * slot), (2 * slot, 3 * slot - 4)]
    for nbytes in (slot + 1, 4 * slot, 5 * slot - 8, 1 << 20):
        chunks = mailbox_ops.broadcast_chunks(nbytes, slot)
        assert chunks[0][0] == 0 and chunks[-1][1] == nbytes and len(chunks) == -(-nbytes // slot)
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        assert all(e - s <= slot and (e - s) % 4096 == 0 for s, e in chunks[:-1]) and chunks[-1][1] > chunks[-1][0]


@pytest.mark.parametrize("natives", [[True, False, True], [False, True, False, True]], ids=["3ranks", "4ranks"])
def test_a_broadcast_past_the_slot_runs_through_the_mailbox_in_chunks(natives: list[bool]) -> None:
    """Broadcasts of one, two and three slots' worth (the last chunk short) from every root, compiled and Python ranks
    together, prepared calls included: every rank gets the root's bytes, each call takes one mailbox round per chunk,
    and no arena is mapped."""
    n = len(natives)
    gs = groups_with(natives)
    sizes = [(300_000 - 4) // 4, (3 * (256 << 10) - 4) // 4, 2 * (256 << 10) // 4]
    try:
        for pg in gs:
            route = pg.backend.route  # type: ignore[union-attr]
            assert all(str(route(Op.BROADCAST, 4 * count)) == "mailbox" for count in sizes)

        def body(pg: ProcessGroup) -> list[tuple[np.ndarray, int]]:
            got = []
            for i in range(2 * n):  # the first call of each shape prepares; the next ones run prepared
                for count in sizes:
                    x = np.arange(count, dtype=np.float32) * (pg.rank + 1) + i
                    before = pg.backend.placement.mailbox.ops if i else 0  # type: ignore[union-attr]
                    pg.broadcast(x, i % n)
                    got.append((x, pg.backend.placement.mailbox.ops - before))  # type: ignore[union-attr]
            return got

        for got in run_on(gs, body):
            for j, (x, rounds) in enumerate(got):
                i, count = divmod(j, len(sizes))
                count = sizes[count]
                same_bits(x, np.arange(count, dtype=np.float32) * (i % n + 1) + i)
                if i:
                    assert rounds == -(-4 * count // (256 << 10))
        assert all(pg.backend.placement.arena is None for pg in gs)  # type: ignore[union-attr]
    finally:
        for g in gs:
            g.destroy()


@pytest.mark.parametrize("natives", [[True, True, True], [True, False, True]])
def test_a_chunked_broadcast_against_another_call_raises_on_every_rank(natives: list[bool]) -> None:
    """Members in a broadcast of three chunks, the root in one of two (another size): every rank raises naming the
    broadcast, at the first chunk, where the calls differ; and a member in another root's broadcast alike."""
    gs = groups_with(natives, timeout=5.0)
    try:
        big, small = 3 * (256 << 10) // 4, (256 << 10) + 1024
        for count in (big, small):
            run_on(gs, lambda pg: pg.broadcast(np.zeros(count, np.float32), 0))
        errors = run_on(gs, lambda pg: pg.broadcast(np.zeros(big if pg.rank else small, np.float32), 0),
                        return_exceptions=True)
        assert all(isinstance(e, DistributedError) and "broadcast" in str(e) for e in errors), errors
    finally:
        for g in gs:
            g.destroy()
    gs = groups_with(natives, timeout=5.0)
    try:
        errors = run_on(gs, lambda pg: pg.broadcast(np.zeros(big, np.float32), 1 if pg.rank == 2 else 0),
                        return_exceptions=True)
        assert all(isinstance(e, DistributedError) and "broadcast" in str(e) for e in errors), errors
    finally:
        for g in gs:
            g.destroy()


@pytest.mark.parametrize("natives", [[True, True], [True, False]])
def test_an_all_gather_whose_input_is_a_view_of_its_output(natives: list[bool]) -> None:
    """torch's all_gather_into_tensor passes a view of the output's own row as the input (FSDP2 does): the
    prepared op takes it on both paths; an input that overlaps the row only in part works too."""
    gs = groups_with(natives)
    try:
        def body(pg: ProcessGroup) -> list[np.ndarray]:
            got = []
            for i in range(4):
                out = np.zeros((2, 1000), np.float32)
                x = out[pg.rank]
                x[...] = pg.rank + 1 + i
                assert pg.all_gather(x, out=out) is out
                got.append(out.copy())
                flat = np.zeros(2 * 1000 + 4, np.float32)
                out2 = flat[:2000].reshape(2, 1000)
                shifted = flat[pg.rank * 1000 + 4 : pg.rank * 1000 + 1004]  # overlaps row `rank` in part
                shifted[...] = 10 * (pg.rank + 1) + i
                pg.all_gather(shifted.copy() if i % 2 else shifted, out=out2)
                got.append(out2.copy())
            return got

        for got in run_on(gs, body):
            for i in range(4):
                np.testing.assert_array_equal(got[2 * i], [[1 + i] * 1000, [2 + i] * 1000])
                np.testing.assert_array_equal(got[2 * i + 1], [[10 + i] * 1000, [20 + i] * 1000])
    finally:
        for g in gs:
            g.destroy()


@pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox needs x86's store order")
@pytest.mark.parametrize("natives", [[True, False], [False, True, True]], ids=["2ranks", "3ranks"])
def test_ops_of_a_whole_slot_run_through_the_mailbox_in_both_forms(natives: list[bool]) -> None:
    """Each op at the largest payload the mailbox takes on this many ranks (512 KiB per rank on two, 256 KiB on
    three, all_reduce 256 KiB), compiled and Python ranks together, prepared calls included: the bits of one process
    reducing in rank order, and the route says mailbox (one byte more would not)."""
    from axond.distributed.backends.tcp.policy import mailbox_limit
    from axond.distributed.backends.tcp.transport.wire import Op

    n = len(natives)
    gs = groups_with(natives)
    limit = {op: mailbox_limit(op, n) for op in (Op.ALL_REDUCE, Op.BROADCAST, Op.ALL_GATHER, Op.REDUCE_SCATTER)}
    chunked = MAILBOX_BROADCAST_SLOTS * (256 << 10)  # past a slot in chunks of a slot
    assert limit[Op.ALL_REDUCE] == 256 << 10 and limit[Op.BROADCAST] == (512 << 10 if n == 2 else chunked)
    per = {op: nbytes // 8 for op, nbytes in limit.items()}
    reduce_in = [data_for(np.float64, ReduceOp.SUM, r, (per[Op.ALL_REDUCE],)) for r in range(n)]
    scatter_in = [data_for(np.float64, ReduceOp.MAX, r, (per[Op.REDUCE_SCATTER] // n * n,)) for r in range(n)]
    blocks = [np.full(per[Op.ALL_GATHER], r, np.float64) for r in range(n)]
    try:
        for pg in gs:
            route = pg.backend.route  # type: ignore[union-attr]
            for op, nbytes in limit.items():
                assert str(route(op, nbytes)) == "mailbox" and str(route(op, nbytes + 8)) != "mailbox", op

        def body(pg: ProcessGroup) -> list[np.ndarray]:
            got = []
            for i in range(3):  # the first call prepares; the next ones run prepared
                x = reduce_in[pg.rank].copy()
                pg.all_reduce(x)
                got.append(x)
                got.append(pg.reduce_scatter(scatter_in[pg.rank].copy(), ReduceOp.MAX))
                b = np.full(per[Op.BROADCAST], pg.rank + 10 * i, np.float64)
                pg.broadcast(b, i % n)
                got.append(b)
                got.append(pg.all_gather(blocks[pg.rank]))
            return got

        for rank, got in enumerate(run_on(gs, body)):
            for i in range(3):
                reduced, scattered, sent, gathered = got[4 * i : 4 * i + 4]
                same_bits(reduced, rank_order(reduce_in, ReduceOp.SUM))
                part = len(scattered)
                same_bits(scattered, rank_order(scatter_in, ReduceOp.MAX)[rank * part : (rank + 1) * part])
                assert (sent == i % n + 10 * i).all()
                same_bits(gathered, np.stack(blocks))
        assert all(pg.backend.placement.arena is None for pg in gs)  # type: ignore[union-attr]
    finally:
        for g in gs:
            g.destroy()


@needs_fastbox
@pytest.mark.parametrize("size", [2, 3])
def test_inputs_that_change_in_one_byte_between_calls_reach_every_rank(made: list[ProcessGroup], size: int) -> None:
    """A post skips the blocks its slot already holds (unchanged since this rank's post two ops ago): an input that
    changes in a single byte, in the first block, a middle one or the last partial one, must still arrive."""
    made += groups_with([True] * size)
    nbytes = 3 * 4096 + 100  # three whole blocks and a partial one, under every slot size here
    spots = [0, 4095, 4096 + 7, 2 * 4096 + 4095, 3 * 4096, nbytes - 1]

    def body(pg: ProcessGroup) -> list[tuple[bytes, bytes, bytes, bytes]]:
        r, n = pg.rank, pg.size
        base = np.zeros(nbytes, np.uint8)
        got = []
        for i, spot in enumerate(spots * 2):  # each twice: the same input two ops apart, then a changed one
            base[spot] = (base[spot] + 1 + r) % 251
            x = base.view(np.uint8).copy()
            pg.broadcast(x, i % n)
            y = base.astype(np.int32)
            pg.all_reduce(y)
            gathered = pg.all_gather(base)
            scattered = pg.reduce_scatter(np.tile(base, n).astype(np.int64))
            got.append((x.tobytes(), y.tobytes(), gathered.tobytes(), scattered.tobytes()))
        return got

    results = run_on(made, body, timeout=60.0)
    bases = [np.zeros(nbytes, np.uint8) for _ in range(size)]
    for i, spot in enumerate(spots * 2):
        for r in range(size):
            bases[r][spot] = (bases[r][spot] + 1 + r) % 251
        want = (bases[i % size].tobytes(), sum(b.astype(np.int32) for b in bases).tobytes(),
                np.stack(bases).tobytes(), sum(b.astype(np.int64) for b in bases).tobytes())
        for r in range(size):
            assert results[r][i] == want, (r, i, spot)
    assert all(pg.backend.placement.mailbox.native is not None for pg in made)  # type: ignore[union-attr]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@needs_fastbox
@pytest.mark.skipif(not ORDERED_STORES, reason="the mailbox needs x86's store order")
@pytest.mark.parametrize("natives", [[True, True], [True, False], [False, True, True, True]],
                         ids=["compiled", "mixed2", "mixed4"])
def test_arena_steps_synchronize_through_compiled_posts_beside_python_ones(natives: list[bool]) -> None:
    """Large ops through the arena (several steps each) whose synchronizations compiled ranks post in C and Python
    ranks in Python: the numbers of one process, the compiled ranks' posts prepared once per call shape, none on the
    Python ranks; then a member in another call raises on every rank, from the compiled wait too."""
    n = len(natives)
    gs = thread_groups(n, options=[BackendOptions(timeout=5.0, tcp=TcpOptions(shm_native=native, shm_single_copy=False))
                                   for native in natives])
    inputs = [data_for(np.float64, ReduceOp.SUM, r, ((6 << 20) // 8,)) for r in range(n)]  # 6 MiB: two steps or more
    try:
        for pg in gs:
            assert str(pg.backend.route(Op.ALL_REDUCE, 6 << 20)) == "arena"  # type: ignore[union-attr]

        def body(pg: ProcessGroup) -> tuple[list[np.ndarray], int]:
            got = []
            for i in range(3):  # every call of a shape after the first reuses its prepared post
                x = inputs[pg.rank].copy()
                pg.all_reduce(x)
                got.append(x)
                b = np.full((6 << 20) // 8, pg.rank + 10 * i, np.float64)
                pg.broadcast(b, i % n)
                got.append(b)
                got.append(pg.reduce_scatter(inputs[pg.rank][: len(inputs[pg.rank]) // n * n].copy()))
            return got, len(pg.backend.placement.sync._posts)  # type: ignore[union-attr]

        results = run_on(gs, body)
        again = run_on(gs, body)  # the same call shapes: no new prepared post
        total = rank_order(inputs, ReduceOp.SUM)
        for rank, (got, posts) in enumerate(results):
            assert (posts > 0) == natives[rank] and again[rank][1] == posts, (rank, posts, again[rank][1])
            for i in range(3):
                reduced, sent, scattered = got[3 * i : 3 * i + 3]
                same_bits(reduced, total)
                assert (sent == i % n + 10 * i).all()
                part = len(scattered)
                same_bits(scattered, rank_order([x[: len(x) // n * n] for x in inputs], ReduceOp.SUM)[
                    rank * part : (rank + 1) * part])

        check_other_call_raises(gs, 1 << 20)
    finally:
        for g in gs:
            g.destroy()
