"""Triton kernels of the FP8 SwiGLU (the math and layouts: ``_swiglu_fp8``, ``_fp8``).

Imported only by the CUDA kernels of the ``groupgrad::swiglu_probs*_fp8``
custom ops (and by GPU tests): importing ``groupgrad.kernels`` never imports
Triton. The scale rule and the e4m3 rounding are the quantizers' own
(``_fp8_triton``); the SwiGLU expressions are ``_swiglu_triton``'s.

Legend: ``T`` tokens, ``F`` ffn_hidden_size, ``j`` a 128-column block of
``a`` (gate block ``j`` and up block ``F/128 + j`` of ``h``), ``E``
experts, ``NB`` scale rows and ``Tp`` padded tokens of the ``(128, 1)`` form.

* Forward: a program owns ``BLOCK_T`` rows × block ``j``: it reads ``g`` and
  ``u`` (bf16) once, writes their ``(1, 128)`` blocks and scales, and the
  ``(1, 128)`` block of ``a`` computed from their dequantized values. Bytes
  per token: ``4F`` read, ``3F`` (plus scales) written.
* Backward: two kernels (measured on the H200, DEVICE_RUNS 86: 1.3-1.5x faster
  than one kernel making two passes over each 128-token block, whose
  token-contiguous stores of 32-token slices held it at 0.17x the copy rate).
  Rows: a program owns ``ROW_BLOCK`` rows × block ``j`` in ``ROW_SLICE``-row
  slices; it computes ``dg``, ``du`` and writes ``dh``'s ``(1, 128)`` blocks
  (a row's 128 columns are all in the slice) and ``dprobs``' partial sum over
  the block's columns. Tokens: a program owns one 128-token block ``b`` of
  one expert (found from ``block_offsets``, as the ``(128, 1)`` quantizer
  does) × ``TOKEN_CHANNELS`` channels, the programs of one block row next to
  each other; in one pass it computes ``dg``, ``du`` and ``a`` of those
  channels, their column scales, and writes the ``(128, 1)`` forms
  token-contiguous. Both recompute the SwiGLU from ``da`` and ``h`` (the
  second read mostly from L2). ``dprobs`` is the sum of the ``F/128`` partial
  sums, in a fixed order (no atomics). Token programs past the last expert
  zero their scale rows and, between them, the data's tail columns; malformed
  device ``splits`` give every token program the quantizer's in-bounds
  stand-in and NaN scales (``_fp8_triton._segment``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from groupgrad.kernels._fp8_triton import (
    _abs_bits,
    _e4m3,
    _poisoned,
    _scale_rule,
    _segment,
    on_device,
)

__all__ = ["backward_triton", "forward_triton"]

E4M3 = torch.float8_e4m3fn
FORWARD_ROWS, FORWARD_WARPS = 32, 4  # rows and warps per forward program
ROW_BLOCK, ROW_SLICE, ROW_WARPS = 32, 16, 4  # backward rows kernel: rows, slice, warps
# backward tokens kernel: channels a program, warps (8 x 2: many small programs a SM, 1.16-1.20x
# the 16 x 4 of DEVICE_RUNS 86 over the whole backward, bit-identical: DEVICE_RUNS 92)
TOKEN_CHANNELS, TOKEN_WARPS = 8, 2


@triton.jit
def _quantize_rows(x, data_ptr, scales_ptr, offsets, scale_offsets, ok):
    """Write ``x``'s ``(1, 128)`` blocks (``x``: ``[rows, 128]``) and scales; return them dequantized."""
    scale, inverse, finite = _scale_rule(tl.max(_abs_bits(x), axis=1))
    q = _e4m3(x, inverse[:, None], finite[:, None])
    tl.store(data_ptr + offsets, q, mask=ok[:, None])
    tl.store(scales_ptr + scale_offsets, scale, mask=ok)
    return q.to(tl.float32) * scale[:, None]


