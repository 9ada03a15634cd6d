"""CPU offload of FSDP shards: host copies of each unit's shard and gradient, moved by a `Copier`.

`ShardOffload` is one unit's bookkeeping, the same on every device. The master shard lives in a host buffer
allocated once; the optimizer steps it there (on the host, with its state in host memory). Before the unit's
all_gather the shard is uploaded to the compute device. The next unit's upload starts early, in FSDP's
prefetch order, so it overlaps this unit's compute. With `offload_params` the device copy is dropped after
the gather; with `offload_optimizer` alone it is kept and refreshed once per forward. The reduce-scattered
gradient shard is downloaded into a host buffer allocated once, asynchronously. The host waits for it only
when something reads the shard's `.grad` (the optimizer's step).

`CudaCopies` (offload_cuda.py: pinned memory, a copy stream, events) copies for CuPy models. NumPy models
have nothing to offload to and build no copier: CPUOffload is a no-op there. `HostCopies` runs the same
bookkeeping between NumPy arrays with synchronous copies, so that tests check it on a CPU-only machine.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from axond.nn.device import Array, Device, to_device
from axond.nn.module import Parameter
from axond.parallel.fsdp.stats import MemoryStats


class Transfer(Protocol):
    """One copy that may still be running."""

    def wait_compute(self) -> None:
        """Make the compute stream wait for the copy (work issued afterwards sees its result); no host wait."""

    def wait_host(self) -> None:
        """Block the calling thread until the copy is done."""

    def done(self) -> bool:
        """Whether the copy has finished (never blocks)."""


class Copier(Protocol):
    """The device side of offload: host and device buffers, and copies between them ordered after the compute
    issued so far (so a buffer the compute stream freed is never overwritten while still in use)."""

    def host_empty(self, n: int, dtype: Any) -> Array: ...

    def device_empty(self, n: int, dtype: Any) -> Array: ...

    def upload(self, host: Array, device: Array) -> Transfer: ...

    def download(self, device: Array, host: Array) -> Transfer: ...


class _Finished:
    def wait_compute(self) -> None:
        pass

    def wait_host(self) -> None:
        pass

    def done(self) -> bool:
        return True


class HostCopies:
    """Copies between NumPy arrays, finished when called: the offload bookkeeping without a device (tests)."""

    def __init__(self) -> None:
        self.uploads = 0
        self.downloads = 0

    def host_empty(self, n: int, dtype: Any) -> Array:
        return np.empty(n, dtype=dtype)

    def device_empty(self, n: int, dtype: Any) -> Array:
        return np.empty(n, dtype=dtype)

    def upload(self, host: Array, device: Array) -> Transfer:
        np.copyto(device, host)
        self.uploads += 1
        return _Finished()

    def download(self, device: Array, host: Array) -> Transfer:
        np.copyto(host, device)
        self.downloads += 1
        return _Finished()


def copier_for(device: Device, pin_memory: bool) -> Copier | None:
    """The copier for arrays on `device`: CUDA copies on a copy stream, or None on the CPU (nothing to offload to)."""
    if device.kind == "cpu":
        return None
    from axond.parallel.fsdp.offload_cuda import CudaCopies

    return CudaCopies(device.index, pin_memory)


class ShardOffload:
    """One unit's shard in host memory, its device copy and its gradient's download."""

    def __init__(self, copier: Copier, shard: Array, keep_on_device: bool, stats: MemoryStats) -> None:
        self.copier = copier
        self.keep_on_device = keep_on_device
        """Keep the device copy between gathers (offload_optimizer alone) or drop it after each (offload_params)."""
        self.stats = stats
        self.host = copier.host_empty(int(shard.size), shard.dtype)
        """The master shard: what the optimizer updates, on the host."""
        self.host[...] = to_device(shard, "cpu")
        stats.offloaded_bytes += int(self.host.nbytes)
        self.device: Array | None = None
        self.fresh = False
        """Whether `device` holds (or an upload in flight will hold) the host shard's current values."""
        self.uploads = 0
        self._upload: Transfer | None = None
        """The last upload: the compute stream waits on it before the gather, the host before writing `host`."""
        self._host_grad: Array | None = None
        self._staging: Array | None = None
        self._download: tuple[Transfer, Array | None, Array] | None = None
        """(transfer, device gradient kept alive until the copy is done, host buffer it lands in)."""

    @property
    def grad_pending(self) -> bool:
        return self._download is not None

    def mark_stale(self) -> None:
        """The host shard may have changed since the last upload (an optimizer step, a load): upload it again."""
        self.fresh = False

    def start_upload(self) -> None:
        """Start copying the host shard to the device, unless the device copy is fresh (or on its way)."""
        if self.fresh:
            return
        if self.device is None:
            self.device = self.copier.device_empty(int(self.host.size), self.host.dtype)
            self.stats.add_device_shard(int(self.device.nbytes))
        self._upload = self.copier.upload(self.host, self.device)
        self.fresh = True
        self.uploads += 1

    def on_device(self) -> Array:
        """The device copy, uploaded if needed; work the compute stream issues from now on sees its values."""
        self.start_upload()
        assert self._upload is not None and self.device is not None
        self._upload.wait_compute()
        return self.device

    def release(self) -> None:
        """After the gather has read the device copy: drop it (offload_params) or keep it (offload_optimizer)."""
        if self.keep_on_device or self.device is None:
            return
        self.stats.device_shard_bytes -= int(self.device.nbytes)
        self.device = None
        self.fresh = False

    def before_host_write(self) -> None:
        """Wait until no upload reads the host shard (before the optimizer or a load writes into it)."""
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.wait_host()

    def download_grad(self, grad: Array, accumulate: bool) -> None:
        """Start copying a device gradient shard to the host: into the gradient buffer, or into a staging buffer
        that `claim_grad` adds to the current gradient when `accumulate`."""
        if self._download is not None:
            raise RuntimeError("a gradient download is still pending: claim it before starting another")
        if accumulate:
            self._staging = self._host_buffer(self._staging, grad)
            target = self._staging
        else:
            self._host_grad = self._host_buffer(self._host_grad, grad)
            target = self._host_grad
        self.stats.add_device_shard(int(grad.nbytes))
        self._download = (self.copier.download(grad, target), grad, target)

    def poll(self) -> None:
        """Let go of the device gradient of a finished download (its memory returns to the device pool)."""
        if self._download is not None and self._download[1] is not None and self._download[0].done():
            transfer, grad, target = self._download
            self._forget_device_grad(grad)
            self._download = (transfer, None, target)

    def claim_grad(self, current: Array | None) -> Array:
        """Wait for the pending download and return the host gradient (`current` plus the download if accumulating)."""
        if self._download is None:
            raise RuntimeError("no gradient download is pending")
        (transfer, grad, target), self._download = self._download, None
        transfer.wait_host()
        self._forget_device_grad(grad)
        if target is self._staging:
            if current is None:
                raise RuntimeError("an accumulating gradient download found no gradient to add to")
            current += target
            return current
        return target

    def discard_grad(self) -> None:
        """Drop a pending download (the gradient is being replaced or cleared); waits so its buffers can be reused."""
        if self._download is not None:
            (transfer, grad, _), self._download = self._download, None
            transfer.wait_host()
            self._forget_device_grad(grad)

    def host_grad_bytes(self) -> int:
        """Bytes of the host gradient buffers (allocated at the first download, then kept)."""
        return sum(int(b.nbytes) for b in (self._host_grad, self._staging) if b is not None)

    def _host_buffer(self, buf: Array | None, like: Array) -> Array:
        if buf is not None and buf.dtype == like.dtype and buf.size == like.size:
            return buf
        if buf is not None:
            self.stats.offloaded_bytes -= int(buf.nbytes)
        buf = self.copier.host_empty(int(like.size), like.dtype)
        self.stats.offloaded_bytes += int(buf.nbytes)
        return buf

    def _forget_device_grad(self, grad: Array | None) -> None:
        if grad is not None:
            self.stats.device_shard_bytes -= int(grad.nbytes)


