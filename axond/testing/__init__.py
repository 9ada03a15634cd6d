"""Form real groups of threads or processes on loopback, without a worker launch (tests, benchmarks).

Both kinds of helper join every rank with a timeout and re-raise the first rank's failure with its
traceback, naming the rank (`RankFailed`). Threads (`threads`) can also form groups on the network-free
"mock" backend (`run_threads(fn, n, backend="mock")`), which opens no socket; processes (`processes`,
`module_ranks`) are spawned with a FileStore directory of their own. See docs/testing.md.
"""

from axond.store.file import FileStore
from axond.testing.failures import RankFailed
from axond.testing.module_ranks import run_module_ranks
from axond.testing.processes import collect_from_processes, run_processes
from axond.testing.threads import node_hosts, run_on, run_threads, thread_groups

__all__ = ["FileStore", "RankFailed", "collect_from_processes", "node_hosts", "run_module_ranks", "run_on",
           "run_processes", "run_threads", "thread_groups"]
