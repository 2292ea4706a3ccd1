"""CUTLASS sm_90a backend: loading the kernels, saying whether they can run, launching them.

Internal to ``groupgrad.kernels``: the CUDA kernels of the custom ops
(``_ops``) receive validated operands that the support check
(``_support``) accepted, ask :func:`unavailable_reason` for the device, and
call :func:`fprop`, :func:`dgrad` or :func:`wgrad` here, which choose a kernel
(``_support.plan_for``) and launch it. Nothing in this module compiles or initialises
CUDA at import.

Legend: ``T`` tokens, ``E`` groups (experts), ``K`` in_features, ``N`` out_features.
``x_TK`` input, ``dy_TN`` output gradient, ``splits_E`` int64 token counts on the
GPU. A group of ``E`` ``(N, K)`` matrices (the weights ``w``, or the wgrad outputs)
is packed — ``[w_ENK]``, one tensor whose ``E`` matrices the device addresses by
stride, so the host does no per-expert work — or listed, ``E`` separate matrices.

Which kernels exist and how they are compiled and cached: ``groupgrad.kernels.build``
(this module builds the default set on first use).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch

from groupgrad.kernels._group import group_size, use_native_reader
from groupgrad.kernels._support import Plan, plan_for
from groupgrad.kernels.build import (
    BUILD_TIME_HINT,
    CUDA_EXTRA_INSTALL,
    FP8_VARIANTS,
    VARIANT_SETS,
    build_spec,
    is_cached,
    load_or_build,
)

__all__ = [
    "build",
    "compiled_variants",
    "default_plan",
    "dgrad",
    "fp8_dgrad",
    "fp8_elementwise",
    "fp8_fprop",
    "fp8_unsupported_reason",
    "fp8_wgrad",
    "fprop",
    "unavailable_reason",
    "wgrad",
]

_TUNING_NAMES = frozenset(v.name for v in VARIANT_SETS["tuning"])

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
        use_native_reader(module.listed_group_facts)  # listed groups' facts, read in C++
    return module, time.perf_counter() - start, compiled


def _extension(variant: str = "") -> ModuleType:
    """The loaded extension holding ``variant`` (none: the default set's; it builds on first use)."""
    variant_set = "tuning" if variant in _TUNING_NAMES else "default"
    if variant_set not in _modules:
        if variant_set != "default":
            raise RuntimeError(f"{variant} is a tuning variant: build(variant_set='tuning') first")
        _build_on_first_use()
    return _modules[variant_set]


def compiled_variants() -> frozenset[str]:
    """Names of the kernel variants in the loaded extensions (builds the default set on first use).

    Returns:
        The ``Variant.name`` of every compiled kernel of every variant set built so far.
    """
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


# --------------------------------------------------------------------------- availability


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


def unavailable_reason(device: torch.device) -> str | None:
    """Why the CUTLASS kernels cannot run on ``device``, or ``None`` when they can.

    They need a CUDA device of compute capability 9.0 (sm_90a) and, until the
    extension is loaded, the means to build it. Never initialises CUDA for a
    device that is not a CUDA device; never compiles.
    """
    if device.type != "cuda":
        return f"tensors are on {device.type}, not cuda"
    major, minor = _capability(device)
    if (major, minor) != (9, 0):
        return f"not sm_90 (device {device} is sm_{major}{minor})"
    return _toolchain_reason()


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


Group = Sequence[torch.Tensor]


def default_plan(
    op: str,
    a: torch.Tensor,
    b: torch.Tensor | Group,
    out: torch.Tensor | Group,
) -> Plan:
    """:func:`~groupgrad.kernels._support.plan_for` of a call in op form (operands as there)."""
    if op == "wgrad":
        dw_group, x_TK = cast(Group, out), cast(torch.Tensor, b)
        E, N, K = group_size(dw_group), a.size(1), x_TK.size(1)
        return plan_for(op, a.dtype, dw_group[0].dtype, a.size(0), E, N, K)
    w_group, out_T = cast(Group, b), cast(torch.Tensor, out)
    N, K = (out_T.size(1), a.size(1)) if op == "fprop" else (a.size(1), out_T.size(1))
    return plan_for(op, a.dtype, out_T.dtype, a.size(0), group_size(w_group), N, K)


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
    _launch_rows("fprop", x_TK, w, splits_E, out, plan)


def dgrad(
    dy_TN: torch.Tensor,
    w: Group,
    splits_E: torch.Tensor,
    out: torch.Tensor,
    *,
    plan: Plan | None = None,
) -> None:
    """``out[rows of e] = dy_TN[rows of e] @ w[e]`` for every group e (writes ``out``)."""
    _launch_rows("dgrad", dy_TN, w, splits_E, out, plan)


def _launch_rows(
    op: str, a: torch.Tensor, w: Group, splits_E: torch.Tensor, out: torch.Tensor, plan: Plan | None
) -> None:
    """Launch fprop or dgrad (the extension's entry of that name) with ``plan`` or the default."""
    if plan is None:
        plan = default_plan(op, a, w, out)
    launch = getattr(_extension(plan.variant), op)
    launch(a, list(w), splits_E, out, plan.variant, plan.raster_along_n, plan.max_swizzle)


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
        plan = default_plan("wgrad", dy_TN, x_TK, out)
    _extension(plan.variant).wgrad(
        dy_TN, x_TK, splits_E, list(out), accumulate,
        plan.variant, plan.raster_along_n, plan.max_swizzle,
    )  # fmt: skip


# --------------------------------------------------------------------------- FP8
#
# e4m3 operands with fp32 block scales, as groupgrad.kernels._fp8 lays them out:
# the rows form (x or dy: data (T, C), scales (T, C/128) with strides (1, T)),
# the weights (data (E, N, K), data_t (E, K, N), scales (E, N/128, K/128)) and
# the segments form (data (C, Tp), scales (NB, C)); csrc/fp8_setup.h has the details.

_FP8_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
#: The compiled FP8 kernel of each (op, output dtype), and of each one that adds
#: to its output by TMA reduce-add (the fp32 wgrad's accumulating calls).
_FP8_KERNELS: dict[tuple[str, torch.dtype], str] = {
    (v.op, _FP8_DTYPES[v.dtype_out]): v.name for v in FP8_VARIANTS if not v.adds
}
_FP8_ADDING: dict[tuple[str, torch.dtype], str] = {
    (v.op, _FP8_DTYPES[v.dtype_out]): v.name for v in FP8_VARIANTS if v.adds
}
_FP8_PLANS = {v.name: Plan(v.name) for v in FP8_VARIANTS}  # each call's default, made once


def fp8_unsupported_reason(op: str, out_dtype: torch.dtype) -> str | None:
    """Why no FP8 kernel runs ``op`` (``"fprop"``, ``"dgrad"`` or ``"wgrad"``) into
    ``out_dtype`` (fprop, dgrad: bfloat16 or float16; wgrad: float32 or bfloat16), such as
    ``"no FP8 wgrad kernel writes torch.float16"``, or ``None`` when one is compiled."""
    if (op, out_dtype) in _FP8_KERNELS:
        return None
    if op not in {o for o, _ in _FP8_KERNELS}:
        return f"no FP8 kernel for op {op!r} (expected 'fprop', 'dgrad' or 'wgrad')"
    return f"no FP8 {op} kernel writes {out_dtype}"


#: Mean tokens per expert from which an accumulating fp32 wgrad adds by TMA reduce-add
#: (H200, DEVICE_RUNS 90: 0.95–1.10× the C-loading kernel's speed at 2048–6300 tokens
#: per expert; 0.72–0.91× at 256–512, where L2's read-modify-write is the bottleneck).
ADD_FROM_TOKENS_PER_EXPERT = 1024


def _fp8_variant(
    op: str, out_dtype: torch.dtype, *, accumulate: bool = False, tokens_per_expert: float = 0.0
) -> str:
    reason = fp8_unsupported_reason(op, out_dtype)
    if reason is not None:
        raise TypeError(reason)
    adding = _FP8_ADDING.get((op, out_dtype))
    if accumulate and adding is not None and tokens_per_expert >= ADD_FROM_TOKENS_PER_EXPERT:
        return adding
    return _FP8_KERNELS[(op, out_dtype)]


def fp8_fprop(
    x_data: torch.Tensor,
    x_scales: torch.Tensor,
    w_data: torch.Tensor,
    w_scales: torch.Tensor,
    splits_E: torch.Tensor,
    out: torch.Tensor,
    *,
    plan: Plan | None = None,
) -> None:
    """``out[rows of e] = x_e @ w_e.T`` from FP8 operands for every expert e (writes ``out``).

    Args:
        x_data: ``(T, K)`` ``torch.float8_e4m3fn``, rows grouped by expert.
        x_scales: ``(T, K / 128)`` float32 with strides ``(1, T)``.
        w_data: ``(E, N, K)`` ``torch.float8_e4m3fn``, contiguous.
        w_scales: ``(E, N / 128, K / 128)`` float32, contiguous.
        splits_E: ``(E,)`` int64 tokens per expert, on the GPU (never read by the host).
        out: ``(T, N)`` bfloat16 or float16, contiguous; overwritten (all NaN for malformed
            ``splits_E``: csrc/setup_common.cuh).
        plan: the FP8 variant (compiled, for this op and ``out``'s dtype) and
            the scheduler's tile order; ``None``: the default set's kernel,
            swizzle 1, along M.
    """
    plan = plan or _FP8_PLANS[_fp8_variant("fprop", out.dtype)]
    _extension(plan.variant).fp8_fprop(
        x_data, x_scales, w_data, w_scales, splits_E, out,
        plan.variant, plan.max_swizzle, plan.raster_along_n,
    )  # fmt: skip


def fp8_dgrad(
    dy_data: torch.Tensor,
    dy_scales: torch.Tensor,
    wt_data: torch.Tensor,
    w_scales: torch.Tensor,
    splits_E: torch.Tensor,
    out: torch.Tensor,
    *,
    plan: Plan | None = None,
) -> None:
    """``out[rows of e] = dy_e @ w_e`` from FP8 operands for every expert e (writes ``out``).

    Args:
        dy_data: ``(T, N)`` ``torch.float8_e4m3fn``, rows grouped by expert.
        dy_scales: ``(T, N / 128)`` float32 with strides ``(1, T)``.
        wt_data: ``(E, K, N)`` ``torch.float8_e4m3fn``, the weights transposed, contiguous.
        w_scales: ``(E, N / 128, K / 128)`` float32, the weights' scales, contiguous.
        splits_E: ``(E,)`` int64 tokens per expert, on the GPU (never read by the host).
        out: ``(T, K)`` bfloat16 or float16, contiguous; overwritten (all NaN for malformed
            ``splits_E``: csrc/setup_common.cuh).
        plan: as for :func:`fp8_fprop`.
    """
    plan = plan or _FP8_PLANS[_fp8_variant("dgrad", out.dtype)]
    _extension(plan.variant).fp8_dgrad(
        dy_data, dy_scales, wt_data, w_scales, splits_E, out,
        plan.variant, plan.max_swizzle, plan.raster_along_n,
    )  # fmt: skip


def fp8_wgrad(
    dy_data: torch.Tensor,
    dy_scales: torch.Tensor,
    dy_row_offsets: torch.Tensor,
    x_data: torch.Tensor,
    x_scales: torch.Tensor,
    x_row_offsets: torch.Tensor,
    splits_E: torch.Tensor,
    tokens: int,
    out: Group,
    accumulate: bool,
    *,
    plan: Plan | None = None,
) -> None:
    """``out[e] = dy_e.T @ x_e`` (``accumulate``: ``out[e] += ...``) from FP8 segments forms.

    Overwriting never reads ``out``; an expert with no tokens gets exact zeros
    (overwrite) or is left untouched (accumulate). Accumulating into fp32 with
    at least :data:`ADD_FROM_TOKENS_PER_EXPERT` tokens per expert on average
    runs the kernel that adds by TMA reduce-add (L2 adds each fp32 result to
    ``out``: the same rounding as ``out += result``).

    Args:
        dy_data: ``(N, Tp)`` e4m3, expert e's tokens in columns ``[off_e, off_e +
            splits_E[e])``, ``off_e`` the earlier splits' sum, each rounded up to 16.
        dy_scales: ``(NB, N)`` float32, expert e's 128-token blocks in consecutive rows.
        dy_row_offsets: ``dy.row_offsets``, ``(E + 1,)`` int64 on the GPU.
        x_data, x_scales, x_row_offsets: ``x``'s (``(K, Tp)``, ``(NB, K)``), like ``dy``'s.
        splits_E: ``(E,)`` int64 tokens per expert, on the GPU (never read by the host);
            malformed, or other than an operand's own: every ``out[e]`` NaN (fp8_setup.cu).
        tokens: ``T``, the tokens of all experts together.
        out: ``E`` row-major ``(N, K)`` tensors, or one ``(E, N, K)`` tensor in a
            list; float32 or bfloat16, one dtype, 16-byte aligned. Mutated.
        accumulate: add to ``out`` instead of overwriting it.
        plan: as for :func:`fp8_fprop`; a variant that adds (``Fp8Variant.adds``)
            needs ``accumulate``.
    """
    if len(out) == 0:
        return
    if plan is None:
        per_expert = tokens / group_size(out)
        plan = _FP8_PLANS[_fp8_variant(
            "wgrad", out[0].dtype, accumulate=accumulate, tokens_per_expert=per_expert)]  # fmt: skip
    _extension(plan.variant).fp8_wgrad(
        dy_data, dy_scales, dy_row_offsets, x_data, x_scales, x_row_offsets, splits_E, tokens,
        list(out), accumulate, plan.variant, plan.max_swizzle, plan.raster_along_n,
    )  # fmt: skip


def fp8_elementwise(kernel: str, *args: object) -> Any:
    """Runs the hand-written FP8 kernel bound as ``kernel`` (csrc/fp8_elementwise_binding.cpp:
    ``fp8_segments``, the one-read activation quantizer, ``_fp8_ops.segments_ref``'s results bit
    for bit; ``fp8_swiglu_backward``, ``_swiglu_fp8.backward_ref``'s) into the caller's outputs;
    ``fp8_offsets`` returns ``_fp8_ops.offsets_ref``'s three tensors."""
    return getattr(_extension(), kernel)(*args)
