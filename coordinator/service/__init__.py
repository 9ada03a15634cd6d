"""The coordinator's gRPC surface: proto in, a `CoordinatorState` call, proto out, domain errors as status codes.

    servicer.py          `CoordinatorServicer`: every Coordinator RPC, waiting ones as coroutines
    heartbeat_stream.py  heartbeats, unary and on each node's stream
    kv_calls.py          the store calls as coroutines, shared by the unary RPCs and the stream
    kv_stream.py         the store calls over one long-lived stream, many requests per message
    status_codes.py      domain errors -> gRPC status codes
    waiting.py           `WaitHub`: coroutines parked on state changes, no thread per waiter
    stall.py             `StallWatch`: time the process did not run counts against no node's lease
    admission.py         fair admission: no one client's calls or streams take the coordinator from the others
    auth.py              the shared-token check on every call but the health check
    decoding.py          request bodies that do not parse answered INVALID_ARGUMENT
"""
