"""A real etcd for the tests that need one: started on free loopback ports with a temporary data
directory, stopped after. Tests that use it skip, saying why, where `etcd` is not on PATH."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from axond.coordinator.persistence.etcd import EtcdClient, EtcdError

START_TIMEOUT_S = 20.0
NO_ETCD = "etcd is not installed (no `etcd` on PATH; Debian/Ubuntu: apt-get install etcd-server)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdServer:
    """A running single-member etcd."""

    endpoint: str
    """HOST:PORT of its client API."""
    process: subprocess.Popen[bytes]

    def url(self, prefix: str | None = None) -> str:
        """An `--state` URL under a prefix of its own (a fresh one by default), so tests share one etcd."""
        return f"etcd://{self.endpoint}/{prefix or 'axond-test-' + uuid.uuid4().hex[:8]}"

    def client(self) -> EtcdClient:
        return EtcdClient([self.endpoint], timeout=5.0)


def start_etcd(work_dir: str) -> EtcdServer:
    """Start etcd with its data in `work_dir`/data and its log in `work_dir`/etcd.log; wait until it answers."""
    etcd = shutil.which("etcd")
    if etcd is None:
        pytest.skip(NO_ETCD)
    client_port, peer_port = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    log_path = os.path.join(work_dir, "etcd.log")
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [etcd, "--name", "axond-test", "--data-dir", os.path.join(work_dir, "data"), "--listen-client-urls", client_url,
             "--advertise-client-urls", client_url, "--listen-peer-urls", peer_url,
             "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"axond-test={peer_url}",
             "--log-level", "error", "--logger", "zap"],
            stdout=subprocess.DEVNULL, stderr=log_file,
        )
    server = EtcdServer(f"127.0.0.1:{client_port}", process)
    client = EtcdClient([server.endpoint], timeout=1.0)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            try:
                client.get(b"/axond-test-ready")
                return server
            except EtcdError:
                if process.poll() is not None or time.monotonic() > deadline:
                    stop_etcd(server)
                    with open(log_path, "rb") as f:
                        err = f.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"etcd did not start within {START_TIMEOUT_S:g} s: {err}") from None
                time.sleep(0.1)
    finally:
        client.close()


def stop_etcd(server: EtcdServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(10)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One etcd for the whole session (tests keep apart by key prefix); skipped without etcd."""
    work_dir = tempfile.mkdtemp(prefix="axond-etcd-")
    try:
        server = start_etcd(work_dir)
        try:
            yield server
        finally:
            stop_etcd(server)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
