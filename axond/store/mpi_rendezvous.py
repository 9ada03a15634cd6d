"""The rendezvous of a job started by an MPI launcher with nothing else set: rank 0 serves a `TCPStore`, MPI tells
the others where.

Under `mpirun`/`mpiexec`/`srun --mpi=pmix` without AXOND_COORDINATOR, MASTER_PORT or AXOND_FILE_STORE, rank 0 serves
the store on a free port and broadcasts its address and a fresh job secret over MPI_COMM_WORLD (mpi4py, the `mpi`
extra); every rank then opens the store as under torchrun, and the data plane (tcp, or the mpi backend) forms as
usual. No axond daemon is needed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from typing import Any

import numpy as np

from axond.config import OPEN_MPI_DEFAULTS, RuntimeEnv, export_defaults
from axond.errors import DistributedError, StoreError
from axond.store.tcp import TCPStore

MESSAGE_BYTES = 512
"""Bytes of the broadcast (host, port and secret as text)."""


def _mpi(launcher: str) -> Any:
    export_defaults(OPEN_MPI_DEFAULTS)  # MPI starts here when the rendezvous goes through it
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DistributedError(
            f"init_process_group: started by {launcher} with no rendezvous set; the rendezvous through MPI needs "
            "mpi4py (`pip install 'axond[mpi]'`, over an installed MPI library), or set AXOND_COORDINATOR (an axond "
            "coordinator) or MASTER_ADDR and MASTER_PORT (rank 0 serves the store there)") from e
    return MPI


def rank0_host(env: RuntimeEnv) -> str:
    """The address the other ranks reach rank 0 at: loopback when the launcher put every rank on this host, else
    MASTER_ADDR if set, else this host's name's address."""
    if env.local_world_size is not None and env.local_world_size == env.world_size:
        return "127.0.0.1"
    if env.master_addr:
        return env.master_addr
    address = socket.gethostbyname(socket.getfqdn())
    if ipaddress.ip_address(address).is_loopback:
        raise DistributedError(
            f"init_process_group: the ranks of this {env.launcher} job span hosts, but this host's name resolves to "
            f"{address}; set MASTER_ADDR to an address of rank 0's host the others reach (rank 0 serves the store "
            "there)")
    return address


def _bcast(MPI: Any, data: np.ndarray, timeout: float) -> None:
    request = MPI.COMM_WORLD.Ibcast(data, 0)
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise DistributedError(f"init_process_group: the rendezvous through MPI timed out after {timeout:g} s: "
                                   "rank 0 did not broadcast the store's address (did every rank call "
                                   "init_process_group?)", op="init", timed_out=True)
        time.sleep(0.001)


def mpi_store(rank: int, size: int, timeout: float, env: RuntimeEnv) -> tuple[TCPStore, str, bytes]:
    """(the store, rank 0's host, the job secret) agreed through MPI_COMM_WORLD; rank 0 serves the store."""
    launcher = env.launcher or "an MPI launcher"
    MPI = _mpi(launcher)
    world = MPI.COMM_WORLD
    if world.Get_size() != size or world.Get_rank() != rank:
        raise DistributedError(f"init_process_group: rank {rank} of {size} from the environment, but MPI_COMM_WORLD "
                               f"says rank {world.Get_rank()} of {world.Get_size()}; unset RANK/WORLD_SIZE under "
                               f"{launcher}, or set a rendezvous (MASTER_ADDR/MASTER_PORT, AXOND_COORDINATOR)")
    message = np.zeros(MESSAGE_BYTES, np.uint8)
    store = None
    if rank == 0:
        host, secret = rank0_host(env), os.urandom(32)
        store = TCPStore(host, 0, is_server=True, timeout=timeout, secret=secret)
        text = f"{host} {store.port} {secret.hex()}".encode()
        message[: len(text)] = np.frombuffer(text, np.uint8)
    _bcast(MPI, message, timeout)
    host, port, hexed = bytes(message).rstrip(b"\0").decode().split()
    secret = bytes.fromhex(hexed)
    if store is None:
        try:
            store = TCPStore(host, int(port), timeout=timeout, secret=secret)
        except StoreError as e:
            raise DistributedError(f"init_process_group: rank {rank} cannot reach the store rank 0 serves at "
                                   f"{host}:{port} ({e}); set MASTER_ADDR to an address of rank 0's host that "
                                   "every host reaches") from e
    return store, host, secret
