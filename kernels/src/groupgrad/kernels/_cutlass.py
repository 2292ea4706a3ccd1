"""CUTLASS sm_90a backend: loading the kernels, choosing one per call, launching it.

Internal to ``groupgrad.kernels``: the public functions validate and normalise their
inputs, ask :func:`unsupported_reason`, and call :func:`fprop`, :func:`dgrad` or
:func:`wgrad` here. Nothing in this module compiles or initialises CUDA at import.

Legend: ``T`` tokens, ``E`` groups (experts), ``K`` in_features, ``N`` out_features.
``x_TK`` input, ``w`` list of ``E`` ``(N, K)`` weights, ``dy_TN`` output gradient,
``splits_E`` int64 token counts on the GPU.

Which kernels exist and how they are compiled and cached: ``groupgrad.kernels.build``.
This module loads them (building the default set on first use), says whether a
call suits them, picks one per call and launches it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import cast

import torch

from groupgrad.kernels.build import (
    CACHE_ENV,
    COOP_TILE,
    PONG_TILE,
    TUNING_VARIANTS,
    VARIANT_SETS,
    VARIANTS,
    Variant,
    build_spec,
    load_or_build,
)

__all__ = [
    "CACHE_ENV",
    "TUNING_VARIANTS",
    "VARIANTS",
    "VARIANT_SETS",
    "Plan",
    "Variant",
    "build",
    "compiled_variants",
    "dgrad",
    "fprop",
    "plan_for",
    "unsupported_reason",
    "wgrad",
]

_DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_OPS = ("fprop", "dgrad", "wgrad")
_TUNING_NAMES = frozenset(v.name for v in TUNING_VARIANTS)

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}  # variant set -> loaded extension


def build(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    variant_set: str = "default",
    verbose: bool = False,
) -> tuple[ModuleType, float, bool]:
    """Compiles (or loads from the cache) one variant set's extension and activates it.

    Args:
        cache_dir: root of the build cache; ``None`` uses ``build.default_cache_dir()``
            (an explicit argument always wins over the environment variable).
        variant_set: ``"default"`` (:data:`VARIANTS`, what the API uses) or
            ``"tuning"`` (:data:`TUNING_VARIANTS`, for the benchmark's sweep).
        verbose: show the compiler commands.

    Returns:
        ``(module, seconds, compiled)``: the loaded module, wall time of this call, and
        whether it compiled anything (``False`` when the cache already held the build).
    """
    if variant_set not in VARIANT_SETS:
        raise ValueError(f"variant_set is {variant_set!r}, expected one of {sorted(VARIANT_SETS)}")
    spec = build_spec(cache_dir, VARIANT_SETS[variant_set])
    start = time.perf_counter()
    with _lock:
        module, compiled = load_or_build(spec, verbose)
        _modules[variant_set] = module
    return module, time.perf_counter() - start, compiled


def _extension(variant: str) -> ModuleType:
    """The loaded extension holding ``variant`` (the default set builds on first use)."""
    variant_set = "tuning" if variant in _TUNING_NAMES else "default"
    if variant_set not in _modules:
        if variant_set != "default":
            raise RuntimeError(f"{variant} is a tuning variant: build(variant_set='tuning') first")
        build()
    return _modules[variant_set]


def compiled_variants() -> frozenset[str]:
    """Names of the variants in the loaded extensions (builds the default set on first use)."""
    if "default" not in _modules:
        build()
    return frozenset(name for m in _modules.values() for name in m.variants())


# --------------------------------------------------------------------------- support


_toolchain_reason_cache: list[str | None] = []


def _toolchain_reason() -> str | None:
    """Why the extension cannot be built here, if it is not loaded yet (cheap, cached)."""
    if _modules:
        return None
    if not _toolchain_reason_cache:
        reason = None
        if importlib.util.find_spec("cutlass_library") is None:
            reason = "the nvidia-cutlass package (CUTLASS headers) is not installed"
        else:
            from torch.utils.cpp_extension import CUDA_HOME

            if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
                reason = "nvcc was not found (CUDA_HOME is unset or has no bin/nvcc)"
        _toolchain_reason_cache.append(reason)
    return _toolchain_reason_cache[0]


Operand = torch.Tensor | Sequence[torch.Tensor]


def _operands(
    op: str, a: torch.Tensor, b: Operand, out: Operand
) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, name of its column dimension) for every 2-D operand of a call."""
    if op == "wgrad":
        x_TK, dw_list = cast(torch.Tensor, b), cast(Sequence[torch.Tensor], out)
        return [("dy", a, "N"), ("x", x_TK, "K")] + [
            (f"out[{i}]", t, "K") for i, t in enumerate(dw_list)
        ]
    out_T, w_list = cast(torch.Tensor, out), cast(Sequence[torch.Tensor], b)
    dense = (
        [("x", a, "K"), ("out", out_T, "N")]
        if op == "fprop"
        else [("dy", a, "N"), ("out", out_T, "K")]
    )
    return dense + [(f"weights[{i}]", t, "K") for i, t in enumerate(w_list)]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype)
    )


