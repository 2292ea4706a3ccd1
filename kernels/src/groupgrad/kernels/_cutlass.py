"""CUTLASS sm_90a backend: loading the kernels, choosing one per call, launching it.

Internal to ``groupgrad.kernels``: the public functions validate and normalise their
inputs, ask :func:`unsupported_reason`, and call :func:`fprop`, :func:`dgrad` or
:func:`wgrad` here. Nothing in this module compiles or initialises CUDA at import.

Legend: ``T`` tokens, ``E`` groups (experts), ``K`` in_features, ``N`` out_features.
``x_TK`` input, ``dy_TN`` output gradient, ``splits_E`` int64 token counts on the
GPU. A group of ``E`` ``(N, K)`` matrices (the weights ``w``, or the wgrad outputs)
is packed — ``[w_ENK]``, one tensor whose ``E`` matrices the device addresses by
stride, so the host does no per-expert work — or listed, ``E`` separate matrices.

Which kernels exist and how they are compiled and cached: ``groupgrad.kernels.build``.
This module loads them (building the default set on first use), says whether a
call suits them, picks one per call and launches it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import cast

import torch

from groupgrad.kernels._grouped import is_packed
from groupgrad.kernels.build import (
    BUILD_TIME_HINT,
    CACHE_ENV,
    COOP_TILE,
    CUDA_EXTRA_INSTALL,
    PONG_TILE,
    TUNING_VARIANTS,
    VARIANT_SETS,
    VARIANTS,
    Variant,
    build_spec,
    is_cached,
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

logger = logging.getLogger(__name__)

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
        _build_on_first_use()
    return _modules[variant_set]


def compiled_variants() -> frozenset[str]:
    """Names of the variants in the loaded extensions (builds the default set on first use)."""
    if "default" not in _modules:
        _build_on_first_use()
    return frozenset(name for m in _modules.values() for name in m.variants())


def _build_on_first_use() -> None:
    """:func:`build` of the default set, saying first (WARNING) when that means compiling.

    The message reaches a terminal even where no logging is configured (Python's
    last-resort handler prints WARNING and above).
    """
    spec = build_spec(None, VARIANT_SETS["default"])
    if not is_cached(spec):
        logger.warning(
            "groupgrad.kernels: compiling %d CUTLASS kernel variants for the first GPU call "
            "into %s (once per cache; %s; MAX_JOBS caps the parallel jobs). "
            "Prebuild them with: python -m groupgrad.kernels.build",
            len(spec.variants),
            spec.directory,
            BUILD_TIME_HINT,
        )
    build()


# --------------------------------------------------------------------------- support


_toolchain_reason_cache: list[str | None] = []

#: What a build needs from the ``[cuda]`` extra: importable module -> distribution. (Its
#: third package, pybind11, is not checked: the build uses the headers PyTorch ships.)
BUILD_TOOLS = {"cutlass_library": "nvidia-cutlass", "ninja": "ninja"}


def _missing_build_tools() -> list[str]:
    """Distributions of the ``[cuda]`` extra that a build needs and this Python lacks."""
    missing = []
    for module, distribution in BUILD_TOOLS.items():
        on_path = module == "ninja" and shutil.which("ninja") is not None
        if importlib.util.find_spec(module) is None and not on_path:
            missing.append(distribution)
    return missing


def _toolchain_reason() -> str | None:
    """Why the extension cannot be built here, if it is not loaded yet (cheap, cached).

    Raises:
        RuntimeError: The ``[cuda]`` extra's build tools are missing; the message
            names the install command.
    """
    if _modules:
        return None
    missing = _missing_build_tools()
    if missing:
        raise RuntimeError(
            f"groupgrad.kernels needs {' and '.join(missing)} to compile its CUTLASS kernels "
            f"for this GPU call (groupgrad-kernels installs without them on CPU machines); "
            f"install the GPU extra: {CUDA_EXTRA_INSTALL}"
        )
    if not _toolchain_reason_cache:
        from torch.utils.cpp_extension import CUDA_HOME

        reason = None
        if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
            reason = "nvcc was not found (CUDA_HOME is unset or has no bin/nvcc)"
        _toolchain_reason_cache.append(reason)
    return _toolchain_reason_cache[0]


Operand = torch.Tensor | Sequence[torch.Tensor]
Group = Sequence[torch.Tensor]


def group_size(group: Group) -> int:
    """``E``, the number of matrices in a group given packed ``[w_ENK]`` or listed."""
    if is_packed(group):
        return group[0].size(0)
    return len(group)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype)
    )


def _matrix_reason(name: str, t: torch.Tensor, dim: str, device: torch.device) -> str | None:
    """Why CUTLASS cannot take the row-major operand ``t`` (2-D, or 3-D packed), if it cannot."""
    if t.device != device:
        return f"{name} is on {t.device}, the inputs on {device}"
    if t.size(-1) % 8 != 0:
        return f"{dim}={t.size(-1)} is not a multiple of 8"
    if t.stride(-1) != 1:
        return f"{name} is not row-major (strides {tuple(t.stride())})"
    size = t.element_size()
    for d in range(t.dim() - 1):
        if (t.stride(d) * size) % 16 != 0 and t.size(d) > 1:
            what = "row stride" if d == t.dim() - 2 else f"stride of dimension {d}"
            return f"{name} {what} {t.stride(d)} is not a multiple of 16 bytes"
    if t.data_ptr() % 16 != 0:
        return f"{name} base pointer not 16-byte aligned"
    if max(t.shape) >= 2**31:
        return f"{name} has a dimension of 2**31 or more"
    return None


def _group_reason(name: str, group: Group, dim: str, device: torch.device) -> str | None:
    """:func:`_matrix_reason` for every matrix of a group, packed or listed.

    A packed group is one tensor to check. A listed group is checked member by
    member in one lean pass against the first member (same shape and strides,
    same device, aligned pointer); names are formatted only for a failure.
    """
    first, packed = group[0], is_packed(group)
    reason = _matrix_reason(name if packed else f"{name}[0]", first, dim, device)
    if reason is not None or packed:
        return reason
    if first.dim() != 2:
        return f"{name}[0] is {first.dim()}-D, expected a 2-D matrix"
    shape, strides = first.shape, first.stride()
    for i, t in enumerate(group):
        if t.stride() != strides or t.shape != shape or t.data_ptr() % 16 or t.device != device:
            if t.dim() != 2:
                return f"{name}[{i}] is {t.dim()}-D, expected a 2-D matrix"
            reason = _matrix_reason(f"{name}[{i}]", t, dim, device)
            if reason is None and t.shape != shape:
                reason = f"{name}[{i}] has shape {tuple(t.shape)}, {name}[0] {tuple(shape)}"
            if reason is not None:
                return reason
    return None


def unsupported_reason(op: str, a: torch.Tensor, b: Operand, out: Operand) -> str | None:
    """Why CUTLASS cannot run this call, or ``None`` when it can.

    ``op`` is ``"fprop"`` (``a`` = x ``(T, K)``, ``b`` = the weights, ``out``
    ``(T, N)``), ``"dgrad"`` (``a`` = dy ``(T, N)``, ``b`` = the weights, ``out``
    ``(T, K)``) or ``"wgrad"`` (``a`` = dy, ``b`` = x, ``out`` = the outputs). A
    group of ``(N, K)`` matrices is packed (``[w_ENK]``) or listed (``E`` matrices).
    Never compiles, and never initialises CUDA for CPU tensors.
    """
    if op not in _OPS:
        return f"unknown op {op!r}"
    if a.device.type != "cuda":
        return f"tensors are on {a.device.type}, not cuda"
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"{_dtype_name(a.dtype)} inputs (the CUTLASS kernels take bf16 or fp16)"
    # The two dense operands (name, tensor, column dimension) and the group of matrices.
    second = cast(torch.Tensor, b if op == "wgrad" else out)
    dense = {
        "fprop": [("x", a, "K"), ("out", second, "N")],
        "dgrad": [("dy", a, "N"), ("out", second, "K")],
        "wgrad": [("dy", a, "N"), ("x", second, "K")],
    }[op]
    group, group_name = (cast(Group, out), "out") if op == "wgrad" else (cast(Group, b), "weights")
    if not group:
        return f"{group_name} holds no matrices"
    for name, t, _ in dense:
        if t.device != a.device:
            return f"{name} is on {t.device}, the inputs on {a.device}"
    major, minor = torch.cuda.get_device_capability(a.device)
    if (major, minor) != (9, 0):
        return f"not sm_90 (device {a.device} is sm_{major}{minor})"
    out_dtype = group[0].dtype if op == "wgrad" else dense[1][1].dtype
    if op == "wgrad":
        if out_dtype not in (a.dtype, torch.float32):
            return (
                f"no compiled kernel for {_dtype_name(a.dtype)} inputs with "
                f"{_dtype_name(out_dtype)} output"
            )
    elif out_dtype != a.dtype:
        return f"{op} output dtype {_dtype_name(out_dtype)} differs from the inputs' {_dtype_name(a.dtype)}"
    for name, t, dim in dense:
        if t.dim() != 2:
            return f"{name} is {t.dim()}-D, expected a 2-D matrix"
        reason = _matrix_reason(name, t, dim, a.device)
        if reason is not None:
            return reason
    reason = _group_reason(group_name, group, "K", a.device)
    if reason is not None:
        return reason
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
    w: Group,
    splits_E: torch.Tensor,
    out: torch.Tensor,
    *,
    plan: Plan | None = None,
) -> None:
    """``out[rows of e] = x_TK[rows of e] @ w[e].T`` for every group e (writes ``out``)."""
    if plan is None:
        E = group_size(w)
        plan = plan_for("fprop", x_TK.dtype, out.dtype, x_TK.size(0), E, out.size(1), x_TK.size(1))
    _extension(plan.variant).fprop(
        x_TK, list(w), splits_E, out, plan.variant, plan.raster_along_n, plan.max_swizzle
    )


def dgrad(
    dy_TN: torch.Tensor,
    w: Group,
    splits_E: torch.Tensor,
    out: torch.Tensor,
    *,
    plan: Plan | None = None,
) -> None:
    """``out[rows of e] = dy_TN[rows of e] @ w[e]`` for every group e (writes ``out``)."""
    if plan is None:
        E = group_size(w)
        plan = plan_for(
            "dgrad", dy_TN.dtype, out.dtype, dy_TN.size(0), E, dy_TN.size(1), out.size(1)
        )
    _extension(plan.variant).dgrad(
        dy_TN, list(w), splits_E, out, plan.variant, plan.raster_along_n, plan.max_swizzle
    )


def wgrad(
    dy_TN: torch.Tensor,
    x_TK: torch.Tensor,
    splits_E: torch.Tensor,
    out: Group,
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
            group_size(out),
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
