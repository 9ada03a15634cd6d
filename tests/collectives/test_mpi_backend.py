"""The mpi backend: the collective contract cases run by real MPI ranks under `mpirun` at 2, 3 and 4 ranks (and the
tcp backend formed through MPI's rendezvous), its registration and options. The dev extra installs mpi4py and Open
MPI's wheel; skipped where either is missing anyway."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axond.distributed import BackendOptions
from axond.distributed.backends import registry
from axond.distributed.backends.mpi import MpiBackend, MpiOptions
from axond.distributed.backends.mpi import library
from axond.errors import BackendUnavailable
from mpi_launch import mpirun

CASES = Path(__file__).resolve().parents[1] / "helpers" / "mpi_cases.py"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n,backend", [(2, "mpi"), pytest.param(3, "mpi", marks=pytest.mark.slow),
                                       pytest.param(4, "mpi", marks=pytest.mark.slow),
                                       pytest.param(3, "tcp", marks=pytest.mark.slow)])
def test_contract_cases_under_mpirun(n: int, backend: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = mpirun(n, [str(CASES), backend, str(out)], timeout=360)
    assert proc.returncode == 0 and out.is_file(), f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert result["size"] == n and result["backend"] == backend and result["cases"] >= 13, result
    assert not result["failures"], "\n\n".join(f"rank {r} {case}: {msg}" for r, case, msg in result["failures"])


def test_the_backend_is_registered_and_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    assert registry.backend_classes()["mpi"] is MpiBackend
    assert registry.options_class("mpi") is MpiOptions
    monkeypatch.setattr(library.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BackendUnavailable, match=r"mpi4py is not installed.*openmpi-bin.*axond\[mpi\]"):
        registry.backend_class("mpi")
    assert "mpi" not in registry.available_backends()


def test_options_come_from_the_environment_or_are_given() -> None:
    assert MpiOptions.from_env({}) == MpiOptions() and MpiOptions().spin is None  # auto: by cores and ranks
    assert MpiOptions.from_env({"AXOND_MPI_CHECK_CALLS": "0", "AXOND_MPI_SPIN": "0"}) == MpiOptions(False, 0)
    with pytest.raises(ValueError, match="AXOND_MPI_CHECK_CALLS"):
        MpiOptions.from_env({"AXOND_MPI_CHECK_CALLS": "maybe"})
    with pytest.raises(ValueError, match="AXOND_MPI_SPIN='-3'"):
        MpiOptions.from_env({"AXOND_MPI_SPIN": "-3"})
    registry.check_options(BackendOptions(mpi=MpiOptions(check_calls=False)))
    with pytest.raises(TypeError, match="must be a .*MpiOptions"):
        registry.check_options(BackendOptions(mpi=object()))  # type: ignore[arg-type]
