"""Which data path a GPU group takes: NCCL when every member has a GPU of its own, the staging path otherwise.

GPU-free (CI tests it): each member publishes a `DeviceClaim` (its host, its GPU's UUID, whether NCCL can run
there) under the group's store namespace; `choose_path` decides from all of them, so every member decides the
same. Only `local_claim` touches CuPy, and only where CuPy imports.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from axond.distributed.backends.nccl.backend import NcclBackend
from axond.distributed.backends.nccl.support import choose_device
from axond.errors import BackendUnavailable, DistributedError, StoreTimeout
from axond.store import Store


@dataclass(frozen=True)
class DeviceClaim:
    """What one member brings: its host, the UUID of its GPU ("" without one), and whether NCCL runs there."""

    host: str
    gpu: str
    nccl: bool
    why: str = ""
    """Why NCCL cannot run on this member (empty when it can)."""
    device: int = -1
    """The index of the GPU on this member (-1 without one)."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> DeviceClaim:
        raw = json.loads(data.decode())
        return cls(str(raw["host"]), str(raw["gpu"]), bool(raw["nccl"]), str(raw.get("why", "")),
                   int(raw.get("device", -1)))


@dataclass(frozen=True)
class DataPath:
    """The decision: `backend` is "nccl" or "staging"; `reason` says why, naming the members concerned."""

    backend: str
    reason: str


def choose_path(claims: Sequence[DeviceClaim]) -> DataPath:
    """NCCL when every member has a GPU no other member uses and NCCL runs on each; else staging, saying why."""
    owners: dict[tuple[str, str], int] = {}
    for rank, claim in enumerate(claims):
        if not claim.gpu:
            return DataPath("staging", f"rank {rank} has no GPU ({claim.why or 'CPU only'})")
        if not claim.nccl:
            return DataPath("staging", f"NCCL cannot run on rank {rank}: {claim.why}")
        first = owners.setdefault((claim.host, claim.gpu), rank)
        if first != rank:
            return DataPath("staging", f"ranks {first} and {rank} share GPU {claim.gpu} on {claim.host} "
                                   "(NCCL refuses two ranks of one group on the same GPU)")
    return DataPath("nccl", f"each of the {len(claims)} ranks has a GPU of its own")


def host_id() -> str:
    """This machine, as the members compare it: the boot id where Linux has one (containers on one host share
    it, and so do their GPUs), else the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def local_claim(device: int | None, local_rank: int | None = None) -> DeviceClaim:
    """This member's claim: the GPU it would use (`device`, else `local_rank` (LOCAL_RANK), else 0) and whether NCCL
    runs."""
    host = host_id()
    ok, why = NcclBackend.is_available()
    try:
        import cupy
    except ImportError:
        return DeviceClaim(host, "", False, why or "CuPy is not installed")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        index = shared_device(device, None if local_rank is None else str(local_rank), count)
        uuid = cupy.cuda.runtime.getDeviceProperties(index).get("uuid", b"")
        gpu = uuid.hex() if isinstance(uuid, (bytes, bytearray)) else str(uuid or "")
        gpu = gpu or str(cupy.cuda.Device(index).pci_bus_id)  # the same GPU under any CUDA_VISIBLE_DEVICES
    except Exception as e:  # noqa: BLE001 - no usable GPU here: the claim says why
        return DeviceClaim(host, "", False, f"{type(e).__name__}: {e}")
    return DeviceClaim(host, gpu, ok, why, index)


def shared_device(requested: int | None, local_rank: str | None, count: int) -> int:
    """The GPU a member claims: `choose_device`'s, or, where LOCAL_RANK is past the visible GPUs (more ranks than
    GPUs on a host), LOCAL_RANK modulo their number: those ranks share a GPU, so the group stages."""
    try:
        return choose_device(requested, local_rank, count)
    except BackendUnavailable:
        if requested is not None or count < 1:
            raise
        return int(local_rank or 0) % count


def exchange_claims(store: Store, rank: int, size: int, claim: DeviceClaim, timeout: float, *,
                    group_name: str = "") -> list[DeviceClaim]:
    """Publish `claim` and read every member's (group rank order) through the group's store namespace.

    Keys carry an incarnation number (how often this rank built this group), so re-creating a group never
    reads a stale claim. Raises `DistributedError` naming the missing member after `timeout`.
    """
    incarnation = store.add(f"placement/incarnation/{rank}", 1)
    store.set(f"placement/{incarnation}/claim/{rank}", claim.encode())
    claims = []
    for peer in range(size):
        try:
            raw = claim.encode() if peer == rank else store.get(f"placement/{incarnation}/claim/{peer}", timeout)
        except StoreTimeout as e:
            raise DistributedError(
                f"gpu init: group {group_name!r} rank {rank} waited {timeout:.1f}s for rank {peer} to say which "
                "device it uses; every member must create the group with backend 'auto' (or all with 'nccl')",
                op="gpu_init", group=group_name, rank=rank, peer=peer,
            ) from e
        claims.append(DeviceClaim.decode(raw))
    return claims
