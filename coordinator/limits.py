"""Every bound on what callers can make the coordinator hold or do, in one options dataclass.

A request past a limit is refused with INVALID_ARGUMENT (a field too large), RESOURCE_EXHAUSTED
(the coordinator is full) or OUT_OF_RANGE (a counter would overflow), naming the limit; nothing
a client sends can grow the coordinator's memory or per-call work without bound.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from axond.coordinator.state.errors import MAX_KEY_CHARS, MAX_NAME_CHARS


@dataclass(frozen=True)
class CoordinatorLimits:
    """Coordinator limits (fields of `CoordinatorConfig.limits`)."""

    max_nodes: int = 20_000
    """Registered nodes; dead nodes are forgotten first when it is reached."""
    max_heartbeat_rate: float = 500.0
    """Heartbeats per second all nodes together are asked for: past this many nodes per heartbeat interval,
    every node's interval (and so its lease) grows to nodes / rate."""
    max_jobs: int = 10_000
    """Job records; finished and abandoned jobs are forgotten (oldest first) when it is reached."""
    max_nnodes: int = 16_384
    """Nodes in one job (the MAX of --nnodes)."""
    max_nproc_per_node: int = 1_024
    """Rank processes on one node (--nproc-per-node, --slots)."""
    max_world_size: int = 1 << 20
    """Ranks in one job generation."""
    max_name_chars: int = MAX_NAME_CHARS
    """Characters in a job, host or barrier name."""
    max_key_chars: int = MAX_KEY_CHARS
    """Characters in a store key."""
    max_store_bytes_per_job: int = 256 << 20
    """Bytes of keys, values and barrier arrivals one job generation's store may hold."""
    max_store_bytes: int = 1 << 30
    """Bytes of keys, values and barrier arrivals all stores together may hold."""
    max_wait_keys: int = 1_024
    """Keys one KvWait may wait for."""
    max_queued_jobs: int = 1_000
    """Submitted jobs waiting for worker daemons."""
    max_command_bytes: int = 256 << 10
    """Bytes of one submitted job's argv, environment and working directory together."""
    max_output_bytes_per_job: int = 64 << 20
    """Output bytes kept per job; the oldest lines are dropped past it and the stream says so."""
    max_status_ranks: int = 65_536
    """Ranks listed per job in one GetStatus (the request's max_ranks is capped to it)."""
    default_status_ranks: int = 1_024
    """Ranks listed per job when GetStatus does not say (max_ranks = 0)."""
    max_concurrent_calls: int = 50_000
    """Calls served at once, long-polls and streams included, besides the liveness calls (below); past it a call
    is refused at once (RESOURCE_EXHAUSTED) and clients retry it with jittered backoff."""
    max_calls_per_client: int = 2_000
    """Calls and streams of the general pool one client connection may hold at once (see
    coordinator/service/admission.py)."""
    max_calls_per_address: int = 10_000
    """Calls and streams of the general pool the clients at one IP address may hold at once, over all their
    connections."""
    max_liveness_calls: int = 25_000
    """Calls served at once from the pool reserved for status, heartbeats (one stream per node), new nodes and a
    node's reports: floods of other calls never take it (the health check is never counted)."""
    max_liveness_calls_per_client: int = 1_000
    """Liveness calls one client connection may hold at once."""
    max_liveness_calls_per_address: int = 5_000
    """Liveness calls the clients at one IP address may hold at once, over all their connections."""
    max_request_bytes: int = 512 << 20
    """Bytes of decoded requests (and KvStream messages whose requests wait) that running calls may hold all
    together; past it a request is refused before it is decoded (one message is at most 8 MiB, the server's limit)."""
    max_request_bytes_per_address: int = 128 << 20
    """Bytes of decoded requests (and KvStream messages whose requests wait) the running calls from one IP address
    may hold."""
    stream_idle_s: float = 60.0
    """Seconds a KvStream may stay open with no request and nothing in flight before the coordinator ends it
    (UNAVAILABLE; the client opens another when it next needs one)."""
    max_commit_batch: int = 5_000
    """Durable state: changed calls one group commit gathers; a call that finds that many waiting for the next
    commit waits for the one in flight before it runs."""
    commit_timeout_s: float = 10.0
    """Durable state: seconds an answer waits for the commit of its change; past it the call answers UNAVAILABLE."""
    status_retention_s: float = 600.0
    """Seconds finished jobs and dead nodes stay in the default status (GetStatus all=true shows them longer)."""

    def validate(self) -> None:
        """Raise ValueError naming the first field that is not positive."""
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"coordinator limit {f.name} is {value}; it must be > 0")
        if self.default_status_ranks > self.max_status_ranks:
            raise ValueError("default_status_ranks must be <= max_status_ranks")
