from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RESTARTING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class NodeHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_HEALTH_UNSPECIFIED: _ClassVar[NodeHealth]
    NODE_HEALTH_ALIVE: _ClassVar[NodeHealth]
    NODE_HEALTH_SUSPECT: _ClassVar[NodeHealth]
    NODE_HEALTH_DEAD: _ClassVar[NodeHealth]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RESTARTING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
NODE_HEALTH_UNSPECIFIED: NodeHealth
NODE_HEALTH_ALIVE: NodeHealth
NODE_HEALTH_SUSPECT: NodeHealth
NODE_HEALTH_DEAD: NodeHealth

class RegisterNodeRequest(_message.Message):
    __slots__ = ("hostname", "slots", "daemon")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    slots: int
    daemon: bool
    def __init__(self, hostname: _Optional[str] = ..., slots: _Optional[int] = ..., daemon: _Optional[bool] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node_id", "heartbeat_interval_s", "dead_after_missed", "node_secret")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    DEAD_AFTER_MISSED_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    heartbeat_interval_s: float
    dead_after_missed: int
    node_secret: str
    def __init__(self, node_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., dead_after_missed: _Optional[int] = ..., node_secret: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "job", "generation", "node_secret", "local_pids")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PIDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    job: str
    generation: int
    node_secret: str
    local_pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., job: _Optional[str] = ..., generation: _Optional[int] = ..., node_secret: _Optional[str] = ..., local_pids: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("generation", "job_state", "reason", "heartbeat_interval_s", "live")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    job_state: JobState
    reason: str
    heartbeat_interval_s: float
    live: bool
    def __init__(self, generation: _Optional[int] = ..., job_state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., live: _Optional[bool] = ...) -> None: ...

class DeregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "node_secret")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_secret: str
    def __init__(self, node_id: _Optional[str] = ..., node_secret: _Optional[str] = ...) -> None: ...

class DeregisterNodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("job", "node_id", "nproc", "min_nodes", "max_nodes", "max_restarts", "timeout_s", "node_secret", "live_recovery")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NPROC_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    LIVE_RECOVERY_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    nproc: int
    min_nodes: int
    max_nodes: int
    max_restarts: int
    timeout_s: float
    node_secret: str
    live_recovery: bool
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., nproc: _Optional[int] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., max_restarts: _Optional[int] = ..., timeout_s: _Optional[float] = ..., node_secret: _Optional[str] = ..., live_recovery: _Optional[bool] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("generation", "node_rank", "nnodes", "rank_offset", "world_size", "local_world_size", "job_secret", "restarts_left")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NNODES_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    JOB_SECRET_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_LEFT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    node_rank: int
    nnodes: int
    rank_offset: int
    world_size: int
    local_world_size: int
    job_secret: bytes
    restarts_left: int
    def __init__(self, generation: _Optional[int] = ..., node_rank: _Optional[int] = ..., nnodes: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., local_world_size: _Optional[int] = ..., job_secret: _Optional[bytes] = ..., restarts_left: _Optional[int] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("job", "node_id", "generation", "rank", "exit_code", "message", "node_secret", "unreachable")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    generation: int
    rank: int
    exit_code: int
    message: str
    node_secret: str
    unreachable: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., message: _Optional[str] = ..., node_secret: _Optional[str] = ..., unreachable: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ("generation", "will_restart", "left_job")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WILL_RESTART_FIELD_NUMBER: _ClassVar[int]
    LEFT_JOB_FIELD_NUMBER: _ClassVar[int]
    generation: int
    will_restart: bool
    left_job: bool
    def __init__(self, generation: _Optional[int] = ..., will_restart: _Optional[bool] = ..., left_job: _Optional[bool] = ...) -> None: ...

class ReportExitRequest(_message.Message):
    __slots__ = ("job", "node_id", "generation", "exit_code", "node_secret")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    generation: int
    exit_code: int
    node_secret: str
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., generation: _Optional[int] = ..., exit_code: _Optional[int] = ..., node_secret: _Optional[str] = ...) -> None: ...

class ReportExitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvSetRequest(_message.Message):
    __slots__ = ("job", "generation", "key", "value")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    key: str
    value: bytes
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class KvSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvGetRequest(_message.Message):
    __slots__ = ("job", "generation", "key", "wait_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    key: str
    wait_s: float
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., key: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class KvGetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class KvAddRequest(_message.Message):
    __slots__ = ("job", "generation", "key", "delta", "request_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    key: str
    delta: int
    request_id: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., key: _Optional[str] = ..., delta: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class KvAddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class KvCompareAndSetRequest(_message.Message):
    __slots__ = ("job", "generation", "key", "expect_unset", "expected", "desired", "request_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECT_UNSET_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    key: str
    expect_unset: bool
    expected: bytes
    desired: bytes
    request_id: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., key: _Optional[str] = ..., expect_unset: _Optional[bool] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class KvCompareAndSetResponse(_message.Message):
    __slots__ = ("swapped", "is_set", "current")
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    IS_SET_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    swapped: bool
    is_set: bool
    current: bytes
    def __init__(self, swapped: _Optional[bool] = ..., is_set: _Optional[bool] = ..., current: _Optional[bytes] = ...) -> None: ...

class KvDeleteRequest(_message.Message):
    __slots__ = ("job", "generation", "key")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    key: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., key: _Optional[str] = ...) -> None: ...

class KvDeleteResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class KvWaitRequest(_message.Message):
    __slots__ = ("job", "generation", "keys", "wait_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    wait_s: float
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., wait_s: _Optional[float] = ...) -> None: ...

class KvWaitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("job", "generation", "name", "world_size", "participant", "wait_s", "arrival_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    name: str
    world_size: int
    participant: int
    wait_s: float
    arrival_id: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., name: _Optional[str] = ..., world_size: _Optional[int] = ..., participant: _Optional[int] = ..., wait_s: _Optional[float] = ..., arrival_id: _Optional[str] = ...) -> None: ...

class BarrierResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvOp(_message.Message):
    __slots__ = ("id", "set", "get", "add", "compare_set", "delete", "wait", "barrier")
    ID_FIELD_NUMBER: _ClassVar[int]
    SET_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    COMPARE_SET_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    BARRIER_FIELD_NUMBER: _ClassVar[int]
    id: int
    set: KvSetRequest
    get: KvGetRequest
    add: KvAddRequest
    compare_set: KvCompareAndSetRequest
    delete: KvDeleteRequest
    wait: KvWaitRequest
    barrier: BarrierRequest
    def __init__(self, id: _Optional[int] = ..., set: _Optional[_Union[KvSetRequest, _Mapping]] = ..., get: _Optional[_Union[KvGetRequest, _Mapping]] = ..., add: _Optional[_Union[KvAddRequest, _Mapping]] = ..., compare_set: _Optional[_Union[KvCompareAndSetRequest, _Mapping]] = ..., delete: _Optional[_Union[KvDeleteRequest, _Mapping]] = ..., wait: _Optional[_Union[KvWaitRequest, _Mapping]] = ..., barrier: _Optional[_Union[BarrierRequest, _Mapping]] = ...) -> None: ...

class KvStreamRequest(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[KvOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[KvOp, _Mapping]]] = ...) -> None: ...

class KvResult(_message.Message):
    __slots__ = ("id", "code", "message", "set", "get", "add", "compare_set", "delete", "wait", "barrier")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SET_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    COMPARE_SET_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    BARRIER_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    message: str
    set: KvSetResponse
    get: KvGetResponse
    add: KvAddResponse
    compare_set: KvCompareAndSetResponse
    delete: KvDeleteResponse
    wait: KvWaitResponse
    barrier: BarrierResponse
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., set: _Optional[_Union[KvSetResponse, _Mapping]] = ..., get: _Optional[_Union[KvGetResponse, _Mapping]] = ..., add: _Optional[_Union[KvAddResponse, _Mapping]] = ..., compare_set: _Optional[_Union[KvCompareAndSetResponse, _Mapping]] = ..., delete: _Optional[_Union[KvDeleteResponse, _Mapping]] = ..., wait: _Optional[_Union[KvWaitResponse, _Mapping]] = ..., barrier: _Optional[_Union[BarrierResponse, _Mapping]] = ...) -> None: ...

class KvStreamResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KvResult]
    def __init__(self, results: _Optional[_Iterable[_Union[KvResult, _Mapping]]] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("job", "nnodes", "nproc_per_node", "argv", "env", "max_restarts", "cwd", "min_nodes", "live_recovery")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    NNODES_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    LIVE_RECOVERY_FIELD_NUMBER: _ClassVar[int]
    job: str
    nnodes: int
    nproc_per_node: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    max_restarts: int
    cwd: str
    min_nodes: int
    live_recovery: bool
    def __init__(self, job: _Optional[str] = ..., nnodes: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., max_restarts: _Optional[int] = ..., cwd: _Optional[str] = ..., min_nodes: _Optional[int] = ..., live_recovery: _Optional[bool] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class PollWorkRequest(_message.Message):
    __slots__ = ("node_id", "wait_s", "node_secret")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    wait_s: float
    node_secret: str
    def __init__(self, node_id: _Optional[str] = ..., wait_s: _Optional[float] = ..., node_secret: _Optional[str] = ...) -> None: ...

class WorkAssignment(_message.Message):
    __slots__ = ("job", "nnodes", "nproc_per_node", "argv", "env", "max_restarts", "cwd", "min_nodes", "live_recovery")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    NNODES_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    LIVE_RECOVERY_FIELD_NUMBER: _ClassVar[int]
    job: str
    nnodes: int
    nproc_per_node: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    max_restarts: int
    cwd: str
    min_nodes: int
    live_recovery: bool
    def __init__(self, job: _Optional[str] = ..., nnodes: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., max_restarts: _Optional[int] = ..., cwd: _Optional[str] = ..., min_nodes: _Optional[int] = ..., live_recovery: _Optional[bool] = ...) -> None: ...

class PollWorkResponse(_message.Message):
    __slots__ = ("assignments", "cancelled")
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    assignments: _containers.RepeatedCompositeFieldContainer[WorkAssignment]
    cancelled: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, assignments: _Optional[_Iterable[_Union[WorkAssignment, _Mapping]]] = ..., cancelled: _Optional[_Iterable[str]] = ...) -> None: ...

class OutputLine(_message.Message):
    __slots__ = ("rank", "stream", "text")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    stream: str
    text: str
    def __init__(self, rank: _Optional[int] = ..., stream: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class PushOutputRequest(_message.Message):
    __slots__ = ("job", "node_id", "lines", "node_secret")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    NODE_SECRET_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    lines: _containers.RepeatedCompositeFieldContainer[OutputLine]
    node_secret: str
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., lines: _Optional[_Iterable[_Union[OutputLine, _Mapping]]] = ..., node_secret: _Optional[str] = ...) -> None: ...

class PushOutputResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("output", "finished", "info")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    output: OutputLine
    finished: JobFinished
    info: str
    def __init__(self, output: _Optional[_Union[OutputLine, _Mapping]] = ..., finished: _Optional[_Union[JobFinished, _Mapping]] = ..., info: _Optional[str] = ...) -> None: ...

class JobFinished(_message.Message):
    __slots__ = ("exit_code", "message")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    message: str
    def __init__(self, exit_code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "hostname", "health", "last_heartbeat_age_s", "slots", "daemon", "job")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    hostname: str
    health: NodeHealth
    last_heartbeat_age_s: float
    slots: int
    daemon: bool
    job: str
    def __init__(self, node_id: _Optional[str] = ..., hostname: _Optional[str] = ..., health: _Optional[_Union[NodeHealth, str]] = ..., last_heartbeat_age_s: _Optional[float] = ..., slots: _Optional[int] = ..., daemon: _Optional[bool] = ..., job: _Optional[str] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "node_id", "local_rank", "node_rank", "hostname", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    local_rank: int
    node_rank: int
    hostname: str
    pid: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., local_rank: _Optional[int] = ..., node_rank: _Optional[int] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "state", "generation", "world_size", "nnodes", "restarts", "max_restarts", "reason", "ranks", "min_nodes", "max_nodes", "joined_hosts", "ranks_omitted", "finished_age_s", "wall_s", "goodput")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NNODES_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    JOINED_HOSTS_FIELD_NUMBER: _ClassVar[int]
    RANKS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AGE_S_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    job: str
    state: JobState
    generation: int
    world_size: int
    nnodes: int
    restarts: int
    max_restarts: int
    reason: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    min_nodes: int
    max_nodes: int
    joined_hosts: _containers.RepeatedScalarFieldContainer[str]
    ranks_omitted: int
    finished_age_s: float
    wall_s: float
    goodput: _containers.RepeatedCompositeFieldContainer[GoodputPart]
    def __init__(self, job: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., nnodes: _Optional[int] = ..., restarts: _Optional[int] = ..., max_restarts: _Optional[int] = ..., reason: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., joined_hosts: _Optional[_Iterable[str]] = ..., ranks_omitted: _Optional[int] = ..., finished_age_s: _Optional[float] = ..., wall_s: _Optional[float] = ..., goodput: _Optional[_Iterable[_Union[GoodputPart, _Mapping]]] = ...) -> None: ...

class GoodputPart(_message.Message):
    __slots__ = ("cause", "seconds")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    cause: str
    seconds: float
    def __init__(self, cause: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("job", "all", "max_ranks")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    MAX_RANKS_FIELD_NUMBER: _ClassVar[int]
    job: str
    all: bool
    max_ranks: int
    def __init__(self, job: _Optional[str] = ..., all: _Optional[bool] = ..., max_ranks: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("nodes", "jobs")
    NODES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...