def unsupported_reason(op: str, a: torch.Tensor, b: Operand, out: Operand) -> str | None:
    """Why CUTLASS cannot run this call, or ``None`` when it can.

    ``op`` is ``"fprop"`` (``a`` = x ``(T, K)``, ``b`` = E weights ``(N, K)``, ``out``
    ``(T, N)``), ``"dgrad"`` (``a`` = dy ``(T, N)``, ``b`` = weights, ``out`` ``(T, K)``)
    or ``"wgrad"`` (``a`` = dy, ``b`` = x, ``out`` = E tensors ``(N, K)``). Never
    compiles, and never initialises CUDA for CPU tensors.
    """
    if op not in _OPS:
        return f"unknown op {op!r}"
    if a.device.type != "cuda":
        return f"tensors are on {a.device.type}, not cuda"
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"{_dtype_name(a.dtype)} inputs (the CUTLASS kernels take bf16 or fp16)"
    named = _operands(op, a, b, out)
    for name, t, _ in named:
        if t.device != a.device:
            return f"{name} is on {t.device}, the inputs on {a.device}"
    major, minor = torch.cuda.get_device_capability(a.device)
    if (major, minor) != (9, 0):
        return f"not sm_90 (device {a.device} is sm_{major}{minor})"
    out_index = 2 if op == "wgrad" else 1  # the first output among the named operands
    out_dtype = named[out_index][1].dtype if len(named) > out_index else a.dtype
    if op == "wgrad":
        if out_dtype not in (a.dtype, torch.float32):
            return (
                f"no compiled kernel for {_dtype_name(a.dtype)} inputs with "
                f"{_dtype_name(out_dtype)} output"
            )
    elif out_dtype != a.dtype:
        return f"{op} output dtype {_dtype_name(out_dtype)} differs from the inputs' {_dtype_name(a.dtype)}"
    for name, t, dim in named:
        if t.dim() != 2:
            return f"{name} is {t.dim()}-D, expected a 2-D matrix"
        if t.size(1) % 8 != 0:
            return f"{dim}={t.size(1)} is not a multiple of 8"
        if t.stride(1) != 1:
            return f"{name} is not row-major (strides {tuple(t.stride())})"
        if (t.stride(0) * t.element_size()) % 16 != 0 and t.size(0) > 1:
            return f"{name} row stride {t.stride(0)} is not a multiple of 16 bytes"
        if t.data_ptr() % 16 != 0:
            return f"{name} base pointer not 16-byte aligned"
        if max(t.shape) >= 2**31:
            return f"{name} has a dimension of 2**31 or more"
    return _toolchain_reason()


# --------------------------------------------------------------------------- planning


#: Tokens per group (T / E) from which :func:`plan_for` takes the ping-pong tile.
LARGE_GROUP_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which compiled variant runs a call, and the persistent scheduler's raster order."""

    variant: str
    raster_along_n: bool = False
    max_swizzle: int = 1


