"""A torch rank in a network-namespace host (tests/cluster/test_netns_torch.py): DDP over "axond" and over gloo.

`netns_torch.py RANK WORLD MASTER PORT OUT`: joins `tcp://MASTER:PORT` with no axond variable set, as a
torch script written for gloo would, trains the same small MLP under DDP on both backends and writes the
axond group's advertised address, its peer links and both models' parameters to OUT (rank 0's file).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import axond.torch  # noqa: F401 - registers the "axond" backend


def train(group: dist.ProcessGroup, rank: int) -> list[list[float]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).double()
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = torch.randn(8, 64, generator=gen, dtype=torch.float64), torch.randn(8, 1, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().flatten().tolist()[:32] for p in model.parameters()]


def main() -> None:
    rank, world, master, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("axond", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    gloo = dist.new_group(list(range(world)), backend="gloo")
    world_group = dist.group.WORLD
    assert isinstance(world_group, axond.torch.AxondProcessGroup), world_group  # torch's default group is ours
    backend = world_group.axond_group.backend
    ours, theirs = train(dist.group.WORLD, rank), train(gloo, rank)
    links = {str(p): [peer.sock.getsockname()[0], peer.sock.getpeername()[0]]
             for p, peer in backend.g.peers.items()}
    result = {"advertised": backend.placement.host, "links": links, "axond": ours, "gloo": theirs}
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
