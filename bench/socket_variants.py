"""What pays on the link between two hosts: socket buffer sizes, several streams per peer, MSG_ZEROCOPY sends.

    python bench/socket_variants.py [--mtu 1500] [--mbytes 256]      (root: network-namespace hosts)

Two network-namespace hosts (axond/testing/netns.py) joined by a veth link; a process in each streams `--mbytes`
through plain sockets, one way (host 1 to host 0) and both ways at once, in each variant: the kernel's autotuned
buffers or a set size (4 MiB; 416 KiB is what a stock kernel's net.core.rmem_max caps a 4 MiB request at), one or
two streams (each its own thread on both sides, the bytes split in halves), plain or MSG_ZEROCOPY sends (whose
completions the sender reads from the socket's error queue). Prints GB/s per direction, the best of three rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.abspath(__file__)
SO_ZEROCOPY = 60
MSG_ZEROCOPY = 0x4000000
CHUNK = 4 << 20
VARIANTS = [
    {"streams": 1, "buffers": 0, "zerocopy": False},
    {"streams": 1, "buffers": 4 << 20, "zerocopy": False},
    {"streams": 1, "buffers": 416 << 10, "zerocopy": False},
    {"streams": 2, "buffers": 0, "zerocopy": False},
    {"streams": 2, "buffers": 4 << 20, "zerocopy": False},
    {"streams": 1, "buffers": 0, "zerocopy": True},
]


def _drain(sock: socket.socket, block: bool) -> int:
    """Read MSG_ZEROCOPY completions off the error queue; how many notifications were read."""
    got = 0
    while True:
        try:
            sock.recvmsg(1, 256, socket.MSG_ERRQUEUE | (0 if block else socket.MSG_DONTWAIT))
            got += 1
            block = False
        except (BlockingIOError, InterruptedError):
            return got


def _send(sock: socket.socket, data: np.ndarray, zerocopy: bool) -> None:
    view = memoryview(data).cast("B")
    for s in range(0, len(view), CHUNK):
        part = view[s : s + CHUNK]
        while part.nbytes:
            n = sock.send(part, MSG_ZEROCOPY if zerocopy else 0)
            part = part[n:]
            if zerocopy:
                _drain(sock, block=False)


def _recv(sock: socket.socket, data: np.ndarray) -> None:
    view = memoryview(data).cast("B")
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got : got + CHUNK])
        if not n:
            raise RuntimeError("the peer closed the stream")
        got += n


def _sockets(role: str, addr: str, port: int, streams: int, buffers: int) -> list[socket.socket]:
    def tune(s: socket.socket) -> None:
        s.settimeout(None)  # blocking, with the kernel's timeouts (a Python timeout would poll past MSG_DONTWAIT)
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            s.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", 60, 0))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if buffers:
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                s.setsockopt(socket.SOL_SOCKET, opt, buffers)

    socks = []
    if role == "serve":
        with socket.create_server((addr, port)) as listener:
            tune(listener)
            listener.settimeout(60)
            for _ in range(streams):
                socks.append(listener.accept()[0])
    else:
        deadline = time.monotonic() + 30
        for _ in range(streams):
            while True:
                s = socket.socket()
                tune(s)
                try:
                    s.connect((addr, port))
                    break
                except OSError:
                    s.close()
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            socks.append(s)
    for s in socks:
        tune(s)
    return socks


def role(which: str, addr: str, port: int, spec_json: str) -> None:
    spec = json.loads(spec_json)
    nbytes, streams, duplex, zerocopy = spec["nbytes"], spec["streams"], spec["duplex"], spec["zerocopy"]
    socks = _sockets(which, addr, port, streams, spec["buffers"])
    if zerocopy:
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    per = nbytes // streams
    best = float("inf")
    for _ in range(3):
        for s in socks:
            s.sendall(b"g")
            assert s.recv(1) == b"g"
        t0 = time.perf_counter()
        threads = []
        for i, s in enumerate(socks):
            if duplex or which == "connect":
                threads.append(threading.Thread(target=_send, args=(s, src[i * per : (i + 1) * per], zerocopy)))
            if duplex or which == "serve":
                threads.append(threading.Thread(target=_recv, args=(s, dst[i * per : (i + 1) * per])))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            if t.is_alive():
                raise RuntimeError("a stream did not finish in 120 s")
        for s in socks:
            s.sendall(b"e")
            assert s.recv(1) == b"e"
        best = min(best, time.perf_counter() - t0)
    print(best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--mbytes", type=int, default=256)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from axond.testing.netns import Network, unavailable

    if (why := unavailable()) is not None:
        sys.exit(why)
    nbytes = args.mbytes << 20
    print(f"| direction | streams | buffers | sends | GB/s per direction (MTU {args.mtu}) |")
    print("|---|---|---|---|---|")
    with Network.create(2, mtu=args.mtu) as net:
        a, b = net.hosts
        port = 30000
        for duplex in (False, True):
            for v in VARIANTS:
                port += 1
                spec = json.dumps({**v, "nbytes": nbytes, "duplex": duplex})
                procs = [a.popen([sys.executable, HERE, "serve", a.addr, str(port), spec], stdout=subprocess.PIPE,
                                 text=True)]
                time.sleep(0.2)
                procs.append(b.popen([sys.executable, HERE, "connect", a.addr, str(port), spec],
                                     stdout=subprocess.PIPE, text=True))
                secs = []
                for p in procs:
                    out, _ = p.communicate(timeout=300)
                    if p.returncode != 0:
                        sys.exit(f"a stream process failed ({p.returncode})")
                    secs.append(float(out.split()[-1]))
                buffers = f"{v['buffers'] >> 10} KiB" if v["buffers"] else "autotuned"
                print(f"| {'both ways' if duplex else 'one way'} | {v['streams']} | {buffers} | "
                      f"{'MSG_ZEROCOPY' if v['zerocopy'] else 'plain'} | {nbytes / max(secs) / 1e9:.2f} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("serve", "connect"):
        role(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
