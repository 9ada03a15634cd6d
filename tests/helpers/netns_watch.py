"""Watch a coordinator from inside a namespace host: print each change of a node's health or a job's state.

    python netns_watch.py ADDRESS TOKEN SECONDS

Lines: `NETNS-NODE t=<wall time> node=<id> host=<hostname> health=<alive|suspect|dead|gone>` and
`NETNS-JOB t=<wall time> job=<name> state=<state> reason=<text>`; wall times (time.time) compare with
the test's, as every namespace shares the machine's clock.
"""

from __future__ import annotations

import sys
import time

from axond.control.client import connect
from axond.errors import CoordinatorError
from axond.v1 import coordinator_pb2 as pb


def main() -> int:
    address, token, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    nodes: dict[str, str] = {}
    jobs: dict[str, str] = {}
    deadline = time.monotonic() + seconds
    with connect(address, token=token, call_timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                status = client.get_status()
            except CoordinatorError as e:
                print(f"NETNS-WATCH-ERROR t={time.time():.3f} {e}", flush=True)
                time.sleep(0.1)
                continue
            now = time.time()
            seen = set()
            for n in status.nodes:
                seen.add(n.node_id)
                health = pb.NodeHealth.Name(n.health).removeprefix("NODE_HEALTH_").lower()
                if nodes.get(n.node_id) != health:
                    nodes[n.node_id] = health
                    print(f"NETNS-NODE t={now:.3f} node={n.node_id} host={n.hostname} health={health}", flush=True)
            for gone in set(nodes) - seen:
                if nodes[gone] != "gone":
                    nodes[gone] = "gone"
                    print(f"NETNS-NODE t={now:.3f} node={gone} host=? health=gone", flush=True)
            for j in status.jobs:
                state = pb.JobState.Name(j.state).removeprefix("JOB_STATE_").lower()
                if jobs.get(j.job) != state:
                    jobs[j.job] = state
                    print(f"NETNS-JOB t={now:.3f} job={j.job} state={state} reason={j.reason}", flush=True)
            time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
