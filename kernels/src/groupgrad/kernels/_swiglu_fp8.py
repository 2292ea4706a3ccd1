"""SwiGLU × router probabilities on FP8 operands: the fused MLP's elementwise step, quantizing too.

Legend: ``T`` tokens, ``F`` ffn_hidden_size, ``E`` experts; ``h_T2F`` fc1's
output (gate then up), ``a_TF`` the activation, ``da_TF`` its gradient,
``dh_T2F`` fc1's output gradient, ``probs_T`` the router probabilities.
Blocks and layouts: :class:`~groupgrad.kernels.Fp8Blocks`.

In the blockwise FP8 MLP every tensor between the two GEMMs is read or
written in an FP8 form. These two ops do the SwiGLU step and the
quantizations around it in one pass each way, where the unfused chain runs
four steps forward (quantize ``h``, dequantize it, SwiGLU, quantize ``a``)
and four backward (dequantize ``h``, SwiGLU backward, quantize ``dh``,
quantize ``a``), each one or more kernels::

    forward   h (bf16)  ->  h (1, 128)  [kept]  and  a (1, 128)  [fc2 fprop]
    backward  da, h (1, 128) [kept]  ->  dh (1, 128) [fc1 dgrad], dh (128, 1)
              [fc1 wgrad], a (128, 1) [fc2 wgrad], dprobs

Semantics (the ``*_ref`` twins run exactly this chain): the SwiGLU reads
``h`` dequantized from its ``(1, 128)`` form and rounded to ``h``'s dtype,
in forward and backward alike, so backward recomputes the forward's ``a``;
``a`` and ``dh`` are rounded to ``h``'s dtype (:func:`swiglu_probs_ref`,
:func:`swiglu_probs_backward_ref`) and then quantized as
:func:`quantize_fp8_ref` quantizes them (one scale rule). Each FP8 form is
quantized from an unquantized value, never from another FP8 form. On CUDA
fused Triton kernels run (``_swiglu_fp8_triton``; the reference when Triton
cannot be imported or the GPU predates sm_89, said once through
``logging``); their quantizations use the same scale rule and rounding, and
their SwiGLU the same expressions, so they differ from the reference only
where the fp32 ``sigmoid`` does (a rounding of ``a`` or ``dh`` at most one
bf16 step apart) and in ``dprobs``' summation order. On sm_90 the backward
of a 16-bit ``da`` runs as one CUDA kernel instead, where the extension
builds (``csrc/swiglu_fp8_backward.cu``, routed as ``_fp8_ops.cuda_quantizer``
routes the activation quantizer): Triton's expressions, one read of ``da``
and ``h``.

Custom ops ``groupgrad::swiglu_probs_fp8`` and ``…_backward_fp8`` (fake
kernels for ``torch.compile``); plain eager calls run their kernels directly
(``_fp8_ops.direct_or_op``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from groupgrad.kernels._fp8 import ROWS, SEGMENTS, Fp8Blocks, check_splits, segment_offsets
from groupgrad.kernels._fp8_ops import (
    cuda_quantizer,
    direct_or_op,
    rows_ref,
    segments_ref,
    triton_for,
)
from groupgrad.kernels._swiglu import (
    check_elementwise_tensors,
    check_probs,
    check_swiglu_args,
    swiglu_backward_math,
    swiglu_math,
)
from groupgrad.kernels._validate import fp8_operand

__all__ = [
    "swiglu_probs_backward_fp8",
    "swiglu_probs_backward_fp8_ref",
    "swiglu_probs_fp8",
    "swiglu_probs_fp8_ref",
]

TRITON_MODULE = "groupgrad.kernels._swiglu_fp8_triton"
E4M3 = torch.float8_e4m3fn

Splits = Sequence[int] | Tensor


# ---------------------------------------------------------------- reference


def _nothing(like: Tensor) -> tuple[Tensor, Tensor]:
    """A form not asked for: new empty e4m3 data and fp32 scales (an op's outputs never alias)."""
    return like.new_empty(0, dtype=E4M3), like.new_empty(0, dtype=torch.float32)


def _dequantize_rows(data_TC: Tensor, scales_BT: Tensor, dtype: torch.dtype) -> Tensor:
    """A ``(1, 128)`` form's values in ``dtype``, as :meth:`Fp8Blocks.dequantize` then a cast."""
    T, C = data_TC.shape
    blocks = data_TC.float().view(T, C // 128, 128) * scales_BT.t()[:, :, None]
    return blocks.view(T, C).to(dtype)


def forward_ref(h: Tensor, probs: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(h_data, h_scales_BT, a_data, a_scales_BT)`` of a contiguous ``(T, 2F)`` ``h``."""
    h_data, h_scales = rows_ref(h)
    a_TF = swiglu_math(_dequantize_rows(h_data, h_scales, h.dtype), probs)
    return h_data, h_scales, *rows_ref(a_TF)


def backward_ref(
    da: Tensor, h_data: Tensor, h_scales: Tensor, probs: Tensor | None,
    row_offsets: Tensor, seg_offsets: Tensor, block_offsets: Tensor,
    num_blocks: int, padded_tokens: int, dh_rows: bool, dh_tokens: bool, a_tokens: bool,
) -> list[Tensor]:  # fmt: skip
    """The backward op's outputs (:func:`backward_op`), ``(0,)`` tensors for forms not asked."""
    h_T2F = _dequantize_rows(h_data, h_scales, da.dtype)
    dh_T2F, dprobs, a_TF = swiglu_backward_math(da, h_T2F, probs)
    offsets = (row_offsets, seg_offsets, block_offsets, num_blocks, padded_tokens, False)
    rows = rows_ref(dh_T2F) if dh_rows else _nothing(da)
    tokens = segments_ref(dh_T2F, *offsets)[:2] if dh_tokens else _nothing(da)
    a = segments_ref(a_TF, *offsets)[:2] if a_tokens else _nothing(da)
    return [*rows, *tokens, *a, _nothing(da)[1] if dprobs is None else dprobs]


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("groupgrad::swiglu_probs_fp8", mutates_args=())
def forward_op(h: Tensor, probs: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``h`` ``(T, 2F)`` -> ``(h_data, h_scales_BT, a_data, a_scales_BT)``: the ``(1, 128)`` forms."""
    return forward_ref(h, probs)


@torch.library.custom_op("groupgrad::swiglu_probs_backward_fp8", mutates_args=())
def backward_op(
    da: Tensor, h_data: Tensor, h_scales: Tensor, probs: Tensor | None,
    row_offsets: Tensor, seg_offsets: Tensor, block_offsets: Tensor,
    num_blocks: int, padded_tokens: int, dh_rows: bool, dh_tokens: bool, a_tokens: bool,
) -> list[Tensor]:  # fmt: skip
    """``[dh_data, dh_scales_BT, dh_tokens_data, dh_tokens_scales, a_tokens_data,
    a_tokens_scales, dprobs]`` (``(0,)`` where not asked, or without ``probs``)."""
    return backward_ref(
        da, h_data, h_scales, probs, row_offsets, seg_offsets, block_offsets,
        num_blocks, padded_tokens, dh_rows, dh_tokens, a_tokens,
    )  # fmt: skip


@forward_op.register_fake
def _forward_fake(h: Tensor, probs: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    T, C = h.shape
    new = h.new_empty
    F32 = torch.float32
    return new(T, C, dtype=E4M3), new(C // 128, T, dtype=F32), *(
        new(T, C // 2, dtype=E4M3), new(C // 256, T, dtype=F32)
    )  # fmt: skip


@backward_op.register_fake
def _backward_fake(
    da: Tensor, h_data: Tensor, h_scales: Tensor, probs: Tensor | None,
    row_offsets: Tensor, seg_offsets: Tensor, block_offsets: Tensor,
    num_blocks: int, padded_tokens: int, dh_rows: bool, dh_tokens: bool, a_tokens: bool,
) -> list[Tensor]:  # fmt: skip
    T, F = da.shape
    new, F32 = da.new_empty, torch.float32
    rows = (new(T, 2 * F, dtype=E4M3), new(2 * F // 128, T, dtype=F32)) if dh_rows else _nothing(da)
    tokens = (
        (new(2 * F, padded_tokens, dtype=E4M3), new(num_blocks, 2 * F, dtype=F32))
        if dh_tokens
        else _nothing(da)
    )
    a = (
        (new(F, padded_tokens, dtype=E4M3), new(num_blocks, F, dtype=F32))
        if a_tokens
        else _nothing(da)
    )
    dprobs = new(0, dtype=F32) if probs is None else torch.empty_like(probs)
    return [*rows, *tokens, *a, dprobs]


def _triton_for(t: Tensor) -> ModuleType | None:
    return triton_for(t, TRITON_MODULE, "the FP8 SwiGLU")


@forward_op.register_kernel("cuda")
def _forward_cuda(h: Tensor, probs: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    kernels = _triton_for(h)
    return forward_ref(h, probs) if kernels is None else kernels.forward_triton(h, probs)


@backward_op.register_kernel("cuda")
def _backward_cuda(da: Tensor, *args: Any) -> list[Tensor]:
    h_data, padded_tokens = args[0], args[7]
    cutlass = cuda_quantizer(da, padded_tokens) if h_data.data_ptr() % 16 == 0 else None
    if cutlass is not None:
        return _backward_one_kernel(cutlass, da, *args)
    kernels = _triton_for(da)
    return backward_ref(da, *args) if kernels is None else kernels.backward_triton(da, *args)


def _backward_one_kernel(cutlass: ModuleType, da: Tensor, *args: Any) -> list[Tensor]:
    """The backward in one CUDA kernel (csrc/swiglu_fp8_backward.cu: da and h read once; about
    1.5x as fast as Triton's two kernels on the H200, DEVICE_RUNS 146), into the fake's outputs;
    then ``dprobs``, Triton's fixed-order sum of the kernel's per-block sums."""
    outs = _backward_fake(da, *args)
    h_data, h_scales, probs, row, seg, block, num_blocks, padded_tokens = args[:8]
    T, F = da.shape
    p = None if probs is None else probs.float().contiguous()
    partial = da.new_empty((F // 128, T) if p is not None else (0,), dtype=torch.float32)
    cutlass.fp8_elementwise(
        "fp8_swiglu_backward", da, h_data, h_scales, p, row, seg, block, num_blocks,
        padded_tokens, *outs[:6], partial,
    )  # fmt: skip
    if probs is not None:
        outs[6] = partial.sum(dim=0).to(probs.dtype) if T and F else torch.zeros_like(probs)
    return outs


def _forward_call(h: Tensor, probs: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`forward_op`, directly in plain eager code (``_fp8_ops.direct_or_op``)."""
    kernels = (_forward_cuda, forward_ref)
    return direct_or_op("groupgrad::swiglu_probs_fp8", forward_op, kernels, [h, probs], h, probs)


def _backward_call(da: Tensor, *args: Any) -> list[Tensor]:
    """:func:`backward_op`, directly in plain eager code (``_fp8_ops.direct_or_op``)."""
    tensors = [da, *(a for a in args if isinstance(a, Tensor))]
    kernels = (_backward_cuda, backward_ref)
    return direct_or_op(
        "groupgrad::swiglu_probs_backward_fp8", backward_op, kernels, tensors, da, *args
    )


# ---------------------------------------------------------------- public entry points


def _forward(h_T2F: Tensor, probs_T: Tensor | None, run: Any) -> tuple[Fp8Blocks, Fp8Blocks]:
    check_swiglu_args(h_T2F, probs_T, op="swiglu_probs_fp8")
    if h_T2F.shape[1] % 256:
        raise ValueError(
            f"h has shape {tuple(h_T2F.shape)}, expected (T, 2F) with F a multiple of 128 "
            "(the FP8 blocks are 128 wide)"
        )
    h, probs = h_T2F.contiguous(), None if probs_T is None else probs_T.contiguous()
    h_data, h_scales, a_data, a_scales = run(h, probs)
    T, C = h.shape
    return (
        Fp8Blocks(h_data, h_scales.t(), block=ROWS, dtype=h.dtype, shape=(T, C))._sealed(),
        Fp8Blocks(a_data, a_scales.t(), block=ROWS, dtype=h.dtype, shape=(T, C // 2))._sealed(),
    )


def swiglu_probs_fp8(h_T2F: Tensor, probs_T: Tensor | None = None) -> tuple[Fp8Blocks, Fp8Blocks]:
    """The FP8 MLP's forward SwiGLU: ``h``'s ``(1, 128)`` form and ``a``'s, in one pass.

    ``h`` is quantized into ``(1, 128)`` blocks (what backward keeps); the
    SwiGLU reads those blocks dequantized (rounded to ``h``'s dtype) and
    computes ``a = silu(g) * u * probs[:, None]`` in fp32, rounded to ``h``'s
    dtype, then quantized into ``(1, 128)`` blocks (fc2's fprop operand), the
    scale rule of :func:`quantize_fp8`. On CUDA one fused Triton kernel runs
    (module notes: where it may differ from the reference); elsewhere the
    reference. Runs as the custom op ``groupgrad::swiglu_probs_fp8``
    (``torch.compile`` and CUDA graphs see it). Nothing is mutated.

    Args:
        h_T2F: ``(T, 2F)`` fc1 output, gate columns then up columns, bf16,
            fp16 or fp32, ``F`` a multiple of 128.
        probs_T: ``(T,)`` router probabilities (any floating dtype, on
            ``h``'s device), or ``None`` for ones.

    Returns:
        ``(h_rows, a_rows)``: the ``(1, 128)`` :class:`Fp8Blocks` of ``h``
        (``(T, 2F)``) and of ``a`` (``(T, F)``), both of ``h``'s dtype.

    Raises:
        TypeError: ``h`` is not bf16, fp16 or fp32, or ``probs`` not floating.
        ValueError: ``h`` is not ``(T, 2F)`` with ``F`` a multiple of 128, or
            ``probs`` is not ``(T,)`` on ``h``'s device.
    """
    return _forward(h_T2F, probs_T, _forward_call)


def swiglu_probs_fp8_ref(
    h_T2F: Tensor, probs_T: Tensor | None = None
) -> tuple[Fp8Blocks, Fp8Blocks]:
    """Pure-PyTorch twin of :func:`swiglu_probs_fp8`: same arguments, the reference chain.

    Args:
        h_T2F: as for :func:`swiglu_probs_fp8`.
        probs_T: as for :func:`swiglu_probs_fp8`.

    Returns:
        ``(h_rows, a_rows)`` as :func:`swiglu_probs_fp8` returns them.
    """
    return _forward(h_T2F, probs_T, forward_ref)


def _check_kept_h(h: object, T: int, F: int) -> Fp8Blocks:
    """The kept ``h``: a ``(1, 128)`` form in the layout the kernels read, ``(T, 2F)``."""
    h = fp8_operand("h", h, ROWS)  # a hand-built form with another layout is refused by name
    if tuple(h.shape) != (T, 2 * F) or h.dtype not in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
    ):
        raise ValueError(
            f"h has shape {tuple(h.shape)} and dtype {h.dtype}, expected (T, 2F) = {(T, 2 * F)} "
            "(da is (T, F)) of bf16, fp16 or fp32"
        )
    return h


def _check_flags(**flags: object) -> tuple[bool, bool, bool]:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} is {value!r}, expected True or False")
    return flags["dh_rows"], flags["dh_tokens"], flags["a_tokens"]  # type: ignore[return-value]


def _backward(
    da_TF: Tensor, h: Fp8Blocks, probs_T: Tensor | None, splits: Splits,
    forms: tuple[bool, bool, bool], run: Any,
) -> tuple[Fp8Blocks | None, Fp8Blocks | None, Tensor | None, Fp8Blocks | None]:  # fmt: skip
    if not isinstance(da_TF, Tensor) or not da_TF.dtype.is_floating_point:
        what = da_TF.dtype if isinstance(da_TF, Tensor) else type(da_TF).__name__
        raise TypeError(f"da is {what}, expected a floating-point (T, F) tensor")
    check_elementwise_tensors("swiglu_probs_backward_fp8", da=da_TF, probs=probs_T)
    if da_TF.dim() != 2:
        raise ValueError(f"da has shape {tuple(da_TF.shape)}, expected (T, F)")
    T, F = da_TF.shape
    if F % 128:
        raise ValueError(f"da has shape {(T, F)}, expected F a multiple of 128")
    h = _check_kept_h(h, T, F)
    device = h.data.device
    if da_TF.device != device:
        raise ValueError(f"da is on {da_TF.device}, expected h's device {device}")
    check_probs(probs_T, T, device)
    counts = check_splits(splits, T, device, "da")
    E = len(counts)
    row, seg, block = segment_offsets(counts, device, fused=run is _backward_call)
    num_blocks, padded = -(-T // 128) + E, -(-(T + 15 * E) // 16) * 16
    probs = None if probs_T is None else probs_T.contiguous()
    da = da_TF.contiguous().to(h.dtype)
    outs = run(
        da, h.data, h.scales.t(), probs, row, seg, block, num_blocks, padded, *forms
    )  # fmt: skip
    dh_rows, dh_tokens, a_tokens = forms
    meta: dict[str, Any] = {"dtype": h.dtype, "splits": splits}
    offsets: dict[str, Any] = {"row_offsets": row, "seg_offsets": seg, "block_offsets": block}
    return (
        Fp8Blocks(outs[0], outs[1].t(), block=ROWS, dtype=h.dtype, shape=(T, 2 * F))._sealed()
        if dh_rows
        else None,
        Fp8Blocks(outs[2], outs[3], block=SEGMENTS, shape=(T, 2 * F), **meta, **offsets)._sealed()
        if dh_tokens
        else None,
        None if probs_T is None else outs[6],
        Fp8Blocks(outs[4], outs[5], block=SEGMENTS, shape=(T, F), **meta, **offsets)._sealed()
        if a_tokens
        else None,
    )


def swiglu_probs_backward_fp8(
    da_TF: Tensor,
    h: Fp8Blocks,
    probs_T: Tensor | None = None,
    *,
    splits: Splits,
    dh_rows: bool = True,
    dh_tokens: bool = True,
    a_tokens: bool = True,
) -> tuple[Fp8Blocks | None, Fp8Blocks | None, Tensor | None, Fp8Blocks | None]:
    """The FP8 MLP's backward SwiGLU: ``dh``'s two forms, ``a``'s wgrad form and ``dprobs``, in one pass.

    Reads ``da`` (fc2's dgrad, unquantized) and the ``(1, 128)`` ``h`` that
    :func:`swiglu_probs_fp8` returned; the SwiGLU backward
    (:func:`swiglu_probs_backward`'s math on ``h`` dequantized and rounded
    to its dtype) gives ``dh`` and the forward's ``a``, each rounded to
    ``h``'s dtype and quantized: ``dh`` into ``(1, 128)`` blocks (fc1's
    dgrad) and ``(128, 1)`` blocks of ``splits`` (fc1's wgrad), ``a`` into
    ``(128, 1)`` blocks (fc2's wgrad). On an H100/H200 one CUDA kernel runs
    for a bf16 or fp16 ``h`` (where the GEMMs' extension builds), on other
    CUDA devices and for fp32 two fused Triton kernels, elsewhere the reference. Custom op ``groupgrad::swiglu_probs_backward_fp8``.
    Device ``splits`` are never read on the host. Nothing is mutated.

    Args:
        da_TF: ``(T, F)`` gradient of the activation, floating (cast to
            ``h``'s dtype), on ``h``'s device.
        h: the ``(1, 128)`` :class:`Fp8Blocks` of fc1's output, ``(T, 2F)``.
        probs_T: the forward's ``(T,)`` probabilities, or ``None``.
        splits: tokens per expert, as for :func:`quantize_fp8`.
        dh_rows: whether to write ``dh``'s ``(1, 128)`` form.
        dh_tokens: whether to write ``dh``'s ``(128, 1)`` form.
        a_tokens: whether to write ``a``'s ``(128, 1)`` form.

    Returns:
        ``(dh_rows, dh_tokens, dprobs, a_tokens)``: the forms asked for
        (``None`` for the others), ``dprobs`` ``(T,)`` in ``probs``' dtype
        (``None`` without ``probs``).

    Raises:
        TypeError: ``da`` is not a floating ``(T, F)`` tensor, ``h`` not an
            :class:`Fp8Blocks`, a flag not a bool, ``probs`` or ``splits`` of
            a wrong type.
        ValueError: ``h`` not of block ``(1, 128)`` or not in the layout
            :func:`quantize_fp8` writes, shapes that do not match, ``F`` not
            a multiple of 128, tensors on different devices, ``splits`` not
            summing to ``T``.
    """
    forms = _check_flags(dh_rows=dh_rows, dh_tokens=dh_tokens, a_tokens=a_tokens)
    return _backward(da_TF, h, probs_T, splits, forms, _backward_call)


def swiglu_probs_backward_fp8_ref(
    da_TF: Tensor,
    h: Fp8Blocks,
    probs_T: Tensor | None = None,
    *,
    splits: Splits,
    dh_rows: bool = True,
    dh_tokens: bool = True,
    a_tokens: bool = True,
) -> tuple[Fp8Blocks | None, Fp8Blocks | None, Tensor | None, Fp8Blocks | None]:
    """Pure-PyTorch twin of :func:`swiglu_probs_backward_fp8`: same arguments, the reference chain.

    Args:
        da_TF: as for :func:`swiglu_probs_backward_fp8`.
        h: as for :func:`swiglu_probs_backward_fp8`.
        probs_T: as for :func:`swiglu_probs_backward_fp8`.
        splits: as for :func:`swiglu_probs_backward_fp8`.
        dh_rows: as for :func:`swiglu_probs_backward_fp8`.
        dh_tokens: as for :func:`swiglu_probs_backward_fp8`.
        a_tokens: as for :func:`swiglu_probs_backward_fp8`.

    Returns:
        As :func:`swiglu_probs_backward_fp8` returns.
    """
    forms = _check_flags(dh_rows=dh_rows, dh_tokens=dh_tokens, a_tokens=a_tokens)
    return _backward(da_TF, h, probs_T, splits, forms, backward_ref)
