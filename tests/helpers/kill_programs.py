"""Rank programs that run collectives until they are killed, each writing its pid to $PID_DIR/pid<rank>: the
killed-rank tests (tests/worker/test_worker_blame.py) and bench/kill_blame.py run the same ones."""

NATIVE = """
import os, time, numpy as np, axond
axond.init_process_group()
x = np.ones(1000, dtype=np.float32)
open(os.path.join(os.environ["PID_DIR"], f"pid{axond.get_rank()}"), "w").write(str(os.getpid()))
while True:
    axond.all_reduce(x)
    time.sleep(0.01)
"""

TORCH = """
import os, time, torch, torch.distributed as dist
import axond.torch
dist.init_process_group("axond")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(100, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
open(os.path.join(os.environ["PID_DIR"], f"pid{dist.get_rank()}"), "w").write(str(os.getpid()))
while True:
    opt.zero_grad()
    model(torch.randn(8, 100)).sum().backward()
    opt.step()
    time.sleep(0.01)
"""
