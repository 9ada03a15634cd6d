"""What sending one buddy copy costs the sending thread (not a test): `sendfile` from a memfd against `sendall` of its
mapping, the receiver in another process, which is how a worker daemon sends its rank's copy to the buddy's worker
(`axond.worker.copy_forward`).

    python bench/copy_send.py recv 127.0.0.1 47001 &  python bench/copy_send.py send 127.0.0.1 47001

Over two network namespaces joined by a veth pair, start the receiver in one (`ip netns exec A python bench/copy_send.py
recv ADDR PORT`) and the sender in the other. Prints the median CPU time of the sending thread per copy (15 copies,
two rounds of each way).
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import time

SIZE = 15 * 2**20 + 700 * 1024
"""One rank's block of the 10.5 MiB MLP of `bench/shard_copies.py` at two ranks (15.7 MiB)."""


def receive(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        conn, _ = server.accept()
        buf = memoryview(bytearray(SIZE))
        with conn:
            while header := conn.recv(8):
                n, got = int.from_bytes(header, "little"), 0
                while got < n:
                    got += conn.recv_into(buf[got:n])
                conn.sendall(b"k")


def send(host: str, port: int) -> None:
    fd = os.memfd_create("axond-bench-send")
    os.ftruncate(fd, SIZE)
    mapping = mmap.mmap(fd, SIZE)
    mapping[:] = os.urandom(1024) * (SIZE // 1024)
    sock = socket.create_connection((host, port))
    with open(fd, "rb", buffering=0, closefd=False) as f:

        def one(kind: str) -> float:
            began = time.thread_time()
            sock.sendall(SIZE.to_bytes(8, "little"))
            if kind == "sendfile":
                sock.sendfile(f, 0, SIZE)
            else:
                sock.sendall(memoryview(mapping))
            sock.recv(1)
            return time.thread_time() - began

        for kind in ("sendfile", "sendall", "sendfile", "sendall"):
            cpu = statistics.median(one(kind) for _ in range(15))
            print(f"{kind}: {cpu * 1e3:.2f} ms of the sending thread's CPU per {SIZE / 2**20:.1f} MiB", flush=True)
    sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["send", "recv"])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    args = parser.parse_args()
    (send if args.role == "send" else receive)(args.host, args.port)


if __name__ == "__main__":
    main()
