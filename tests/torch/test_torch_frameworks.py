"""Frameworks on "axond", run as their users run them: Lightning DDP with its own launcher (and under torchrun), and
Accelerate under the real torchrun with the group initialized first. Each trains a small model for a few steps on
two CPU ranks; the trained parameters are checked against the same training in one process."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
for _framework in ("lightning", "accelerate"):  # looked up, not imported: importing Lightning takes seconds
    if importlib.util.find_spec(_framework) is None:
        pytest.skip(f"{_framework} is not installed (pip install -e '.[dev]')", allow_module_level=True)

import torch  # noqa: E402

pytestmark = pytest.mark.slow  # Lightning and Accelerate under torchrun (real launches)

STEPS, BATCH, LR, RANKS = 8, 16, 0.05, 2


def initial_model(module: str) -> torch.nn.Module:
    """The example's model as every rank builds it."""
    example = importlib.import_module(module)
    return example.Regression(LR).net if hasattr(example, "Regression") else example.build_model()


def step_samples(module: str, step: int) -> torch.Tensor:
    """The indices of the samples that the two ranks' batches of `step` make together. Lightning's training loader
    gets a DistributedSampler that shuffles (seed 0, epoch 0) and deals the permutation out rank by rank;
    Accelerate shards the loader's batches (rank r takes batch 2i + r), so step i takes samples [32i, 32i + 32)."""
    n = STEPS * BATCH * RANKS
    if module.endswith("lightning_ddp"):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        return torch.cat([perm[r::RANKS][step * BATCH:(step + 1) * BATCH] for r in range(RANKS)])
    return torch.arange(step * BATCH * RANKS, (step + 1) * BATCH * RANKS)


def reference(module: str) -> dict[str, torch.Tensor]:
    """The example's model trained in one process on the same samples, each step on its two ranks' samples."""
    model = initial_model(module)
    data = importlib.import_module(module).dataset(STEPS * BATCH * RANKS)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i in range(STEPS):
        x, y = data[step_samples(module, i)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_trained_like_reference(saved: Path, module: str) -> None:
    got = torch.load(saved)
    want = reference(module)
    initial = initial_model(module).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        # float32: the ranks average two 16-sample mean gradients where the reference takes one 32-sample mean, so
        # the sums round differently (a few ulps per step); a wrong or missing all-reduce is off by far more.
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{k} differs from one process")
        assert not torch.equal(got[k], initial[k]), f"{k} was not trained"


def run(cmd: list[str], cwd: Path, timeout: float = 120.0) -> str:
    """Run a launcher command to its end; its output, or a failure that shows it."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(cmd)} exited with {p.returncode}:\n{out[-4000:]}"
    return out


def example_args(saved: Path) -> list[str]:
    return ["--steps", str(STEPS), "--batch", str(BATCH), "--lr", str(LR), "--save", str(saved)]


def test_lightning_ddp_with_its_own_launcher(tmp_path: Path) -> None:
    """`python script.py` with devices=2: Lightning's launcher re-runs the command for rank 1."""
    saved = tmp_path / "trained.pt"
    out = run([sys.executable, "-m", "axond.examples.lightning_ddp", "--devices", str(RANKS), *example_args(saved)],
              tmp_path)
    assert "distributed_backend=axond" in out and "lightning DDP on 2 rank(s), backend axond" in out, out[-2000:]
    assert_trained_like_reference(saved, "axond.examples.lightning_ddp")


def test_lightning_ddp_under_torchrun(tmp_path: Path) -> None:
    """Under torchrun Lightning takes torchrun's ranks (TorchElasticEnvironment) instead of launching its own."""
    saved = tmp_path / "trained.pt"
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               "-m", "axond.examples.lightning_ddp", "--devices", str(RANKS), *example_args(saved)], tmp_path)
    assert "lightning DDP on 2 rank(s), backend axond" in out, out[-2000:]
    assert_trained_like_reference(saved, "axond.examples.lightning_ddp")


def test_accelerate_on_an_axond_group_under_torchrun(tmp_path: Path) -> None:
    """Accelerate's DDP over a group the script initialized as "axond" before creating the Accelerator."""
    saved = tmp_path / "trained.pt"
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               "-m", "axond.examples.accelerate_ddp", *example_args(saved)], tmp_path)
    assert "accelerate DDP on 2 rank(s), group backend axond" in out, out[-2000:]
    assert_trained_like_reference(saved, "axond.examples.accelerate_ddp")

