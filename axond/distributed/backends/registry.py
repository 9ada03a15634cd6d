"""A tiny registry of backends by name; the nccl backend can run only where CuPy imports, the mpi backend only where
mpi4py does (`is_available` says what to install)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from axond.distributed.backends.base import Backend, BackendOptions
from axond.errors import BackendUnavailable
from axond.store import Store

_MODULES = {"tcp": "axond.distributed.backends.tcp", "nccl": "axond.distributed.backends.nccl",
            "mock": "axond.distributed.backends.mock", "mpi": "axond.distributed.backends.mpi",
            "staging": "axond.distributed.backends.nccl.staging",
            "gpu-auto": "axond.distributed.backends.nccl.auto"}
"""Backend name -> module or package defining it (its `BACKEND`); imported lazily so that CuPy is only touched when
asked for. "mock" joins
threads of one process without sockets, for tests (see `axond.testing`)."""


DEFAULT = "tcp"
"""The backend a group gets where none is named (`create_group`, the torch backend without AXOND_TORCH_BACKEND)."""


def backend_class(name: str) -> type[Backend]:
    """Return the backend class registered as `name`, or raise `BackendUnavailable` saying why."""
    module_name = _MODULES.get(name)
    if module_name is None:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of {sorted(_MODULES)} or 'auto'")
    module = importlib.import_module(module_name)
    cls: type[Backend] = module.BACKEND
    ok, why = cls.is_available()
    if not ok:
        raise BackendUnavailable(f"backend {name!r} cannot run here: {why}")
    return cls


def backend_classes() -> dict[str, type[Backend]]:
    """Every registered backend class by name, whether or not it can run here (imports their modules, not CuPy)."""
    return {name: importlib.import_module(module).BACKEND for name, module in _MODULES.items()}


def check_options(options: BackendOptions) -> None:
    """Raise TypeError unless each backend's own options in `options` name a registered backend that declares an
    options class, and are an instance of it (`BackendOptions(tcp=TcpOptions(...))`)."""
    for name, given in options.per_backend.items():
        module_name = _MODULES.get(name)
        if module_name is None:
            raise TypeError(f"BackendOptions({name}=...): no backend is named {name!r}; a backend's own options go "
                            f"by its name ({', '.join(f'{n}=...' for n in sorted(_MODULES))}), and tcp's port and "
                            "handshake timeout are TcpOptions fields")
        wanted = importlib.import_module(module_name).BACKEND.options_class
        if wanted is None:
            raise TypeError(f"BackendOptions({name}=...): the {name} backend takes no options of its own")
        if not isinstance(given, wanted):
            raise TypeError(f"BackendOptions({name}=...) must be a {wanted.__module__}.{wanted.__name__}, "
                            f"got {type(given).__name__}")


def options_class(name: str) -> Any:
    """The options class the backend registered as `name` declares (None: it takes none); imports no CuPy."""
    module_name = _MODULES.get(name)
    if module_name is None:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of {sorted(_MODULES)}")
    return importlib.import_module(module_name).BACKEND.options_class


def create_backend(
    name: str, store: Store, rank: int, size: int, group_name: str, options: BackendOptions
) -> Backend:
    """Build the communicator of one group member with the backend registered as `name` (`options` checked first)."""
    check_options(options)
    return backend_class(name)(store, rank, size, group_name, options)


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine."""
    names = []
    for name in _MODULES:
        try:
            backend_class(name)
        except (BackendUnavailable, ImportError):
            continue
        names.append(name)
    return names


def resolve_backend(name: str) -> str:
    """Map "auto" to "gpu-auto" where CuPy is installed (the members then choose NCCL or the staging path together,
    see `axond.distributed.backends.nccl.auto`), else "tcp"; other names pass."""
    if name != "auto":
        backend_class(name)
        return name
    return "gpu-auto" if importlib.util.find_spec("cupy") is not None else "tcp"