class HostShard(Parameter):
    """An offloaded unit's shard: `.data` is the host buffer (allocated once; assigning copies into it), and reading
    `.grad` first waits for the gradient's download, so the optimizer waits only when it steps."""

    def __init__(self, offload: ShardOffload) -> None:
        self._offload = offload
        self._grad: Array | None = None
        super().__init__(offload.host)
        self.register_pre_step_hook(lambda _: self._before_step())

    def _before_step(self) -> None:
        """The optimizer is about to update the host shard: no upload may read it, and the device copy goes stale."""
        self._offload.before_host_write()
        self._offload.mark_stale()

    @property  # type: ignore[override]
    def data(self) -> Array:
        return self._offload.host

    @data.setter
    def data(self, value: Array) -> None:
        if value is self._offload.host:
            return
        self._offload.before_host_write()
        self._offload.host[...] = to_device(value, "cpu").reshape(self._offload.host.shape)
        self._offload.mark_stale()

    @property  # type: ignore[override]
    def grad(self) -> Array | None:
        if self._offload.grad_pending:
            self._grad = self._offload.claim_grad(self._grad)
        return self._grad

    @grad.setter
    def grad(self, value: Array | None) -> None:
        self._offload.discard_grad()
        self._grad = value

    def receive_grad(self, device_grad: Array) -> None:
        """Start the download of a reduced gradient shard; `.grad` becomes (or adds) it when read."""
        if self._offload.grad_pending:  # a unit reduced twice before the step: take the first one in
            self._grad = self._offload.claim_grad(self._grad)
        self._offload.download_grad(device_grad, accumulate=self._grad is not None)

    def grad_bytes(self) -> int:
        """Bytes of gradient memory this shard holds on the host (never waits for a download)."""
        return self._offload.host_grad_bytes()
