"""A loopback TCP proxy that delays every byte by a fixed time in each direction (a slow link without netem).

No tests here; tests/control/test_latency.py uses it between workers (and their ranks) and a real coordinator.
"""

from __future__ import annotations

import queue
import socket
import threading
import time


class DelayProxy:
    """Listens on 127.0.0.1 (an OS-chosen port) and forwards each connection to `target`, holding each chunk
    `delay` seconds before passing it on, in order, in both directions; bandwidth is not limited."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target = target
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self.connections = 0
        """Connections forwarded to the target."""
        self.dropped = 0
        """Connections accepted and closed at once because the target did not accept."""
        self._changed = threading.Condition()
        self._sockets: list[socket.socket] = []
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="delay-proxy", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                with self._changed:
                    self.dropped += 1
                    self._changed.notify_all()
                continue
            upstream.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
                self._sockets += [client, upstream]
            self._pump(client, upstream)
            self._pump(upstream, client)

    def wait_for_dropped(self, count: int, timeout: float) -> bool:
        """Wait until `count` connections were dropped; False after `timeout` seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: self.dropped >= count, timeout)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def read() -> None:
            data = b"x"
            while data:
                try:
                    data = src.recv(1 << 16)
                except OSError:
                    data = b""
                chunks.put((time.monotonic() + self.delay, data))

        def write() -> None:
            while True:
                due, data = chunks.get()
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    return

        for fn in (read, write):
            threading.Thread(target=fn, name="delay-proxy-pump", daemon=True).start()

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        self._thread.join(timeout=2)
        with self._lock:
            for s in self._sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
