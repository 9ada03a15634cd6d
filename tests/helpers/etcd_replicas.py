"""Coordinator replicas on a test etcd, each a real `axond coordinator --state etcd://...` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from axond.v1 import coordinator_pb2 as pb
from axond.v1 import coordinator_pb2_grpc as pb_grpc
from etcd_cluster import EtcdServer, free_port

TOKEN = "etcd-test-token"
LEADER_METADATA = "axond-leader"


@dataclass
class Replica:
    address: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class ReplicaSet:
    """Replicas sharing one etcd prefix and one token."""

    etcd: EtcdServer
    work_dir: Path
    url: str
    replicas: list[Replica] = field(default_factory=list)
    paused: list[Replica] = field(default_factory=list)
    """Replicas stopped with SIGSTOP (not asked by `leader`)."""

    @property
    def addresses(self) -> str:
        return ",".join(r.address for r in self.replicas)

    def start(self, ttl: int = 2) -> Replica:
        port = free_port()
        log = self.work_dir / f"replica-{port}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-c", "from axond.cli.main import main; main()", "coordinator", "--host", "127.0.0.1",
                 "--port", str(port), "--state", self.url, "--token", TOKEN, "--leader-ttl", str(ttl)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        replica = Replica(f"127.0.0.1:{port}", process, log)
        self.replicas.append(replica)
        return replica

    def ask(self, replica: Replica, timeout: float = 2.0) -> str:
        """'leader' if the replica serves, else the leader it names ('' if none) or 'down'."""
        with grpc.insecure_channel(replica.address) as channel:
            try:
                pb_grpc.CoordinatorStub(channel).GetStatus(
                    pb.GetStatusRequest(), timeout=timeout, metadata=[("authorization", f"Bearer {TOKEN}")])
                return "leader"
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return "down"
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                if "is a follower" not in (e.details() or ""):
                    return "down"
                named = dict((k, v) for k, v in (e.trailing_metadata() or ()))  # type: ignore[attr-defined]
                return str(named.get(LEADER_METADATA, ""))

    def leader(self, timeout: float = 30.0) -> Replica:
        """The one replica that serves, once every live replica agrees on it."""
        deadline = time.monotonic() + timeout
        while True:
            live = [r for r in self.replicas if r.process.poll() is None and r not in self.paused]
            answers = {r.address: self.ask(r) for r in live}
            leaders = [r for r in live if answers[r.address] == "leader"]
            if len(leaders) == 1 and all(a in ("leader", leaders[0].address) for a in answers.values()):
                return leaders[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no single agreed leader within {timeout:g} s: {answers}\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(f"--- {r.address}\n{r.log.read_text(errors='replace')[-3000:]}" for r in self.replicas)

    def stop_all(self) -> None:
        for r in self.paused:
            r.process.send_signal(signal.SIGCONT)
        for r in self.replicas:
            if r.process.poll() is None:
                r.process.send_signal(signal.SIGTERM)
        for r in self.replicas:
            try:
                r.process.wait(15)
            except subprocess.TimeoutExpired:
                r.process.kill()
                r.process.wait(10)


def replica_set(etcd: EtcdServer, work_dir: Path) -> Iterator[ReplicaSet]:
    replicas = ReplicaSet(etcd, work_dir, etcd.url())
    try:
        yield replicas
    finally:
        replicas.stop_all()
