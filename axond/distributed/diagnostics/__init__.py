"""How a distributed failure is reported: who failed, why, and what the others were doing.

    failure.py            a rank's uncaught exception aborts its groups with the root cause and writes the
                          worker's error file; `concise` trims what the user sees
    inflight.py           what each rank is blocked in, published to the job's store for its peers' timeouts
    monitored_barrier.py  a barrier through the store that names the ranks that did not arrive
"""
