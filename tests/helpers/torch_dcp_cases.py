"""The cases of tests/torch/test_torch_dcp.py: torch.distributed.checkpoint (DCP) over "axond", two forked ranks each.

    python tests/helpers/torch_dcp_cases.py --out results.json [--backend gloo] [CASE ...]

- async_save: an FSDP2 model's sharded state dict saved with `dcp.async_save` (which needs the default group to have a
  CPU backend), the model then changed, and `dcp.load` + `set_model_state_dict` must bring back the saved values;
- broadcast_from_rank0: a full (unsharded) state dict that only rank 0 holds, loaded into an FSDP2 model with
  `StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)` (as Lightning's FSDP2 resumes from a consolidated
  checkpoint); every rank's shards must then hold rank 0's values.
Each rank reports "ok" or what differed / what it raised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from forked_ranks import describe, join, run_ranks

OP_TIMEOUT = 30.0
"""The group's timeout (seconds)."""
CASE_DEADLINE = OP_TIMEOUT + 30.0
"""Seconds after which a case's ranks are killed."""


def fsdp_model(seed: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (gathered) state dict on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().clone() for k, v in full.items()}


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if got.keys() != want.keys():
        return [f"keys {sorted(got)} != {sorted(want)}"]
    return [k for k in want if not torch.equal(got[k], want[k])]


def async_save(rank: int, shared: str) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = fsdp_model(seed=1)
    saved = full_values(model)
    checkpoint = os.path.join(shared, "checkpoint")
    future = dcp.async_save({"model": get_model_state_dict(model)}, checkpoint_id=checkpoint)
    future.result()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert differences(full_values(model), saved), "the model did not change after the save"
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state["model"])
    return differences(full_values(model), saved)


def broadcast_from_rank0(rank: int, shared: str) -> list[str]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(7)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    want = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    model = fsdp_model(seed=1)
    assert differences(full_values(model), want), "the model already holds the values to load"
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    given = {k: v.clone() for k, v in want.items()} if rank == 0 else {}  # torch turns it into shards in place
    set_model_state_dict(model, given, options=options)
    return differences(full_values(model), want)


CASES: dict[str, Callable[[int, str], list[str]]] = {"async_save": async_save,
                                                      "broadcast_from_rank0": broadcast_from_rank0}


def rank_body(case: str, backend: str) -> Callable[[int, int, str], Any]:
    def body(rank: int, size: int, shared: str) -> Any:
        join(rank, size, shared, backend, OP_TIMEOUT)
        try:
            wrong = CASES[case](rank, shared)
        except Exception as e:
            return {"raised": describe(e)}
        dist.destroy_process_group()
        return {"ok": not wrong, "differ": wrong}

    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="axond", help="gloo: the same cases on torch's own backend")
    parser.add_argument("cases", nargs="*", help=f"default: every case ({', '.join(CASES)})")
    args = parser.parse_args()
    import axond.torch  # noqa: F401 -- imported once, before the ranks are forked
    import torch._dynamo
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.device_mesh
    import torch.distributed.fsdp  # noqa: F401

    results = {}
    for case in args.cases or list(CASES):
        results[case] = run_ranks(rank_body(case, args.backend), 2, CASE_DEADLINE)
        print(f"{case}: codes {results[case]['codes']} in {results[case]['seconds']} s", file=sys.stderr, flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
