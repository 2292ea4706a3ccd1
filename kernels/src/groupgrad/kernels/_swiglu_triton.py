"""Fused Triton kernels for SwiGLU × router probabilities (see ``_swiglu`` for the math).

Imported only by the CUDA kernels of the ``groupgrad::swiglu_probs*`` custom
ops (and by GPU tests): importing ``groupgrad.kernels`` never imports Triton.
The tile shape comes from ``_swiglu_tiles``, which needs no triton.

Legend: ``T`` tokens, ``F`` ffn_hidden_size; ``h_T2F`` (gate then up),
``probs_T``, ``a_TF``, ``da_TF``, ``dh_T2F``, ``dprobs_T``.

* Forward: one pass over a 2-D grid of ``(BLOCK_T, BLOCK_F)`` tiles: reads
  ``g``, ``u`` (and ``probs``), writes ``a``. Bytes per token: ``3F`` elements.
* Backward: one pass; each program owns ``BLOCK_T`` rows and walks ``F`` in
  ``BLOCK_F`` chunks, reading ``g``, ``u``, ``da`` and writing ``dg``, ``du``
  and the recomputed ``a``, while summing ``dprobs`` in fp32 registers (no
  atomics, so ``dprobs`` is deterministic). Bytes per token: ``6F`` elements.

All arithmetic is fp32; results are rounded once. Both kernels compute ``a``
with the same expression.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from groupgrad.kernels._fp8_triton import on_device
from groupgrad.kernels._swiglu_tiles import tile

__all__ = ["swiglu_probs_backward_triton", "swiglu_probs_triton"]


@triton.jit
def _swiglu_probs_fwd_kernel(  # type: ignore[no-untyped-def]
    h_ptr,
    probs_ptr,
    a_ptr,
    T,
    F,
    HAS_PROBS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    g_offsets = rows64[:, None] * (2 * F) + cols[None, :]
    g = tl.load(h_ptr + g_offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + g_offsets + F, mask=mask, other=0.0).to(tl.float32)
    act = g * tl.sigmoid(g) * u
    if HAS_PROBS:
        p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        act = act * p[:, None]
    a_offsets = rows64[:, None] * F + cols[None, :]
    tl.store(a_ptr + a_offsets, act.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_probs_bwd_kernel(  # type: ignore[no-untyped-def]
    da_ptr,
    h_ptr,
    probs_ptr,
    dh_ptr,
    dprobs_ptr,
    a_ptr,
    T,
    F,
    HAS_PROBS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    p = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_PROBS:
        p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dprobs = tl.zeros([BLOCK_T], dtype=tl.float32)
    for start in range(0, F, BLOCK_F):
        cols = start + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < F)[None, :]
        g_offsets = rows64[:, None] * (2 * F) + cols[None, :]
        a_offsets = rows64[:, None] * F + cols[None, :]
        g = tl.load(h_ptr + g_offsets, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + g_offsets + F, mask=mask, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + a_offsets, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        act = silu * u
        if HAS_PROBS:
            dprobs += tl.sum(da * act, axis=1)
            act = act * p[:, None]
            da = da * p[:, None]
        dg = da * u * sig * (1.0 + g * (1.0 - sig))
        du = da * silu
        tl.store(dh_ptr + g_offsets, dg.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + g_offsets + F, du.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(a_ptr + a_offsets, act.to(a_ptr.dtype.element_ty), mask=mask)
    if HAS_PROBS:
        tl.store(dprobs_ptr + rows, dprobs.to(dprobs_ptr.dtype.element_ty), mask=row_ok)


def swiglu_probs_triton(h_T2F: Tensor, probs_T: Tensor | None = None) -> Tensor:
    """Fused Triton twin of ``swiglu_probs_ref``: same arguments and result.

    Args:
        h_T2F: ``(T, 2F)`` contiguous fc1 output.
        probs_T: ``(T,)`` contiguous per-token scale, or ``None``.

    Returns:
        ``a_TF``: a new ``(T, F)`` tensor in ``h``'s dtype.
    """
    T, F = h_T2F.shape[0], h_T2F.shape[1] // 2
    a_TF = h_T2F.new_empty(T, F)
    if T == 0 or F == 0:
        return a_TF
    block_t, block_f = tile(F)
    grid = (triton.cdiv(T, block_t), triton.cdiv(F, block_f))
    with on_device(h_T2F):
        _swiglu_probs_fwd_kernel[grid](
            h_T2F,
            h_T2F if probs_T is None else probs_T,
            a_TF,
            T,
            F,
            HAS_PROBS=probs_T is not None,
            BLOCK_T=block_t,
            BLOCK_F=block_f,
            num_warps=4,
        )
    return a_TF


def swiglu_probs_backward_triton(
    da_TF: Tensor, h_T2F: Tensor, probs_T: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Fused Triton twin of ``swiglu_probs_backward_ref``: same arguments and result.

    Args:
        da_TF: ``(T, F)`` contiguous activation gradient in ``h``'s dtype.
        h_T2F: ``(T, 2F)`` contiguous fc1 output.
        probs_T: ``(T,)`` contiguous per-token scale, or ``None``.

    Returns:
        ``(dh_T2F, dprobs_T, a_TF)`` as the reference returns them.
    """
    T, F = h_T2F.shape[0], h_T2F.shape[1] // 2
    dh_T2F = torch.empty_like(h_T2F)
    a_TF = h_T2F.new_empty(T, F)
    dprobs_T = None if probs_T is None else torch.empty_like(probs_T)
    if T == 0:
        return dh_T2F, dprobs_T, a_TF
    if F == 0:
        if dprobs_T is not None:
            dprobs_T.zero_()
        return dh_T2F, dprobs_T, a_TF
    block_t, block_f = tile(F)
    with on_device(h_T2F):
        _swiglu_probs_bwd_kernel[(triton.cdiv(T, block_t),)](
            da_TF,
            h_T2F,
            h_T2F if probs_T is None else probs_T,
            dh_T2F,
            h_T2F if dprobs_T is None else dprobs_T,
            a_TF,
            T,
            F,
            HAS_PROBS=probs_T is not None,
            BLOCK_T=block_t,
            BLOCK_F=block_f,
            num_warps=4,
        )
    return dh_T2F, dprobs_T, a_TF
