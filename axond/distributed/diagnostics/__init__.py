"""How a distributed failure is reported: who failed, why, and what the others were doing.

    failure.py            a rank's uncaught exception aborts its groups with the root cause and writes the
                          worker's error file; `concise` trims what the user sees
    inflight.py           what each rank is blocked in, published to the job's store for its peers' timeouts
    job_report.py         the same, published by a process under `axond worker` to its job's coordinator store
                          when its groups use another store (torch's), for the worker and `axond status`
    stacks.py             a rank's Python stacks (every thread) on its worker's signal, through faulthandler
    monitored_barrier.py  a barrier through the store that names the ranks that did not arrive
"""
