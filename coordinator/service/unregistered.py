"""Serve a generated gRPC service through its generic handler only, not as registered methods.

grpc.aio's server keeps one pending "request call" per registered method (and one for all the rest), and
for every call it accepts it waits on all of them with `asyncio.wait`: work that grows with the number of
registered methods, on the event loop, for every call. The Coordinator service has 21 methods: served as
registered methods, that wait cost the coordinator about a tenth of its event loop in a rendezvous of
10,000 nodes. Its generic handler serves the same methods (the same handlers, the same interceptors) from
one pending request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc

S = TypeVar("S")


class _GenericOnly:
    """What a generated `add_*Servicer_to_server` sees as the server: it takes the generic handler and drops the
    registered-method table (the generic handler holds the same handlers)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        pass


def add_unregistered(add: Callable[[S, Any], None], servicer: S, server: grpc.aio.Server) -> None:
    """`add(servicer, server)` (a generated `add_*Servicer_to_server`), its methods served as unregistered ones."""
    add(servicer, _GenericOnly(server))
