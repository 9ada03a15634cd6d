"""The torch backend runs over the axond backend AXOND_TORCH_BACKEND names (default: the registry's, tcp), through the
backend interface only."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from axond.config import RuntimeEnv  # noqa: E402
from axond.distributed.backends.base import BackendOptions  # noqa: E402
from axond.errors import BackendUnavailable  # noqa: E402
from axond.store import InMemoryStore  # noqa: E402
from axond.torch.process_group import AxondProcessGroup  # noqa: E402


def _group(environ: dict[str, str]) -> AxondProcessGroup:
    options = BackendOptions(timeout=10.0, env=RuntimeEnv.from_env(environ))
    return AxondProcessGroup(InMemoryStore(), 0, 1, options)


@pytest.mark.parametrize("chosen, expected", [({}, "tcp"), ({"AXOND_TORCH_BACKEND": "tcp"}, "tcp"),
                                              ({"AXOND_TORCH_BACKEND": "mock"}, "mock")])
def test_the_torch_group_runs_on_the_backend_chosen(chosen: dict[str, str], expected: str) -> None:
    pg = _group(chosen)
    try:
        assert pg.axond_group.backend_name == expected
        t = torch.arange(4, dtype=torch.float32)
        for _ in range(3):  # the small-op short path and the full one give the same answer
            pg.allreduce([t]).wait()
            pg.broadcast([t]).wait()
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert pg.overlap in (True, False)  # decided from the backend's host_ranks / host_cores
    finally:
        pg.shutdown()


def test_an_unknown_backend_is_refused_naming_the_choices() -> None:
    pg = _group({"AXOND_TORCH_BACKEND": "carrier-pigeon"})
    with pytest.raises(BackendUnavailable, match="unknown backend 'carrier-pigeon'; choose one of"):
        pg.axond_group  # noqa: B018 -- the group is made on first use
