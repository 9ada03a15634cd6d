"""How fast this machine moves data between two cores right now: a probe for benchmark tables.

One thread writes a 12 MiB buffer on one core, another copies it on a second core, hand-off after hand-off
(NumPy copies without the GIL). On some VMs the time of that hand-off moves in steps while the copies on one
core alone do not: on the 2-core VM of bench/results/ it is about 0.9 ms for stretches of seconds to minutes, then
3.5-5.5 ms for others (session 17). Ranks on one host exchange data exactly this way, so a shared-memory
collective measured in the slow stretch runs several times slower; the benchmarks print this probe beside
their tables so that a slow cell can be told from a slow machine.

Run: `python bench/cross_core.py [--seconds 20]` prints the probe every half second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np

NBYTES = 12 << 20


def _cores() -> tuple[int, int] | None:
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return (cores[0], cores[1]) if len(cores) >= 2 else None


def probe(seconds: float = 1.0) -> float | None:
    """Median milliseconds of one 12 MiB hand-off between two cores over `seconds`, or None on one core."""
    cores = _cores()
    if cores is None:
        return None
    src = np.ones(NBYTES, np.uint8)
    dst = np.empty_like(src)
    go, done, stop = threading.Event(), threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def reader() -> None:
        try:
            os.sched_setaffinity(0, {cores[1]})
            while go.wait(10.0) and not stop.is_set():
                go.clear()
                np.copyto(dst, src)
                done.set()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            failed.append(e)
            done.set()

    before = os.sched_getaffinity(0)
    thread = threading.Thread(target=reader, name="cross-core-reader", daemon=True)
    thread.start()
    times: list[float] = []
    try:
        os.sched_setaffinity(0, {cores[0]})
        end = time.perf_counter() + seconds
        value = 0
        while time.perf_counter() < end and not failed:
            start = time.perf_counter()
            value = (value + 1) & 0xFF
            src.fill(value)
            go.set()
            if not done.wait(10.0):
                raise TimeoutError("the cross-core probe's reader did not answer within 10 s")
            done.clear()
            times.append(time.perf_counter() - start)
    finally:
        stop.set()
        go.set()
        thread.join(10.0)
        os.sched_setaffinity(0, before)
    if failed:
        raise failed[0]
    return statistics.median(times) * 1e3 if times else None


def describe(ms: float | None) -> str:
    """One line for a benchmark's output."""
    if ms is None:
        return "cross-core probe: one core only"
    return f"cross-core probe: 12 MiB hand-off {ms:.2f} ms (python bench/cross_core.py)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        ms = probe(0.5)
        if ms is None:
            raise SystemExit("one core only: nothing to probe")
        print(f"{time.strftime('%H:%M:%S')} {ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