def plan_for(
    op: str,
    dtype_in: torch.dtype,
    dtype_out: torch.dtype,
    T: int,
    E: int,
    N: int,
    K: int,
    accumulate: bool = False,
) -> Plan:
    """Chooses the kernel for one call (heuristic documented in kernels/NOTES.md).

    The GEMM of one group is ``M x N' x K'``: fprop ``(T/E) x N x K``, dgrad
    ``(T/E) x K x N``, wgrad ``N x K x (T/E)`` (ragged dimension on average).
    """
    din, dout = _DTYPE_TAGS[dtype_in], _DTYPE_TAGS[dtype_out]
    # Tokens per group: the ragged M of fprop/dgrad, the ragged K of wgrad. Large
    # groups: ping-pong 128x128 (one warp group's epilogue overlaps the other's
    # mainloop) with a 1x2 cluster, so no M tile is padded to a cluster pair.
    # Many small groups: cooperative 128x256 without a cluster.
    # Exception, measured: dgrad with a reduction (N) much longer than its output
    # rows (K) runs better cooperative (E=8, K=4096, N=28672, skewed splits).
    rows = T / max(E, 1)
    large = rows >= LARGE_GROUP_ROWS and not (op == "dgrad" and N >= 4 * K)
    sched, tile, cluster = PONG_TILE if large else COOP_TILE
    return Plan(Variant(op, din, dout, sched, tile, cluster).name)


# --------------------------------------------------------------------------- launch


def fprop(
    x_TK: torch.Tensor,
    w: list[torch.Tensor],
    splits_E: torch.Tensor,
    out: torch.Tensor,
    *,
    plan: Plan | None = None,
) -> None:
    """``out[rows of e] = x_TK[rows of e] @ w[e].T`` for every group e (writes ``out``)."""
    if plan is None:
        plan = plan_for(
            "fprop", x_TK.dtype, out.dtype, x_TK.size(0), len(w), out.size(1), x_TK.size(1)
        )
    _extension(plan.variant).fprop(
        x_TK, list(w), splits_E, out, plan.variant, plan.raster_along_n, plan.max_swizzle
    )


def dgrad(
    dy_TN: torch.Tensor,
    w: list[torch.Tensor],
    splits_E: torch.Tensor,
    out: torch.Tensor,
    *,
    plan: Plan | None = None,
) -> None:
    """``out[rows of e] = dy_TN[rows of e] @ w[e]`` for every group e (writes ``out``)."""
    if plan is None:
        plan = plan_for(
            "dgrad", dy_TN.dtype, out.dtype, dy_TN.size(0), len(w), dy_TN.size(1), out.size(1)
        )
    _extension(plan.variant).dgrad(
        dy_TN, list(w), splits_E, out, plan.variant, plan.raster_along_n, plan.max_swizzle
    )


def wgrad(
    dy_TN: torch.Tensor,
    x_TK: torch.Tensor,
    splits_E: torch.Tensor,
    out: list[torch.Tensor],
    accumulate: bool,
    *,
    plan: Plan | None = None,
) -> None:
    """``out[e] = dy_e.T @ x_e`` (``accumulate``: ``out[e] += dy_e.T @ x_e``) for every group e.

    Overwriting never reads ``out``; a group with no tokens gets exact zeros
    (overwrite) or is left untouched (accumulate).
    """
    if len(out) == 0:
        return
    if plan is None:
        plan = plan_for(
            "wgrad",
            dy_TN.dtype,
            out[0].dtype,
            dy_TN.size(0),
            len(out),
            dy_TN.size(1),
            x_TK.size(1),
            accumulate,
        )
    _extension(plan.variant).wgrad(
        dy_TN,
        x_TK,
        splits_E,
        list(out),
        accumulate,
        plan.variant,
        plan.raster_along_n,
        plan.max_swizzle,
    )