@triton.jit
def _dequantized(data_ptr, scales_ptr, offsets, scale_offsets, ok, ROUND_TO: tl.constexpr):  # type: ignore[no-untyped-def]
    """A ``(1, 128)`` block's values, rounded to the source dtype, in fp32."""
    q = tl.load(data_ptr + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    scale = tl.load(scales_ptr + scale_offsets, mask=ok, other=0.0)
    return (q * scale[:, None]).to(ROUND_TO).to(tl.float32)


@triton.jit
def _swiglu_fp8_forward_kernel(  # type: ignore[no-untyped-def]
    h_ptr, probs_ptr, h_data_ptr, h_scales_ptr, a_data_ptr, a_scales_ptr, T, F,
    HAS_PROBS: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.program_id(1).to(tl.int64)
    ok = rows < T
    g_offsets = rows[:, None] * (2 * F) + (j * 128 + tl.arange(0, 128))[None, :]
    dtype = h_ptr.dtype.element_ty
    g = tl.load(h_ptr + g_offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    u = tl.load(h_ptr + g_offsets + F, mask=ok[:, None], other=0.0).to(tl.float32)
    g_scales, u_scales = j * T + rows, (F // 128 + j) * T + rows
    # the SwiGLU reads the blocks as the backward will: dequantized, rounded to h's dtype
    g = _quantize_rows(g, h_data_ptr, h_scales_ptr, g_offsets, g_scales, ok)
    u = _quantize_rows(u, h_data_ptr, h_scales_ptr, g_offsets + F, u_scales, ok)
    g, u = g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32)
    act = g * tl.sigmoid(g) * u
    if HAS_PROBS:
        act = act * tl.load(probs_ptr + rows, mask=ok, other=0.0).to(tl.float32)[:, None]
    act = act.to(dtype).to(tl.float32)
    a_offsets = rows[:, None] * F + (j * 128 + tl.arange(0, 128))[None, :]
    _quantize_rows(act, a_data_ptr, a_scales_ptr, a_offsets, j * T + rows, ok)


@triton.jit
def _swiglu_grads(  # type: ignore[no-untyped-def]
    da_ptr, h_data_ptr, h_scales_ptr, probs_ptr, rows, ok, j, channels, T, F,
    HAS_PROBS: tl.constexpr,
):  # fmt: skip
    """``(dg, du, a, dprobs_part)`` of ``[rows, channels]`` (channels of block ``j``),
    rounded as the reference rounds (``dprobs_part``: summed over those channels)."""
    dtype = da_ptr.dtype.element_ty
    g_offsets = rows[:, None] * (2 * F) + channels[None, :]
    g = _dequantized(h_data_ptr, h_scales_ptr, g_offsets, j * T + rows, ok, dtype)
    u = _dequantized(h_data_ptr, h_scales_ptr, g_offsets + F, (F // 128 + j) * T + rows, ok, dtype)
    a_offsets = rows[:, None] * F + channels[None, :]
    da = tl.load(da_ptr + a_offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    act = silu * u
    part = tl.zeros_like(tl.sum(act, axis=1))
    if HAS_PROBS:
        p = tl.load(probs_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        part = tl.sum(da * act, axis=1)
        act = act * p[:, None]
        da = da * p[:, None]
    dg = da * u * sig * (1.0 + g * (1.0 - sig))
    du = da * silu
    rounded = (dg.to(dtype).to(tl.float32), du.to(dtype).to(tl.float32))
    return rounded[0], rounded[1], act.to(dtype).to(tl.float32), part


@triton.jit
def _zero_tail(data_ptr, channels, start, padded_tokens, step, CH: tl.constexpr):  # type: ignore[no-untyped-def]
    """Zeros in ``channels`` (``CH`` of them) from column ``start`` on, every ``step``."""
    stop = start * 0 + padded_tokens
    zeros = tl.zeros([CH, 128], tl.float32).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    for first in range(start, stop, step):
        columns = first + tl.arange(0, 128)
        offsets = channels[:, None] * padded_tokens + columns[None, :]
        tl.store(data_ptr + offsets, zeros, mask=(columns < stop)[None, :])


@triton.jit
def _token_form(x, scales_ptr, scale_offsets, data_ptr, channels, columns, keep, padded_tokens,
                malformed):  # fmt: skip
    """``x`` (``[128 tokens, channels]``) quantized by column: its ``(128, 1)`` scales (NaN
    for ``malformed`` splits), and its data token-contiguous in the ``(C, Tp)`` form (the
    tokens ``keep`` says)."""
    scale, inverse, finite = _scale_rule(tl.max(_abs_bits(x), axis=0))
    tl.store(scales_ptr + scale_offsets, _poisoned(scale, malformed))
    q = _e4m3(x, inverse[None, :], finite[None, :])
    offsets = channels[None, :] * padded_tokens + columns[:, None]
    tl.store(data_ptr + offsets, q, mask=keep[:, None])


@triton.jit
def _swiglu_fp8_backward_rows_kernel(  # type: ignore[no-untyped-def]
    da_ptr, h_data_ptr, h_scales_ptr, probs_ptr, dh_data_ptr, dh_scales_ptr, partial_ptr, T, F,
    HAS_PROBS: tl.constexpr, DH_ROWS: tl.constexpr, BLOCK_T: tl.constexpr, SLICE: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(1).to(tl.int64)
    channels = j * 128 + tl.arange(0, 128).to(tl.int64)
    for s in range(0, BLOCK_T, SLICE):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + s + tl.arange(0, SLICE)
        ok = rows < T
        dg, du, _act, part = _swiglu_grads(
            da_ptr, h_data_ptr, h_scales_ptr, probs_ptr, rows, ok, j, channels, T, F, HAS_PROBS
        )
        if DH_ROWS:
            offsets = rows[:, None] * (2 * F) + channels[None, :]
            _quantize_rows(dg, dh_data_ptr, dh_scales_ptr, offsets, j * T + rows, ok)
            u_scales = (F // 128 + j) * T + rows
            _quantize_rows(du, dh_data_ptr, dh_scales_ptr, offsets + F, u_scales, ok)
        if HAS_PROBS:
            tl.store(partial_ptr + j * T + rows, part, mask=ok)


@triton.jit
def _swiglu_fp8_backward_tokens_kernel(  # type: ignore[no-untyped-def]
    da_ptr, h_data_ptr, h_scales_ptr, probs_ptr, row_offsets_ptr, seg_offsets_ptr,
    block_offsets_ptr, dht_data_ptr, dht_scales_ptr, at_data_ptr, at_scales_ptr,
    T, F, E, padded_tokens, num_blocks,
    HAS_PROBS: tl.constexpr, DH_TOKENS: tl.constexpr, A_TOKENS: tl.constexpr,
    BLOCK_E: tl.constexpr, CH: tl.constexpr,
):  # fmt: skip
    q = tl.program_id(0).to(tl.int64)
    chunk = q % (F // CH)  # the block row's channel chunks are neighbours in launch order
    b = q // (F // CH)
    j = chunk // (128 // CH)
    channels = chunk * CH + tl.arange(0, CH).to(tl.int64)  # of a, and of g
    active, malformed, row_start, rows_e, column_start, local = _segment(
        b, row_offsets_ptr, seg_offsets_ptr, block_offsets_ptr, T, E, num_blocks, BLOCK_E
    )
    if active:
        ok = local < rows_e
        columns = column_start + local
        # zeros up to the expert's 16-token padding; the bound holds for malformed splits
        keep = (local < (rows_e + 15) // 16 * 16) & (columns < padded_tokens)
        dg, du, act, _part = _swiglu_grads(
            da_ptr, h_data_ptr, h_scales_ptr, probs_ptr, row_start + local, ok, j, channels,
            T, F, HAS_PROBS,
        )  # fmt: skip
        if DH_TOKENS:
            g_scales = b * (2 * F) + channels
            _token_form(dg, dht_scales_ptr, g_scales, dht_data_ptr, channels, columns, keep,
                        padded_tokens, malformed)  # fmt: skip
            _token_form(du, dht_scales_ptr, g_scales + F, dht_data_ptr, channels + F, columns,
                        keep, padded_tokens, malformed)  # fmt: skip
        if A_TOKENS:
            _token_form(act, at_scales_ptr, b * F + channels, at_data_ptr, channels, columns,
                        keep, padded_tokens, malformed)  # fmt: skip
    else:
        zeros = tl.zeros([CH], tl.float32)
        used_blocks = tl.load(block_offsets_ptr + E)
        tail_start = tl.load(seg_offsets_ptr + E)
        # the unused programs (at least one: NB >= used blocks + 1) share the tail columns
        start = tail_start + (b - used_blocks) * 128
        step = (num_blocks - used_blocks) * 128
        if DH_TOKENS:
            tl.store(dht_scales_ptr + b * (2 * F) + channels, zeros)
            tl.store(dht_scales_ptr + b * (2 * F) + F + channels, zeros)
            _zero_tail(dht_data_ptr, channels, start, padded_tokens, step, CH)
            _zero_tail(dht_data_ptr, channels + F, start, padded_tokens, step, CH)
        if A_TOKENS:
            tl.store(at_scales_ptr + b * F + channels, zeros)
            _zero_tail(at_data_ptr, channels, start, padded_tokens, step, CH)


def forward_triton(h: Tensor, probs: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton twin of ``_swiglu_fp8.forward_ref`` on a contiguous ``(T, 2F)`` ``h``."""
    T, C = h.shape
    F = C // 2
    new = h.new_empty
    h_data, h_scales = new(T, C, dtype=E4M3), new(C // 128, T, dtype=torch.float32)
    a_data, a_scales = new(T, F, dtype=E4M3), new(F // 128, T, dtype=torch.float32)
    if T and F:
        with on_device(h):
            _swiglu_fp8_forward_kernel[(triton.cdiv(T, FORWARD_ROWS), F // 128)](
                h, h if probs is None else probs, h_data, h_scales, a_data, a_scales, T, F,
                HAS_PROBS=probs is not None, BLOCK_T=FORWARD_ROWS, num_warps=FORWARD_WARPS,
            )  # fmt: skip
    return h_data, h_scales, a_data, a_scales


def backward_triton(
    da: Tensor, h_data: Tensor, h_scales: Tensor, probs: Tensor | None,
    row_offsets: Tensor, seg_offsets: Tensor, block_offsets: Tensor,
    num_blocks: int, padded_tokens: int, dh_rows: bool, dh_tokens: bool, a_tokens: bool,
) -> list[Tensor]:  # fmt: skip
    """Triton twin of ``_swiglu_fp8.backward_ref``: two kernels, then ``dprobs``' fixed-order sum."""
    T, F = da.shape
    E = row_offsets.shape[0] - 1
    new, F32 = da.new_empty, torch.float32

    def nothing() -> list[Tensor]:  # a form not asked for (an op's outputs never alias)
        return [new(0, dtype=E4M3), new(0, dtype=F32)]

    dh = [new(T, 2 * F, dtype=E4M3), new(2 * F // 128, T, dtype=F32)] if dh_rows else nothing()
    dht = (
        [new(2 * F, padded_tokens, dtype=E4M3), new(num_blocks, 2 * F, dtype=F32)]
        if dh_tokens
        else nothing()
    )
    at = (
        [new(F, padded_tokens, dtype=E4M3), new(num_blocks, F, dtype=F32)]
        if a_tokens
        else nothing()
    )
    partial = new(F // 128, T, dtype=F32) if probs is not None else new(0, dtype=F32)
    has_probs, p = probs is not None, da if probs is None else probs
    with on_device(da):
        if T and F and (dh_rows or has_probs):
            _swiglu_fp8_backward_rows_kernel[(triton.cdiv(T, ROW_BLOCK), F // 128)](
                da, h_data, h_scales, p, *dh, partial, T, F,
                HAS_PROBS=has_probs, DH_ROWS=dh_rows, BLOCK_T=ROW_BLOCK, SLICE=ROW_SLICE,
                num_warps=ROW_WARPS,
            )  # fmt: skip
        if num_blocks and F and (dh_tokens or a_tokens):
            _swiglu_fp8_backward_tokens_kernel[(num_blocks * (F // TOKEN_CHANNELS),)](
                da, h_data, h_scales, p, row_offsets, seg_offsets, block_offsets, *dht, *at,
                T, F, E, padded_tokens, num_blocks,
                HAS_PROBS=has_probs, DH_TOKENS=dh_tokens, A_TOKENS=a_tokens,
                BLOCK_E=triton.next_power_of_2(max(E, 1)), CH=TOKEN_CHANNELS,
                num_warps=TOKEN_WARPS,
            )  # fmt: skip
    if probs is None:
        dprobs = new(0, dtype=F32)
    elif T and F:
        dprobs = partial.sum(dim=0).to(probs.dtype)
    else:
        dprobs = torch.zeros_like(probs)
    return [*dh, *dht, *at, dprobs]
