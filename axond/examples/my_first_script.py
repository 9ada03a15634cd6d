"""The README's walkthrough: DDP training of an `axond.nn` MLP, in the shape of any data-parallel script.

    axond worker --standalone --nproc-per-node 2 -- python -m axond.examples.my_first_script
"""

from __future__ import annotations

import numpy as np

import axond
from axond import nn
from axond.nn.optim import SGD
from axond.parallel import DDP, DistributedSampler


def main(epochs: int = 3, batch_size: int = 64) -> float:
    axond.init_process_group()                         # rank, world size and peers come from `axond worker`
    rng = np.random.default_rng(0)                     # same seed on every rank: same data, same model
    x = rng.standard_normal((4096, 16)).astype(np.float32)
    y = (x[:, :4].sum(axis=1) > 0).astype(np.int64)    # a rule the model can learn
    model = nn.Sequential(nn.Linear(16, 64, rng=rng), nn.ReLU(), nn.Linear(64, 2, rng=rng))
    ddp = DDP(model)                                   # copies rank 0's weights to every rank
    opt = SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    sampler = DistributedSampler(len(x), shuffle=True, seed=0)   # this rank's share of each epoch
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = sampler.indices()
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            opt.zero_grad()
            loss = loss_fn(ddp(x[batch]), y[batch])
            ddp.backward(loss_fn.backward())           # gradients averaged over all ranks
            opt.step()
        mean = np.array([loss])
        axond.all_reduce(mean, op=axond.ReduceOp.AVG)  # the last batch's loss, averaged over ranks
        if axond.get_rank() == 0:
            print(f"epoch {epoch + 1}/{epochs} loss {mean[0]:.3f}", flush=True)
    axond.destroy_process_group()
    return float(mean[0])


if __name__ == "__main__":
    main()
