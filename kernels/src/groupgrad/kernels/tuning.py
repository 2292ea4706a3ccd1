"""Kernel plans, variants, builds and per-call host stages: what benchmarks and tuning use.

The public functions of :mod:`groupgrad.kernels` choose a CUTLASS kernel per
call and fall back to the reference by themselves; this module opens that
machinery for measuring and tuning it, so benchmarks need no private module:

* **Variants** — the compiled kernels: :class:`Variant` (op, dtypes,
  schedule, tile, cluster, epilogue subtile), :data:`VARIANTS` (the default
  set every GPU call may use), :data:`TUNING_VARIANTS` (extra bf16
  configurations compiled only on request), :data:`VARIANT_SETS`
  (``"default"`` and ``"tuning"``, each with its FP8 kernels).
* **Builds** — :func:`build` compiles (or loads from the cache) one variant
  set, :func:`compiled_variants` names what is loaded. ``python -m
  groupgrad.kernels.build`` is the same build from the command line.
* **Plans** — :class:`Plan` names the variant, raster order and swizzle of
  one call; :func:`plan_for` is the choice the public functions make
  (:data:`LARGE_GROUP_ROWS` is its threshold); :func:`run_cutlass`
  launches a CUTLASS kernel with any plan, skipping validation and fallback;
  :func:`run_fp8_cutlass` launches a named FP8 variant (the tuning set's FP8
  configurations, ``Fp8Variant`` in ``groupgrad.kernels.build``) likewise,
  in any tile order; :func:`fp8_variant_for` names the FP8 kernel the
  public functions choose.
* **Fallbacks** — :func:`fallback_reason` says why a call would run on the
  reference path; :func:`triton_unavailable_reason` loads the Triton SwiGLU
  kernels and says why they cannot run, if they cannot.
* **Per-call timing (unstable)** — :func:`host_stages` hands out each layer
  of one call (validation, support check, plan, C++ launch, CUDA kernel of
  the op, custom op, public function) as a callable, to time its host (CPU)
  cost. Its stages follow the internal layers and change with them: for
  ``benchmarks/host_profile.py``, not for code that must keep working.

Importing this module neither initializes CUDA nor compiles; the CUTLASS
functions build the default variant set on first use. Variants and plans are
for sm_90a (H100/H200); ``kernels/NOTES.md`` records what they measured.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, cast

import torch
from torch import Tensor

from groupgrad.kernels import (
    Fp8Blocks,
    _api,
    _cutlass,
    _group,
    _ops,
    _support,
    _swiglu,
    _validate,
)
from groupgrad.kernels._cutlass import build, compiled_variants
from groupgrad.kernels._group import op_form
from groupgrad.kernels._support import LARGE_GROUP_ROWS, Plan, plan_for
from groupgrad.kernels.build import TUNING_VARIANTS, VARIANT_SETS, VARIANTS, Variant

__all__ = [
    "LARGE_GROUP_ROWS",
    "TUNING_VARIANTS",
    "VARIANTS",
    "VARIANT_SETS",
    "Plan",
    "Variant",
    "build",
    "compiled_variants",
    "fallback_reason",
    "fp8_variant_for",
    "host_stages",
    "plan_for",
    "run_cutlass",
    "run_fp8_cutlass",
    "triton_unavailable_reason",
]

Op = Literal["fprop", "dgrad", "wgrad"]
Group = Tensor | Sequence[Tensor]


def run_cutlass(
    op: Op,
    a: Tensor,
    b: Group,
    splits: Tensor,
    out: Group,
    *,
    accumulate: bool = False,
    plan: Plan | None = None,
) -> None:
    """Launch the CUTLASS kernel of one grouped GEMM with a chosen plan, and nothing else.

    No validation, no support check, no fallback, no custom op: the operands
    must be what ``grouped_<op>`` would hand CUTLASS (:func:`fallback_reason`
    is ``None`` for them). Builds the default variant set on first use. For
    wgrad, an expert with no tokens gets exact zeros (overwrite) or is left
    untouched (accumulate).

    Args:
        op: ``"fprop"`` (``y_e = x_e @ w_e.T``), ``"dgrad"`` (``dx_e = dy_e @
            w_e``) or ``"wgrad"`` (``dw_e = dy_e.T @ x_e``).
        a: ``x`` ``(T, K)`` for fprop, ``dy`` ``(T, N)`` for dgrad and wgrad: a
            contiguous CUDA tensor, bf16 or fp16.
        b: for fprop and dgrad the weights, an ``(E, N, K)`` contiguous tensor
            or a sequence of ``E`` ``(N, K)`` row-major matrices in ``a``'s
            dtype; for wgrad ``x``, ``(T, K)`` contiguous in ``a``'s dtype.
        splits: ``(E,)`` contiguous int64 token counts on ``a``'s device.
        out: overwritten (fprop ``(T, N)``, dgrad ``(T, K)``: contiguous, in
            ``a``'s dtype) or, for wgrad, written in place: an ``(E, N, K)``
            contiguous tensor or ``E`` ``(N, K)`` row-major matrices (e.g. each
            expert's ``main_grad``), in ``a``'s dtype or fp32.
        accumulate: wgrad only: add into ``out`` instead of overwriting it
            (without reading it).
        plan: the variant to run (it must be compiled: see :func:`build`);
            ``None`` takes :func:`plan_for`'s choice.

    Returns:
        ``None``; ``out`` holds the result.

    Raises:
        ValueError: ``op`` is not one of the three, or ``splits`` is not a
            contiguous 1-D int64 tensor on ``a``'s device (the kernels read it as such).
    """
    if op not in ("fprop", "dgrad", "wgrad"):
        raise ValueError(f"op is {op!r}, expected 'fprop', 'dgrad' or 'wgrad'")
    if (
        not isinstance(splits, Tensor)
        or splits.dtype != torch.int64
        or splits.dim() != 1
        or not splits.is_contiguous()
    ):
        got = (
            f"dtype {splits.dtype}, shape {tuple(splits.shape)}, strides {splits.stride()}"
            if isinstance(splits, Tensor)
            else type(splits).__name__
        )
        raise ValueError(f"splits must be a contiguous 1-D int64 tensor of token counts, got {got}")
    if splits.device != a.device:
        raise ValueError(f"splits is on {splits.device}, expected {a.device} like the operands")
    if op == "wgrad":
        _cutlass.wgrad(a, cast(Tensor, b), splits, op_form(out), accumulate, plan=plan)
    elif op == "fprop":
        _cutlass.fprop(a, op_form(b), splits, cast(Tensor, out), plan=plan)
    else:
        _cutlass.dgrad(a, op_form(b), splits, cast(Tensor, out), plan=plan)


def fp8_variant_for(
    op: Op, out_dtype: torch.dtype, *, accumulate: bool = False, tokens_per_expert: float = 0.0
) -> str:
    """The default set's FP8 kernel that ``grouped_<op>`` runs for this call.

    Args:
        op: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``.
        out_dtype: the output's dtype.
        accumulate: wgrad only: the call adds into ``out``.
        tokens_per_expert: wgrad only: ``T / E`` of the call (an accumulating
            fp32 wgrad adds by TMA reduce-add from
            ``_cutlass.ADD_FROM_TOKENS_PER_EXPERT`` tokens per expert).

    Returns:
        The variant's name (``Fp8Variant.name``), for :func:`run_fp8_cutlass`.

    Raises:
        TypeError: No FP8 kernel writes ``out_dtype`` for ``op``.
    """
    return _cutlass._fp8_variant(
        op, out_dtype, accumulate=accumulate, tokens_per_expert=tokens_per_expert
    )


def run_fp8_cutlass(
    op: Op,
    a: Fp8Blocks,
    b: Fp8Blocks,
    splits: Tensor,
    out: Group,
    *,
    variant: str,
    accumulate: bool = False,
    max_swizzle: int = 1,
    raster_along_n: bool = False,
) -> None:
    """Launch one FP8 CUTLASS kernel variant on quantized operands, and nothing else.

    No validation, no fallback, no custom op: the operands must be what
    ``grouped_<op>`` would hand CUTLASS for them (from
    :func:`~groupgrad.kernels.quantize_fp8`:
    fprop/dgrad ``(1, 128)`` rows and ``(128, 128)`` weights, wgrad ``(128,
    1)`` segments of both). For the benchmark's sweep over the FP8 tuning
    variants (``build(variant_set="tuning")`` first).

    Args:
        op: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``.
        a: ``x`` (fprop) or ``dy`` (dgrad, wgrad).
        b: the weights (fprop, dgrad) or ``x`` (wgrad).
        splits: ``(E,)`` contiguous int64 token counts on the operands' device.
        out: as for :func:`run_cutlass`; wgrad's in fp32 or bf16.
        variant: the compiled FP8 variant's name (``Fp8Variant.name``).
        accumulate: wgrad only: add into ``out``.
        max_swizzle, raster_along_n: the persistent scheduler's tile order (1
            and along M: what the ops run; checked as a :class:`Plan`'s).

    Returns:
        ``None``; ``out`` holds the result.
    """
    order = {"plan": Plan(variant, raster_along_n, max_swizzle)}
    if op == "wgrad":
        _cutlass.fp8_wgrad(
            a.data, a.scales, cast(Tensor, a.row_offsets), b.data, b.scales,
            cast(Tensor, b.row_offsets), splits, a.shape[0], op_form(out), accumulate, **order,
        )  # fmt: skip
    elif op == "fprop":
        _cutlass.fp8_fprop(a.data, a.scales, b.data, b.scales, splits, cast(Tensor, out), **order)
    else:
        _cutlass.fp8_dgrad(
            a.data, a.scales, cast(Tensor, b.data_t), b.scales, splits, cast(Tensor, out), **order
        )


def fallback_reason(op: Op, a: Tensor, b: Group, out: Group) -> str | None:
    """Why a valid call would run on the reference path instead of CUTLASS, or ``None``.

    The same decision the CUDA kernels of the custom ops make (the support
    check of the operands, then whether the backend loads and runs on their
    device), without logging it. Never compiles; initializes CUDA only for
    CUDA tensors.

    Args:
        op: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``.
        a: ``x`` ``(T, K)`` for fprop, ``dy`` ``(T, N)`` for dgrad and wgrad.
        b: the weights (``(E, N, K)`` or ``E`` ``(N, K)`` matrices) for fprop
            and dgrad, ``x`` ``(T, K)`` for wgrad.
        out: ``(T, N)`` for fprop, ``(T, K)`` for dgrad; for wgrad an
            ``(E, N, K)`` tensor or ``E`` ``(N, K)`` matrices.

    Returns:
        The reason the fallback would log, or ``None`` when CUTLASS runs the call.
    """
    if op == "wgrad":
        return _ops.cutlass_or_reason(op, a, b, op_form(out))[1]
    return _ops.cutlass_or_reason(op, a, op_form(b), out)[1]


def triton_unavailable_reason() -> str | None:
    """Load the Triton SwiGLU kernels (once) and say why they cannot run, if they cannot.

    Without them, :func:`~groupgrad.kernels.swiglu_probs` and its backward run
    the PyTorch reference on CUDA (and say so once through :mod:`logging`).

    Returns:
        ``None`` when the kernels load, else why not (e.g. triton is not installed).
    """
    return _swiglu.load_triton_kernels()[1]


def host_stages(
    op: Op, a: Tensor, b: Group, splits: _api.Splits, out: Group, *, accumulate: bool = False
) -> dict[str, Callable[[], object]]:
    """Each layer of one grouped-GEMM call as a callable, to time its host (CPU) cost (unstable).

    Every callable runs one layer of ``grouped_<op>(a, b, splits, out=out)``
    on the same arguments, outermost last:

    * ``"validate"``: argument checks and normalization;
    * ``"support check"``: whether CUTLASS can take the operands;
    * ``"fallback check"``: the support check, the backend and the device;
    * ``"plan"``: :func:`plan_for`;
    * ``"C++ launch"``: the extension's entry point with the plan (and the
      extension lookup);
    * ``"CUTLASS backend"``: plan and launch;
    * ``"CUDA kernel of the op"``: the fallback check, then the backend or
      the reference (what plain eager calls run);
    * ``"custom op"``: ``torch.ops.groupgrad.grouped_<op>``;
    * ``"public"``: ``grouped_<op>`` itself.

    The launching stages need CUDA tensors of a call that CUTLASS runs
    (:func:`fallback_reason` is ``None``); they build the default variant
    set on first use. Each call writes ``out`` as the public call would.

    Args:
        op: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``.
        a: ``x`` for fprop, ``dy`` for dgrad and wgrad.
        b: the weights for fprop and dgrad, ``x`` for wgrad.
        splits: the token counts, in any form the public function takes.
        out: the output (required): as ``out=`` of the public function.
        accumulate: wgrad only: add into ``out`` instead of overwriting it.

    Returns:
        Stage name → zero-argument callable, in the order above.
    """
    if op == "wgrad":
        return _wgrad_stages(a, b, splits, out, accumulate)
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor for {op}, got {type(out).__name__}")
    call = _validate.grouped_call(op, a, b, splits, out)
    x, w, y, listed = call.a, call.weights, call.out, call.listed
    splits_E = _group.on_device(call.splits, x.device)
    plan = _cutlass.default_plan(op, x, w, y)
    launch = _cutlass.fprop if op == "fprop" else _cutlass.dgrad
    kernel = _ops.fprop_on_device if op == "fprop" else _ops.dgrad_on_device
    public = _api.grouped_fprop if op == "fprop" else _api.grouped_dgrad
    custom_op = getattr(torch.ops.groupgrad, f"grouped_{op}")

    def cxx() -> None:
        extension = _cutlass._extension(plan.variant)
        getattr(extension, op)(x, w, splits_E, y, plan.variant, False, 1)

    return {
        "validate": lambda: _validate.grouped_call(op, a, b, splits, out),
        "support check": lambda: _support.unsupported_reason(op, x, w, y, listed=listed),
        "fallback check": lambda: _ops.cutlass_or_reason(op, x, w, y, listed),
        "plan": lambda: _cutlass.default_plan(op, x, w, y),
        "C++ launch": cxx,
        "CUTLASS backend": lambda: launch(x, w, splits_E, y),
        "CUDA kernel of the op": lambda: kernel(x, w, call.splits, y, listed=listed),
        "custom op": lambda: custom_op(x, w, call.splits, y),
        "public": lambda: public(a, b, splits, out=out),
    }


def _wgrad_stages(
    dy: Tensor, x: object, splits: _api.Splits, out: Group, accumulate: bool
) -> dict[str, Callable[[], object]]:
    call = _validate.wgrad_call(dy, x, splits, out, None, accumulate)
    dy_TN, x_TK, dw, listed = call.dy, call.x, call.out, call.listed
    splits_E = _group.on_device(call.splits, dy_TN.device)
    plan = _cutlass.default_plan("wgrad", dy_TN, x_TK, dw)
    out_seq = cast(Sequence[Tensor], out)  # a tensor or a sequence: one overload takes each

    def cxx() -> None:
        extension = _cutlass._extension(plan.variant)
        extension.wgrad(dy_TN, x_TK, splits_E, dw, accumulate, plan.variant, False, 1)

    return {
        "validate": lambda: _validate.wgrad_call(dy, x, splits, out, None, accumulate),
        "support check": lambda: _support.unsupported_reason(
            "wgrad", dy_TN, x_TK, dw, listed=listed
        ),
        "fallback check": lambda: _ops.cutlass_or_reason("wgrad", dy_TN, x_TK, dw, listed),
        "plan": lambda: _cutlass.default_plan("wgrad", dy_TN, x_TK, dw),
        "C++ launch": cxx,
        "CUTLASS backend": lambda: _cutlass.wgrad(dy_TN, x_TK, splits_E, dw, accumulate),
        "CUDA kernel of the op": lambda: _ops.wgrad_on_device(
            dy_TN, x_TK, call.splits, dw, accumulate, listed=listed
        ),
        "custom op": lambda: torch.ops.groupgrad.grouped_wgrad(
            dy_TN, x_TK, call.splits, dw, accumulate
        ),
        "public": lambda: _api.grouped_wgrad(dy, x_TK, splits, out=out_seq, accumulate=accumulate),
    }
