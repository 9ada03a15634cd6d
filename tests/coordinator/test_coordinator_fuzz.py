"""Property test: arbitrary field values and raw bodies on every Coordinator RPC get expected codes only.

Strategies are built from the proto descriptors, so a new RPC or field is fuzzed without editing
this file. The coordinator must answer every request with a status a client can act on (never
INTERNAL or UNKNOWN), stay alive, and keep its memory bounded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axond.control.client import connect
from axond.coordinator.limits import CoordinatorLimits
from axond.coordinator.server import CoordinatorConfig, RunningCoordinator, start_coordinator
from axond.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.slow  # over 10,000 fuzzed requests

C = grpc.StatusCode
EXPECTED = {
    C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.ALREADY_EXISTS, C.RESOURCE_EXHAUSTED,
    C.PERMISSION_DENIED, C.OUT_OF_RANGE, C.DEADLINE_EXCEEDED,
}
SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
EXAMPLES = 320
"""Examples per run; each sends one structured and one raw request to every RPC (> 10,000 in all)."""
CALL_TIMEOUT = 0.3
"""Client deadline: bounds every wait a fuzzed request can ask for."""

INTS = {
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[RunningCoordinator, dict[str, str]]]:
    """A coordinator with small limits, a registered node and a running job to aim at."""
    limits = CoordinatorLimits(max_nodes=500, max_jobs=200, max_store_bytes=16 << 20, max_store_bytes_per_job=4 << 20,
                               max_queued_jobs=50, max_output_bytes_per_job=1 << 20)
    running = start_coordinator(CoordinatorConfig(host="127.0.0.1", port=0, token="fuzz", limits=limits, in_memory=True))
    with connect(running.address, token="fuzz", call_timeout=5.0) as c:
        node = c.register_node("host-a").node_id
        c.join("j", node, 2, 1, 1, timeout=5.0)
        known = {"node": node, "secret": c.node_secret(node)}
    try:
        yield running, known
    finally:
        running.stop(grace=0.2)


def _strings(known: dict[str, str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(["", "j", "default", "k", "host-a", known["node"], known["secret"], "n1-zzzz"]),
        st.text(max_size=40),
        st.text(alphabet=st.characters(codec="utf-8"), min_size=200, max_size=400),
        st.just("x" * 100_000),
    )


def _doubles() -> st.SearchStrategy[float]:
    return st.one_of(
        st.just(0.0), st.floats(min_value=0.0, max_value=0.02),
        st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e300, 86_401.0, -0.0, 5e-324]),
    )


def _field(f: FieldDescriptor, known: dict[str, str]) -> st.SearchStrategy[Any]:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        return _message(f.message_type, known)
    if f.type == FieldDescriptor.TYPE_STRING:
        return _strings(known)
    if f.type == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"9" * 20), st.just(bytes((1 << 20) + 1)))
    if f.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if f.type == FieldDescriptor.TYPE_DOUBLE:
        return _doubles()
    if f.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values])
    lo, hi = INTS[f.type]
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0, 1, 2, 3]))


def _message(d: Descriptor, known: dict[str, str]) -> st.SearchStrategy[dict[str, Any]]:
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for f in d.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            parts[f.name] = st.dictionaries(_field(key, known), _field(value, known), max_size=4)
        elif f.is_repeated:
            parts[f.name] = st.lists(_field(f, known), max_size=5)
        else:
            parts[f.name] = _field(f, known)
    return st.fixed_dictionaries({}, optional=parts)


def _build(cls: Any, values: dict[str, Any]) -> Any:
    msg = cls()
    for name, value in values.items():
        f = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(msg, name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            target.update(value)
        elif f.is_repeated and f.message_type is not None:
            for item in value:
                target.append(_build(f.message_type._concrete_class, item))
        elif f.is_repeated:
            target.extend(value)
        elif f.message_type is not None:
            target.CopyFrom(_build(f.message_type._concrete_class, value))
        else:
            setattr(msg, name, value)
    return msg


def _send(channel: grpc.Channel, method: Any, body: bytes) -> grpc.StatusCode:
    path = f"/{SERVICE.full_name}/{method.name}"
    auth = [("authorization", "Bearer fuzz")]
    try:
        if method.server_streaming:
            for _ in channel.unary_stream(path)(body, timeout=CALL_TIMEOUT, metadata=auth):
                pass
        else:
            channel.unary_unary(path)(body, timeout=CALL_TIMEOUT, metadata=auth)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[attr-defined, no-any-return]
    return C.OK


@pytest.mark.timeout(600)
def test_every_rpc_answers_arbitrary_requests_with_expected_codes(
    target: tuple[RunningCoordinator, dict[str, str]],
) -> None:
    running, known = target
    methods = list(SERVICE.methods)
    requests = {m.name: _message(m.input_type, known) for m in methods}
    sent: list[tuple[str, grpc.StatusCode]] = []
    rss_before = _rss_bytes()
    channel = grpc.insecure_channel(running.address, options=[("grpc.max_send_message_length", 8 << 20)])

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        for m in methods:
            request = _build(m.input_type._concrete_class, data.draw(requests[m.name], label=m.name))
            raw = data.draw(st.binary(max_size=48), label="raw")
            for body in (request.SerializeToString(), raw):
                got = _send(channel, m, body)
                sent.append((m.name, got))
                assert got in EXPECTED, f"{m.name} answered {got.name} to {request!r:.300} / raw {raw!r}"

    try:
        run()
    finally:
        channel.close()
    assert len(sent) >= 10_000, f"only {len(sent)} requests were sent"
    assert {name for name, code in sent if code != C.OK} >= {m.name for m in methods if m.name != "GetStatus"}
    with connect(running.address, token="fuzz", call_timeout=5.0) as c:
        assert c.health() and c.get_status("j").jobs[0].job == "j", "the coordinator still serves"
    grown = _rss_bytes() - rss_before
    assert grown < 400 << 20, f"the process grew by {grown >> 20} MiB under fuzzing"
