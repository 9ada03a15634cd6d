"""The NCCL backend's GPU-free planning: dtype/op mapping, headers and device choice."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from axond.distributed.backends.nccl.support import (
    META_SLOTS,
    ReductionPlan,
    check_p2p_header,
    choose_device,
    decode_meta,
    encode_meta,
    encode_p2p_header,
    preload_nccl_wheel,
    reduction_plan,
    transfer_type,
)
from axond.distributed.numerics.reduce_op import ReduceOp
from axond.errors import BackendUnavailable

NEW, OLD = 22104, 2906
"""NCCL 2.21.4 (has bfloat16) and NCCL 2.9.6 (has not)."""


@pytest.mark.parametrize(
    ("dtype", "op", "version", "plan"),
    [
        ("float32", ReduceOp.SUM, NEW, ReductionPlan("NCCL_FLOAT32", 1, "NCCL_SUM", False)),
        ("float16", ReduceOp.PRODUCT, NEW, ReductionPlan("NCCL_FLOAT16", 1, "NCCL_PROD", False)),
        ("float64", ReduceOp.AVG, NEW, ReductionPlan("NCCL_FLOAT64", 1, "NCCL_SUM", True)),
        ("float64", ReduceOp.AVG, OLD, ReductionPlan("NCCL_FLOAT64", 1, "NCCL_SUM", True)),
        ("int8", ReduceOp.MIN, NEW, ReductionPlan("NCCL_INT8", 1, "NCCL_MIN", False)),
        ("uint8", ReduceOp.MAX, NEW, ReductionPlan("NCCL_UINT8", 1, "NCCL_MAX", False)),
        ("int32", ReduceOp.SUM, OLD, ReductionPlan("NCCL_INT32", 1, "NCCL_SUM", False)),
        ("float32", ReduceOp.MAX, NEW, ReductionPlan("NCCL_FLOAT32", 1, "NCCL_MAX", False)),
        ("int64", ReduceOp.PRODUCT, NEW, ReductionPlan("NCCL_INT64", 1, "NCCL_PROD", False)),
        ("bool", ReduceOp.SUM, NEW, ReductionPlan("NCCL_UINT8", 1, "NCCL_MAX", False)),
        ("bool", ReduceOp.PRODUCT, NEW, ReductionPlan("NCCL_UINT8", 1, "NCCL_MIN", False)),
        ("bool", ReduceOp.MIN, NEW, ReductionPlan("NCCL_UINT8", 1, "NCCL_MIN", False)),
        ("bool", ReduceOp.BAND, NEW, ReductionPlan("NCCL_UINT8", 1, "NCCL_MIN", False)),
        ("bool", ReduceOp.BOR, NEW, ReductionPlan("NCCL_UINT8", 1, "NCCL_MAX", False)),
        ("complex64", ReduceOp.AVG, NEW, ReductionPlan("NCCL_FLOAT32", 2, "NCCL_SUM", True)),
        ("complex64", ReduceOp.SUM, NEW, ReductionPlan("NCCL_FLOAT32", 2, "NCCL_SUM", False)),
        ("complex128", ReduceOp.AVG, OLD, ReductionPlan("NCCL_FLOAT64", 2, "NCCL_SUM", True)),
    ],
)
def test_reduction_plans(dtype: str, op: ReduceOp, version: int, plan: ReductionPlan) -> None:
    """AVG is SUM then a division, as on the tcp backend (ncclAvg would round differently)."""
    assert reduction_plan(np.dtype(dtype), op, version) == plan


def test_reduce_op_names_are_accepted_like_the_tcp_backend() -> None:
    by_name = reduction_plan(np.dtype("float32"), "max", NEW)  # type: ignore[arg-type]
    assert by_name == ReductionPlan("NCCL_FLOAT32", 1, "NCCL_MAX", False)
    with pytest.raises(ValueError, match="unknown reduce op"):
        reduction_plan(np.dtype("float32"), "median", NEW)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "op", "message"),
    [
        ("int16", ReduceOp.SUM, "no 16-bit integer type"),
        ("uint16", ReduceOp.MAX, "cast to int32"),
        ("bool", ReduceOp.AVG, "AVG is undefined on bool"),
        ("int32", ReduceOp.AVG, "AVG is refused on integer arrays"),
        ("uint64", ReduceOp.AVG, "SUM and divide"),
        ("complex64", ReduceOp.MAX, "undefined on complex"),
        ("complex64", ReduceOp.PRODUCT, "SUM or AVG only"),
        ("int32", ReduceOp.BAND, "no bitwise reductions"),
        ("bool", ReduceOp.BXOR, "no bitwise reductions"),
        ("float32", ReduceOp.BOR, "integer and bool arrays only"),
    ],
)
def test_unsupported_reductions_say_what_to_do(dtype: str, op: ReduceOp, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        reduction_plan(np.dtype(dtype), op, NEW)


def test_bfloat16_maps_where_nccl_has_it() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays need ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert reduction_plan(bf16, ReduceOp.SUM, NEW) == ReductionPlan("NCCL_BFLOAT16", 1, "NCCL_SUM", False)
    with pytest.raises(TypeError, match="NCCL >= 2.10"):
        reduction_plan(bf16, ReduceOp.SUM, OLD)
    assert transfer_type(bf16, OLD) == ("NCCL_UINT8", 2)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [("float32", ("NCCL_FLOAT32", 1)), ("int64", ("NCCL_INT64", 1)), ("int16", ("NCCL_UINT8", 2)),
     ("bool", ("NCCL_UINT8", 1)), ("complex128", ("NCCL_UINT8", 16))],
)
def test_data_movement_uses_native_types_or_bytes(dtype: str, expected: tuple[str, int]) -> None:
    assert transfer_type(np.dtype(dtype), NEW) == expected


@pytest.mark.parametrize(("shape", "dtype"), [((), "float32"), ((3, 1, 7), "int16"), ((2,) * 24, "complex128")])
def test_scatter_metadata_round_trips(shape: tuple[int, ...], dtype: str) -> None:
    meta = encode_meta(shape, np.dtype(dtype))
    assert meta.shape == (META_SLOTS,) and meta.dtype == np.int64
    assert decode_meta(meta) == (shape, np.dtype(dtype))
    with pytest.raises(ValueError, match="at most 24"):
        encode_meta((1,) * 25, np.dtype(dtype))


def test_p2p_header_detects_each_mismatch() -> None:
    f32 = np.dtype("float32")
    header = encode_p2p_header(7, 4096, f32)
    assert check_p2p_header(header, 7, 4096, f32) is None
    assert "tag 7 (expected 8)" in (check_p2p_header(header, 8, 4096, f32) or "")
    assert "4096 bytes (expected 1024)" in (check_p2p_header(header, 7, 1024, f32) or "")
    assert "expected int32" in (check_p2p_header(header, 7, 4096, np.dtype("int32")) or "")
    assert "no axond header" in (check_p2p_header(np.zeros(4, np.int64), 7, 4096, f32) or "")


def test_device_choice() -> None:
    assert choose_device(None, None, 1) == 0
    assert choose_device(None, "3", 4) == 3
    assert choose_device(1, "3", 2) == 1
    with pytest.raises(BackendUnavailable, match="LOCAL_RANK=2 but 2 CUDA device"):
        choose_device(None, "2", 2)
    with pytest.raises(BackendUnavailable, match="BackendOptions.device=5"):
        choose_device(5, None, 2)
    with pytest.raises(BackendUnavailable, match="not an integer"):
        choose_device(None, "gpu0", 2)


def test_nccl_wheel_preload_is_harmless_when_absent_or_broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("nvidia") is None:
        assert preload_nccl_wheel() is None
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "nvidia" / "nccl" / "__init__.py").write_text("")
    (lib / "libnccl.so.2").write_bytes(b"not an ELF file")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    assert preload_nccl_wheel() is None


def test_nccl_wheel_preload_loads_the_real_library() -> None:
    """With the nvidia-nccl-cu12 wheel installed (the gpu extra), its libnccl.so.2 loads; no GPU needed."""
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        del sys.modules[name]  # drop the stand-in package another test may have imported
    importlib.invalidate_caches()
    pytest.importorskip("nvidia.nccl", reason="needs the nvidia-nccl-cu12 wheel (pip install 'axond[gpu]')")
    path = preload_nccl_wheel()
    assert path is not None and path.endswith("libnccl.so.2")


def test_installed_cupy_has_every_nccl_call_we_make() -> None:
    """Against the real `cupy.cuda.nccl` (no GPU needed): the communicator methods, module functions and
    NCCL_* constants the backend uses all exist, so a GPU run cannot fail on a misspelt name."""
    nccl = pytest.importorskip("cupy.cuda.nccl", reason="needs CuPy with NCCL (pip install 'axond[gpu]')")
    import axond.distributed.backends.nccl.support as support

    names = set(support._NATIVE_TYPES.values()) | set(support._COMPLEX_PARTS.values())
    names |= set(support._NCCL_OPS.values()) | set(support._BOOL_OPS.values()) | {"NCCL_INT64", "NCCL_INT32"}
    assert sorted(n for n in names if not hasattr(nccl, n)) == []
    methods = ("allReduce", "broadcast", "reduce", "allGather", "reduceScatter", "send", "recv", "abort",
               "destroy", "check_async_error")
    assert [m for m in methods if not hasattr(nccl.NcclCommunicator, m)] == []
    assert [f for f in ("groupStart", "groupEnd", "get_version", "get_unique_id", "NcclError")
            if not hasattr(nccl, f)] == []
    assert int(nccl.get_version()) >= 2_07_00
