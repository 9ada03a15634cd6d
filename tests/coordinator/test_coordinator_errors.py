"""Bad requests get the right status code and a clear message; the coordinator keeps serving."""

from __future__ import annotations

import grpc
import pytest

from axond.control.client import CoordinatorClient
from axond.v1 import coordinator_pb2 as pb

C = grpc.StatusCode


def code_of(call: object, request: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=5.0)  # type: ignore[operator]
    return info.value.code(), info.value.details()  # type: ignore[attr-defined]


def test_bad_requests_get_the_right_codes(client: CoordinatorClient) -> None:
    s = client.stub
    node = client.register_node("h").node_id
    sec = client.node_secret(node)
    assert client.join("j", node, 1, 1, 1, timeout=5.0).generation == 1
    cases = [
        (s.Heartbeat, pb.HeartbeatRequest(node_id=node), C.PERMISSION_DENIED, "missing node secret"),
        (s.Heartbeat, pb.HeartbeatRequest(node_id=node, node_secret="x" + sec), C.PERMISSION_DENIED, "wrong node secret"),
        (s.RegisterNode, pb.RegisterNodeRequest(hostname=""), C.INVALID_ARGUMENT, "hostname"),
        (s.RegisterNode, pb.RegisterNodeRequest(hostname="h", daemon=True), C.INVALID_ARGUMENT, "slots"),
        (s.Heartbeat, pb.HeartbeatRequest(node_id="nope"), C.NOT_FOUND, "register again"),
        (s.Heartbeat, pb.HeartbeatRequest(node_id=node, node_secret=sec, job="other"), C.NOT_FOUND, "unknown job"),
        (s.Join, pb.JoinRequest(job="k", node_id=node, node_secret=sec, nproc=1, min_nodes=3, max_nodes=2, timeout_s=1), C.INVALID_ARGUMENT, "MIN must be <= MAX"),
        (s.Join, pb.JoinRequest(job="k", node_id=node, node_secret=sec, nproc=0, min_nodes=1, max_nodes=1, timeout_s=1), C.INVALID_ARGUMENT, "nproc"),
        (s.Join, pb.JoinRequest(job="k", node_id=node, node_secret=sec, nproc=1, min_nodes=0, max_nodes=1, timeout_s=1), C.INVALID_ARGUMENT, "min_nodes"),
        (s.Join, pb.JoinRequest(job="k", node_id=node, node_secret=sec, nproc=1, min_nodes=1, max_nodes=1, timeout_s=0), C.INVALID_ARGUMENT, "timeout_s"),
        (s.Join, pb.JoinRequest(job="k", node_id="ghost", nproc=1, min_nodes=1, max_nodes=1, timeout_s=1), C.NOT_FOUND, "ghost"),
        (s.Join, pb.JoinRequest(job="bad name", node_id=node, node_secret=sec, nproc=1, min_nodes=1, max_nodes=1, timeout_s=1), C.INVALID_ARGUMENT, "whitespace"),
        (s.Join, pb.JoinRequest(job="j", node_id=node, node_secret=sec, nproc=1, min_nodes=1, max_nodes=2, timeout_s=1), C.FAILED_PRECONDITION, "same options"),
        (s.KvSet, pb.KvSetRequest(job="j", generation=1, key="", value=b"x"), C.INVALID_ARGUMENT, "non-empty"),
        (s.KvSet, pb.KvSetRequest(job="j", generation=1, key="k", value=bytes((1 << 20) + 1)), C.INVALID_ARGUMENT, "limit"),
        (s.KvSet, pb.KvSetRequest(job="nojob", generation=1, key="k"), C.NOT_FOUND, "unknown job"),
        (s.KvSet, pb.KvSetRequest(job="j", generation=7, key="k"), C.INVALID_ARGUMENT, "does not exist"),
        (s.KvGet, pb.KvGetRequest(job="j", generation=1, key="unset"), C.NOT_FOUND, "not set"),
        (s.KvGet, pb.KvGetRequest(job="j", generation=1, key="k", wait_s=-1), C.INVALID_ARGUMENT, "wait_s"),
        (s.KvGet, pb.KvGetRequest(job="j", generation=1, key="k", wait_s=1e9), C.INVALID_ARGUMENT, "limit"),
        (s.KvGet, pb.KvGetRequest(job="j", generation=1, key="k", wait_s=float("nan")), C.INVALID_ARGUMENT, "wait_s"),
        (s.KvWait, pb.KvWaitRequest(job="j", generation=1, keys=[], wait_s=1), C.INVALID_ARGUMENT, "at least one key"),
        (s.Barrier, pb.BarrierRequest(job="j", generation=1, name="b", world_size=2, participant=2, wait_s=1), C.INVALID_ARGUMENT, "participant 2"),
        (s.Barrier, pb.BarrierRequest(job="j", generation=1, name="b", world_size=0, participant=0, wait_s=1), C.INVALID_ARGUMENT, "participant"),
        (s.ReportFailure, pb.ReportFailureRequest(job="j", node_id=node, node_secret=sec, generation=1, rank=5), C.INVALID_ARGUMENT, "rank 5"),
        (s.ReportFailure, pb.ReportFailureRequest(job="j", node_id=node, node_secret=sec, generation=9, rank=0), C.INVALID_ARGUMENT, "generation 9"),
        (s.ReportExit, pb.ReportExitRequest(job="zz", node_id=node, node_secret=sec, generation=1), C.NOT_FOUND, "unknown job"),
        (s.PollWork, pb.PollWorkRequest(node_id=node, node_secret=sec, wait_s=-2), C.INVALID_ARGUMENT, "wait_s"),
        (s.PushOutput, pb.PushOutputRequest(job="j", node_id=node, node_secret=sec, lines=[pb.OutputLine(rank=0, stream="bogus")]), C.INVALID_ARGUMENT, "stream"),
        (s.CancelJob, pb.CancelJobRequest(job="none"), C.NOT_FOUND, "unknown job"),
        (s.GetStatus, pb.GetStatusRequest(job="none"), C.NOT_FOUND, "unknown job"),
    ]
    for call, request, want, text in cases:
        code, details = code_of(call, request)
        assert (code, text in details) == (want, True), f"{type(request).__name__}: {code} {details!r}"
    with pytest.raises(grpc.RpcError) as info:
        list(s.StreamJob(pb.StreamJobRequest(job="none"), timeout=5.0))
    assert info.value.code() == C.NOT_FOUND  # type: ignore[attr-defined]
    assert client.health() and client.get_status("j").jobs[0].state == pb.JOB_STATE_RUNNING


def test_client_checks_counts_before_sending(client: CoordinatorClient) -> None:
    from axond.errors import CoordinatorError

    with pytest.raises(CoordinatorError, match="nproc is -1"):
        client.join("j", "n", -1, 1, 1)
