"""The training example for real: two rank processes launched by `axond worker` against a loopback
coordinator, over the TCP backend; it must learn, log on rank 0 only and write a usable checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from axond.coordinator.server import RunningCoordinator
from axond.examples.train_mlp import TrainConfig, accuracy, build_model, make_dataset, parse_args, train
from axond.nn.utils import load_checkpoint
from axond.testing import run_processes, run_threads


def axond_cmd() -> list[str]:
    return [sys.executable, "-c", "from axond.cli.main import main; main()"]


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.timeout(150)
def test_train_mlp_under_the_worker(coordinator: RunningCoordinator, tmp_path: Path) -> None:
    ckpt = tmp_path / "ck" / "mlp.npz"
    cmd = [*axond_cmd(), "worker", "--coordinator", coordinator.address, "--job", "example",
           "--nnodes", "1", "--nproc-per-node", "2", "--",
           sys.executable, "-m", "axond.examples.train_mlp", "--epochs", "3", "--samples", "2048",
           "--checkpoint", str(ckpt), "--backend", "tcp"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    epochs = re.findall(r"\[rank (\d)\] epoch (\d)/3 loss ([0-9.]+)", out)
    assert [(r, e) for r, e, _ in epochs] == [("0", "1"), ("0", "2"), ("0", "3")], out
    losses = [float(loss) for _, _, loss in epochs]
    assert losses[-1] < 0.75 * losses[0], f"the loss should fall: {losses}"
    assert "[rank 0] training on 2 rank(s)" in out
    assert "[rank 1] epoch" not in out
    assert "Traceback" not in err, err

    cfg = TrainConfig(samples=2048)
    model = build_model(cfg)
    state = load_checkpoint(ckpt)
    assert int(state.pop("epochs")) == 3
    model.load_state_dict(state)
    _, _, x_test, y_test = make_dataset(cfg)
    assert accuracy(model, x_test, y_test) > 0.6, "8 classes: chance is about 0.125"


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.timeout(120)
def test_train_mlp_as_plain_processes(tmp_path: Path) -> None:
    """Same program without the worker (env and a file store from axond.testing)."""
    codes = run_processes("axond.examples.train_mlp", 2, timeout=100,
                          args=["--epochs", "1", "--samples", "512", "--checkpoint", str(tmp_path / "m.npz")])
    assert codes == [0, 0]
    assert (tmp_path / "m.npz").is_file()


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.timeout(120)
def test_train_mlp_with_fsdp_as_plain_processes(tmp_path: Path) -> None:
    """--parallel fsdp end to end: rank 0's checkpoint holds the full (unsharded) weights under the model's names."""
    path = tmp_path / "fsdp.npz"
    codes = run_processes("axond.examples.train_mlp", 2, timeout=100,
                          args=["--epochs", "1", "--samples", "512", "--parallel", "fsdp", "--checkpoint", str(path)])
    assert codes == [0, 0]
    saved = np.load(path)
    model = build_model(TrainConfig())
    for name, value in model.state_dict().items():
        assert saved[name].shape == value.shape, name


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
@pytest.mark.parametrize("parallel,sharding", [("zero", "full_shard"), ("fsdp", "full_shard"),
                                               ("fsdp", "shard_grad_op"), ("fsdp", "no_shard")])
def test_zero_and_fsdp_train_like_ddp(parallel: str, sharding: str) -> None:
    """The same seeded run under ZeRO-1 or FSDP gives DDP's losses and accuracy: the wrappers change where
    state lives, not the maths. float32 with reductions in another order: agreement to ~1e-5 relative."""
    cfg = TrainConfig(epochs=2, samples=512, hidden=32, checkpoint="")
    base = run_threads(lambda g: train(cfg, g), 2, 60.0)
    other = run_threads(lambda g: train(replace(cfg, parallel=parallel, sharding=sharding), g), 2, 60.0)
    for a, b in zip(base, other):
        np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-4)
        assert abs(b["test_acc"] - a["test_acc"]) <= 2 / 128  # at most 2 of the 128 test samples flip
    assert base[0]["losses"][1] < base[0]["losses"][0]


def test_bad_arguments_exit_with_usage() -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--epochs", "0"])
    assert info.value.code == 2


def test_dataset_is_seeded_and_learnable_shape() -> None:
    a, b = make_dataset(TrainConfig(samples=256, seed=1)), make_dataset(TrainConfig(samples=256, seed=1))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert len(np.unique(a[1])) >= 4, "labels use several classes"
    assert not np.array_equal(a[0], make_dataset(TrainConfig(samples=256, seed=2))[0])


@pytest.mark.slow  # among the longest tests: the full run, not the quick loop
def test_progress_bar_only_on_a_terminal(tmp_path: Path) -> None:
    """Single-process run (no RANK/WORLD_SIZE) with stderr on a pseudo-terminal: the bar is drawn there."""
    import pty

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "AXOND_COORDINATOR")}
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "axond.examples.train_mlp", "--epochs", "1", "--samples", "512",
                                 "--checkpoint", ""], stdout=subprocess.PIPE, stderr=slave, env=env, cwd=tmp_path)
        os.close(slave)
        slave = -1
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert proc.returncode == 0
    tty = b"".join(chunks).decode()
    assert "\repoch 1/1 [" in tty and "##" in tty, tty
    assert "epoch 1/1 loss" in out.decode()
    assert "[#" not in out.decode(), "no bar on a pipe"
    assert not list(tmp_path.iterdir()), 'no checkpoint with --checkpoint ""'
