"""One coordinator replica on etcd (`--state etcd://...`): follow, and lead when elected.

A follower serves a small gRPC server on the replica's port that answers every Coordinator call
UNAVAILABLE, naming the leader's address in the details and in the `axond-leader` trailing metadata
(clients given every replica's address go there), and polls the leader key. When the key is free it
campaigns; the winner stops its follower server, loads the state from etcd and serves it with the
normal coordinator server on the same port. The term ends when the lease is lost (or a guarded
commit is refused): the leader server stops at once, without grace, and the replica follows again
(a later win loads the state afresh). A clean stop resigns, so a follower takes over at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from axond.coordinator.service.auth import TokenInterceptor, replace_handler
from axond.coordinator.persistence.etcd import EtcdClient, EtcdError, EtcdPersistence, LeaderElection, Term
from axond.coordinator.persistence.etcd import parse_state_url
from axond.coordinator.config import (SERVER_OPTIONS, SERVICE_NAME, CoordinatorConfig, client_address,
                                      resolve_server_token, server_credentials)
from axond.coordinator.serving import RunningCoordinator, serve_state
from axond.coordinator.state.machine import CoordinatorState
from axond.errors import CoordinatorError

log = logging.getLogger("axond.coordinator")

LEADER_METADATA = "axond-leader"
"""Trailing metadata key of a follower's answer: the leader's HOST:PORT."""
POLL_S = 0.25
"""How often a follower looks at the leader key."""


class _Redirect(grpc.GenericRpcHandler):
    """Every Coordinator method: UNAVAILABLE, naming the leader."""

    def __init__(self, election: LeaderElection) -> None:
        self._election = election
        self._handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(self._answer)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        return self._handler if method.startswith(f"/{SERVICE_NAME}/") else None

    async def _answer(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        leader = self._election.leader_hint
        me = self._election.address
        if leader is None or leader == me:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"this coordinator replica ({me}) is a follower and no leader is elected yet; "
                                "retry in a moment")
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"this coordinator replica ({me}) is a follower; the leader is at {leader}: send calls there "
            "(clients given every replica's address, --coordinator h1:p1,h2:p2, do so themselves)",
            trailing_metadata=((LEADER_METADATA, leader),),
        )
        return b""


class _LeaderGate(grpc.aio.ServerInterceptor):
    """Refuses every Coordinator call once the term may have ended (before the server has stopped)."""

    def __init__(self, term: Term) -> None:
        self._term = term

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or self._term.leads() or not method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        address = self._term.address

        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"this coordinator replica ({address}) is no longer the leader; retry (clients given "
                                "every replica's address find the new leader)")

        return replace_handler(handler, behavior=refuse)


def _advertise(config: CoordinatorConfig, port: int) -> str:
    if config.advertise:
        return config.advertise
    if config.host in ("", "0.0.0.0", "::", "[::]"):
        return f"{socket.getfqdn()}:{port}"
    return client_address(config.host, port)


async def _follower_server(config: CoordinatorConfig, token: str | None, election: LeaderElection) -> tuple[grpc.aio.Server, int]:
    interceptors: list[grpc.aio.ServerInterceptor] = [TokenInterceptor(token)] if token else []
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((_Redirect(election),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    creds = server_credentials(config)
    try:
        port = server.add_secure_port(bind, creds) if creds is not None else server.add_insecure_port(bind)
    except RuntimeError as e:
        raise CoordinatorError(f"cannot listen on {bind}: {e}; is another coordinator using the port?") from e
    if port == 0:
        raise CoordinatorError(f"cannot listen on {bind}; is another coordinator using the port?")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, port


async def _until_elected(election: LeaderElection, stop: asyncio.Event) -> Term | None:
    """Poll (and campaign) until this replica leads (its term) or the replica stops (None)."""
    reported = False
    while not stop.is_set():
        try:
            term = await asyncio.to_thread(election.try_lead)
            if term is not None:
                return term
            reported = False
        except EtcdError as e:
            if not reported:
                log.error("cannot reach etcd to elect a leader (%s); retrying", e)
                reported = True
        try:
            await asyncio.wait_for(stop.wait(), POLL_S)
        except asyncio.TimeoutError:
            pass
    return None


async def _lead(config: CoordinatorConfig, outer: RunningCoordinator, client: EtcdClient, prefix: str,
                election: LeaderElection, term: Term, stop: asyncio.Event) -> None:
    """Serve the state as the leader of `term` until the replica stops or the term ends."""
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    term.on_lost = lambda: loop.call_soon_threadsafe(ended.set)
    try:
        state = await asyncio.to_thread(
            CoordinatorState, config.heartbeat_interval, config.dead_after_missed, config.settle_time,
            fence_margin=config.fence_margin, limits=config.limits, persistence=EtcdPersistence(client, prefix, term),
        )
    except EtcdError as e:
        log.error("could not load the state from etcd (%s); following again", e)
        election.resign(term)
        return
    if not term.leads():
        return
    inner = RunningCoordinator(outer.port, outer.address, state, outer.token, outer.token_path)
    inner._stop_request = asyncio.Event()
    outer.state = state
    serving = asyncio.create_task(serve_state(config, inner, [], threading.Event(), on_commit_failure=ended.set,
                                                gates=[_LeaderGate(term)]))
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(ended.wait())]
    await asyncio.wait([serving, *waits], return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    inner._grace = outer._grace if stop.is_set() and term.leads() else 0.0
    inner._stop_request.set()
    try:
        await serving  # raises if the leader's server could not start: the term is given up all the same
    finally:
        if term.leads():
            await asyncio.to_thread(election.resign, term)
        else:
            term.ended.set()
            log.error("replica %s stopped serving: no longer the leader", outer.address)


async def serve_replica(config: CoordinatorConfig, running_box: list[RunningCoordinator], ready: threading.Event) -> None:
    """Run one replica until its stop is requested (see the module doc)."""
    assert config.state is not None
    endpoints, prefix = parse_state_url(config.state)
    token, token_path = resolve_server_token(config)
    client = EtcdClient(endpoints)
    election = LeaderElection(client, prefix, "", config.leader_ttl)
    stop = asyncio.Event()
    outer = RunningCoordinator(config.port, "", CoordinatorState(
        config.heartbeat_interval, config.dead_after_missed, config.settle_time, fence_margin=config.fence_margin,
        limits=config.limits,
    ), token, Path(token_path) if token_path else None)
    outer._loop, outer._stop_request = asyncio.get_running_loop(), stop
    try:
        while not stop.is_set():
            follower, port = await _follower_server(config, token, election)
            if not running_box:
                config = dataclasses.replace(config, port=port)
                outer.port, outer.address = port, _advertise(config, port)
                election.address = outer.address
                running_box.append(outer)
                ready.set()
            term = await _until_elected(election, stop)
            await follower.stop(0)
            if term is None:
                break
            await _lead(config, outer, client, prefix, election, term, stop)
    finally:
        client.close()
