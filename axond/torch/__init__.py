"""PyTorch on axond: `import axond.torch` registers the torch.distributed backend "axond" (CPU tensors, and
CUDA tensors through axond's NCCL backend where torch sees a GPU and CuPy is installed: `axond.torch.cuda`).

Inside a rank started by `axond worker`/`axond run`, `torch.distributed.init_process_group("axond")`
needs nothing else; from any launcher, `init_method="axond://HOST:PORT"` rendezvouses over the
coordinator. torch's DDP, FSDP2, DTensor and the object collectives then run on axond's data plane.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from axond.config import RuntimeEnv
from axond.distributed.api import read_env
from axond.distributed.backends.base import BackendOptions
from axond.distributed.backends.addresses import route_address
from axond.distributed import live_watch
from axond.distributed.diagnostics.failure import install as install_failure_hook
from axond.store import PrefixStore, Store
from axond.store.over_torch import AxondStoreOverTorch
from axond.torch.devices import devices_here
from axond.torch.process_group import BACKEND, AxondProcessGroup, timeout_seconds
from axond.torch.reduce_ops import axond_op
from axond.torch.rendezvous import coordinator_store, install
from axond.torch.store import TorchStore

__all__ = ["BACKEND", "DEVICES", "AxondProcessGroup", "AxondStoreOverTorch", "TorchStore", "axond_op", "coordinator_store",
           "create_process_group"]


DEVICES = devices_here()
"""The device types "axond" is registered for in this process: ["cpu"], or ["cpu", "cuda"] (see `axond.torch.devices`)."""


def create_process_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> AxondProcessGroup:
    """torch's backend creator: one member of an axond group rendezvousing over torch's (prefixed) store; the
    subclass that also takes CUDA tensors where they can run."""
    env = read_env()  # this group's environment, read once as axond.init_process_group reads it
    install_failure_hook()  # as axond.init_process_group does: an uncaught exception tells the peers its cause
    if env.live_recovery:  # as axond.init_process_group does: a lost peer raises MembershipChanged (`axond.torch.live`)
        live_watch.configure(env)
    options = BackendOptions(timeout=timeout_seconds(timeout), job_secret=env.job_secret,
                             host=_toward_store(store, env), env=env)
    if "cuda" in DEVICES:
        from axond.torch.cuda_process_group import AxondCudaProcessGroup

        return AxondCudaProcessGroup(_attempt_store(store, env), rank, size, options)
    return AxondProcessGroup(_attempt_store(store, env), rank, size, options)


RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def _attempt_store(store: dist.Store, env: RuntimeEnv) -> Store:
    """torch's store for the group's rendezvous, under a prefix of torchrun's attempt (TORCHELASTIC_RESTART_COUNT):
    torchrun keeps one store across `--max-restarts`, and a restarted group must publish and read its peers'
    addresses afresh, never the dead attempt's (whose ports are closed, or reused by strangers). None in a live job:
    its ranks meet in their generation's own store, and a rank that joins the running job carries another count."""
    attempt = None if env.live_recovery else env.restart_count  # a live job meets in its generation's own store
    over = AxondStoreOverTorch(store)
    return PrefixStore(f"attempt-{attempt}", over) if attempt else over


def _toward_store(store: dist.Store, env: RuntimeEnv) -> str | None:
    """This rank's address on the route to the host of torch's TCP store (`tcp://` or `env://` rendezvous), so
    ranks on other machines reach it as gloo's would; None (the usual choice: AXOND_SOCKET_IFNAME, the route to
    the coordinator or MASTER_ADDR, else loopback) for other stores, a store on this machine or when
    AXOND_SOCKET_IFNAME picks the interface."""
    if env.socket_ifname:
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return route_address(store.host) if isinstance(store, dist.TCPStore) else None


def _register() -> None:
    """Register "axond" (again where torch's autoload registered its lazy stand-in: this creator replaces it)."""
    dist.Backend.register_backend(BACKEND, create_process_group, extended_api=False, devices=DEVICES)
    install()


_register()
