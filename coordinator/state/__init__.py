"""The coordinator's state machine: plain, typed, thread-safe, driven with an explicit `now`; no gRPC.

    machine.py     `CoordinatorState`: a thin facade, each method one lock and a call to the component below
    context.py     `StateContext`: the job table, the limits, wake-ups and the journal the components share
    membership.py  registered nodes, node secrets, heartbeats, failure detection
    lifecycle.py   jobs from rendezvous to their end: join, freeze, generations, restarts, the job's end
    failures.py    lost nodes, failure and exit reports, live recovery's re-formation with the survivors
    growth.py      live recovery's growth: a node joining a running live job below MAX, beside its running ranks
    rendezvous.py  one rendezvous round: collect joiners, freeze the membership, assign ranks
    job_kv.py      the store calls of each job, scoped to its current generation
    kv_space.py    one generation's keys and barriers, charged to a byte budget
    scheduling.py  placement of submitted jobs on worker daemons
    submitted.py   `axond run` jobs: the queue, daemons' work, output, cancel
    jobs.py        job records and their event log
    status.py      read-only snapshots for GetStatus / `axond status`
    errors.py      the domain errors the service maps to status codes
    port.py        the storage port: `Persistence`, `Changes`, `Snapshot` (persistence/ implements it)
    journal.py     what changed since the last commit (`Journal`, `TxLock`), and `restore` from a commit
    records.py     the JSON-able records the state is kept as
"""
