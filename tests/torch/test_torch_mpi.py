"""torch DDP over torch.distributed's "axond" backend running on the axond "mpi" backend, under a plain `mpirun -n 2`
(no axond daemon): the parameters of one process trained on the whole batch (what DDP over gloo computes too).
Skipped where torch, Open MPI or mpi4py is missing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpi_launch import mpirun

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "mpi_torch_ddp.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_over_axond_on_mpi_matches_one_process(tmp_path: Path) -> None:
    import mpi_torch_ddp as ddp

    out = tmp_path / "params.npz"
    proc = mpirun(2, [str(SCRIPT), str(out)], timeout=240, env={"AXOND_TORCH_BACKEND": "mpi"})
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    net = ddp.model()
    x, y = ddp.batch()
    ddp.train(net, x, y)  # equal shards: DDP's averaged gradient is the whole batch's mean-loss gradient
    got = np.load(out)
    for name, value in net.state_dict().items():
        # float32 sums of two half-batch gradients in another order than one pass: a few ulps per step.
        np.testing.assert_allclose(got[name], value.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
