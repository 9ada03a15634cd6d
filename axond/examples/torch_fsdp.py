"""torch FSDP2 (`fully_shard`) on axond: a tiny transformer language model on synthetic tokens, parameters
sharded over the ranks, all-gathers and reduce-scatters on axond's data plane.

Run it with `axond worker --coordinator HOST:PORT --nproc-per-node 2 -- python -m axond.examples.torch_fsdp`.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import axond.torch  # noqa: F401 -- registers the "axond" backend


class TinyLM(torch.nn.Module):
    """Embedding, a few pre-norm causal transformer layers, an output head; logits come out flattened."""

    def __init__(self, vocab: int = 64, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(h.reshape(-1, h.shape[-1]))  # (batch * length, vocab): a fresh tensor, not a view


def tokens(rank: int, step: int, batch: int, length: int, vocab: int) -> torch.Tensor:
    """Sequences counting up modulo `vocab` from a random start: next-token prediction is learnable."""
    gen = torch.Generator().manual_seed(rank * 100_000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    return (start + torch.arange(length + 1)) % vocab


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck collective raises")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("axond", timeout=timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))
    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"torch FSDP2 on {size} rank(s), backend {dist.get_backend()}", flush=True)
    for step in range(1, args.steps + 1):
        seq = tokens(rank, step, args.batch, args.length, 64)
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits, seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"step {step}/{args.steps} loss {float(mean):.4f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
