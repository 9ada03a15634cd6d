"""The coordinator daemon (installed as axond.coordinator).

    server.py      build, start and stop it: `CoordinatorConfig`, `start_coordinator`, `run_coordinator`
    replica.py     one replica of several on etcd: follow, and lead when elected
    limits.py      `CoordinatorLimits`, every bound on what callers can make it hold or do
    service/       the gRPC surface: servicer, streams, waiting calls, status codes, admission, auth
    state/         the state machine: plain, thread-safe, no gRPC
    persistence/   the durable state: SQLite, memory or etcd, and the group commit
"""
