"""One torchft replica group of one process, started by bench/torchft_compare.py (not run by hand).

torchft's own training-loop shape: a `ProcessGroupGloo` across replica groups, a `Manager` that asks the Lighthouse
for a quorum each step (`start_quorum` in `OptimizerWrapper.zero_grad`), the gradient averaged by `Manager.allreduce`
(one flat buffer after backward; `--ddp`: torchft's `DistributedDataParallel`, whose comm hook does the same per
bucket), and the optimizer stepped only when `should_commit()` agrees.
The model, data and optimizer are bench/recovery_mlp.py's (those of bench/recovery.py); replica group r trains on
shard r of each step's samples, chosen by the committed step, so that a step that was not committed runs again
with the same samples, and a replica that heals from a peer takes up the step it was given.

Records in OUT: `steps-R-PID.jsonl` (each committed step: its number, the participants, time.monotonic()),
`errors-R-PID.jsonl` (each step whose gradient all_reduce failed: when it was seen, and the error), `end-R-PID.npz`
(the final parameters) and `end-R-PID.json` (batches committed). Replica HANG_REPLICA's first process stops in step
HANG_STEP + 1 once its quorum is in (writes `hang-PID`, then waits for a file `go` in OUT) so that the driver can
fault it while the others wait for it in that step's gradient all_reduce. `--pace S`: each replica sleeps S seconds
after a step committed by fewer than all replica groups (the job then lasts until a restarted replica is back).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import recovery_mlp as mlp
import torch
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.checkpointing import HTTPTransport
from torchft.optim import OptimizerWrapper

HANG_S = 120.0


class _Transport(HTTPTransport[dict[str, object]]):
    """torchft's HTTP checkpoint transport (what a healing replica pulls the state from), advertised at this host's
    address: its own address is `socket.gethostname()`, which a namespace host's peers cannot resolve."""

    def __init__(self, addr: str, timeout: timedelta) -> None:
        self._addr = addr  # before the base class starts its server, which asks for the address
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        return f"http://{self._addr}:{self._server.socket.getsockname()[1]}/checkpoint/"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("replica", type=int)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--addr", default="127.0.0.1", help="this host's address (the group's store, the manager)")
    parser.add_argument("--timeout", type=float, default=60.0, help="Manager and Gloo timeout (s)")
    parser.add_argument("--quorum-timeout", type=float, default=60.0)
    parser.add_argument("--hang-step", type=int, default=-1)
    parser.add_argument("--hang-replica", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=mlp.REPLICAS, help="replica groups of the job")
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--pace", type=float, default=0.0, help="sleep after each step committed below full size")
    parser.add_argument("--ddp", action="store_true", help="torchft.DistributedDataParallel (its comm hook) instead of "
                        "one Manager.allreduce of the flattened gradient after backward")
    args = parser.parse_args()
    torch.manual_seed(args.replica)
    torch.set_num_threads(1)
    out, r, pid = args.out, args.replica, os.getpid()
    store = TCPStore(args.addr, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)
    model = mlp.torch_mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, object]) -> None:
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        inner.load_state_dict(state["optim"])  # type: ignore[arg-type]

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=args.min_replicas, timeout=timeout,
                      quorum_timeout=timedelta(seconds=args.quorum_timeout), rank=0, world_size=1,
                      store_addr=args.addr, store_port=store.port, lighthouse_addr=args.lighthouse,
                      replica_id=f"replica_{r}", hostname=args.addr,
                      checkpoint_transport=_Transport(args.addr, timeout))
    ddp = DistributedDataParallel(manager, model) if args.ddp else model
    params = list(model.parameters())
    optimizer = OptimizerWrapper(manager, inner)
    x_all, y_all = (torch.from_numpy(a) for a in mlp.data())
    steps = open(out / f"steps-{r}-{pid}.jsonl", "a", encoding="utf-8")  # closed at exit
    errors = open(out / f"errors-{r}-{pid}.jsonl", "a", encoding="utf-8")
    hangs = r == args.hang_replica and args.hang_step >= 0
    try:
        while manager.current_step() < mlp.steps(args.replicas):
            optimizer.zero_grad()  # start_quorum
            step = manager.current_step()
            if hangs and step == args.hang_step and not any(out.glob("hang-*")):
                manager.wait_quorum()
                (out / f"hang-{pid}").write_text(str(time.time()))
                deadline = time.monotonic() + HANG_S
                while time.monotonic() < deadline and not (out / "go").exists():
                    time.sleep(0.01)
            index = torch.from_numpy(mlp.batch_indices(r, step, args.replicas))
            loss = torch.nn.functional.cross_entropy(ddp(x_all[index]), y_all[index])
            loss.backward()  # with --ddp, the all_reduce of the gradient across the quorum's replica groups
            if not args.ddp:
                flat = torch.cat([q.grad.reshape(-1) for q in params])  # type: ignore[union-attr]
                manager.allreduce(flat).wait()  # averaged over the participants; an error is reported, not raised
                torch.nn.utils.vector_to_parameters(flat, [q.grad for q in params])  # type: ignore[misc]
            error = manager.errored()
            if error is not None:
                errors.write(json.dumps({"step": step, "mono": time.monotonic(),
                                         "error": str(error.original_exception)[:300]}) + "\n")
                errors.flush()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if manager.should_commit():
                inner.step()
                steps.write(json.dumps({"step": manager.current_step(), "participants": manager.num_participants(),
                                        "loss": float(loss.detach()), "mono": time.monotonic()}) + "\n")
                steps.flush()
                if args.pace and manager.num_participants() < args.replicas:
                    time.sleep(args.pace)
        np.savez(out / f"end-{r}-{pid}.npz", **{k: v.detach().numpy() for k, v in model.state_dict().items()})
        (out / f"end-{r}-{pid}.json").write_text(json.dumps({"batches_committed": manager.batches_committed(),
                                                             "mono": time.monotonic()}))
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
