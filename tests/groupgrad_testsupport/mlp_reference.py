"""An fp64 reference of the fused grouped MLP, with or without the blockwise FP8 recipe.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.

:func:`mlp_reference` computes ``y = fc2(silu(h[:, :F]) * h[:, F:] * probs)``,
``h = fc1(x)``, and its gradients, per expert in fp64 with PyTorch's SwiGLU.
With ``fp8=True`` every GEMM multiplies the dequantized FP8 form it must read,
each quantized from the unquantized tensor (the fp64 chain rounded to the
module's dtype, as the module rounds its own): ``x``'s and ``a``'s
``(1, 128)`` forms and the forward's weights for the fprops, ``dy``'s and
``dh``'s ``(1, 128)`` forms and the backward's weights for the dgrads, the
``(128, 1)`` forms of ``dy``/``a`` and ``dh``/``x`` for the wgrads; the SwiGLU
reads ``h``'s dequantized ``(1, 128)`` form in forward and backward; bias
gradients sum the unquantized ``dy`` and ``dh``.

:func:`fp8_mlp_wgrads` gives the FP8 wgrads alone for bf16 modules, where an
fp64 chain would round ``h``, ``a`` and ``dh`` differently from the module and
flip the odd e4m3 value: its intermediates come from the kernels' reference
twins in the module's dtype, its wgrad products are fp64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from groupgrad.kernels import (
    grouped_dgrad_ref,
    grouped_fprop_ref,
    quantize_fp8,
    quantize_fp8_ref,
    swiglu_probs_backward_ref,
)

__all__ = ["fp8_mlp_wgrads", "mlp_reference"]

ROWS, WEIGHTS, TOKENS = (1, 128), (128, 128), (128, 1)


def _per_expert(splits: list[int], gemm: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
    """``gemm(e, *rows_of_e)`` for every expert, concatenated in row order."""
    parts = zip(*(t.split(splits) for t in tensors), strict=True)
    return torch.cat([gemm(e, *rows) for e, rows in enumerate(parts)])


def mlp_reference(
    w1_E2FH: Tensor,
    w2_EHF: Tensor,
    biases: tuple[Sequence[Tensor | None], Sequence[Tensor | None]],
    x_TH: Tensor,
    probs_T: Tensor | None,
    dy_TH: Tensor,
    splits: list[int],
    *,
    fp8: bool,
    dtype: torch.dtype = torch.float32,
    scales: tuple[float, float] = (1.0, 1.0),
) -> dict[str, Tensor]:
    """The fused MLP's output and gradients in fp64 (see the module docstring).

    Args:
        w1_E2FH: fc1's weights, ``(E, 2F, H)``.
        w2_EHF: fc2's weights, ``(E, H, F)``.
        biases: fc1's and fc2's per-expert biases (``None`` entries: no bias).
        x_TH: The input; ``probs_T``: the router probabilities or ``None``;
            ``dy_TH``: the output gradient.
        splits: Tokens per expert.
        fp8: Multiply the dequantized FP8 forms (else the tensors themselves).
        dtype: The module's compute dtype: the FP8 forms are quantized from
            the fp64 values rounded to it.
        scales: The factors the forward's and the backward's weights carry
            (a fake distributed group's materializations: 2 and 4).

    Returns:
        ``y``, ``dx``, ``dp`` (``dprobs``, for ones when ``probs_T`` is
        ``None``), ``dw1`` ``(E, 2F, H)``, ``dw2`` ``(E, H, F)``, ``db1``
        ``(E, 2F)``, ``db2`` ``(E, H)``, all fp64.
    """

    def read(t64: Tensor, block: tuple[int, int]) -> Tensor:
        if not fp8:
            return t64
        how = {"splits": splits} if block == TOKENS else {}
        blocks = quantize_fp8(t64.to(dtype), block=block, **how)
        return torch.as_tensor(blocks.dequantize()).double()  # type: ignore[union-attr]

    fwd, bwd = scales
    w1, w2 = w1_E2FH.double(), w2_EHF.double()
    w1f, w1b = read(fwd * w1, WEIGHTS), read(bwd * w1, WEIGHTS)
    w2f, w2b = read(fwd * w2, WEIGHTS), read(bwd * w2, WEIGHTS)
    b1s, b2s = biases
    x64, dy64 = x_TH.double(), dy_TH.double()

    h = _per_expert(splits, lambda e, x_e: F.linear(x_e, w1f[e], b1s[e]), read(x64, ROWS))
    h = read(h, ROWS).requires_grad_()  # the h the SwiGLU reads, forward and backward
    p = torch.ones(x_TH.shape[0], dtype=torch.float64) if probs_T is None else probs_T.double()
    p.requires_grad_()
    gate, up = h.chunk(2, dim=1)
    a = F.silu(gate) * up * p[:, None]
    y = _per_expert(splits, lambda e, a_e: F.linear(a_e, w2f[e], b2s[e]), read(a.detach(), ROWS))
    da = _per_expert(splits, lambda e, d_e: d_e @ w2b[e], read(dy64, ROWS))
    dh, dp = torch.autograd.grad(a, [h, p], da)
    dx = _per_expert(splits, lambda e, d_e: d_e @ w1b[e], read(dh, ROWS))

    def wgrad(d_TN: Tensor, x_TK: Tensor) -> Tensor:
        pairs = zip(read(d_TN, TOKENS).split(splits), read(x_TK, TOKENS).split(splits), strict=True)
        return torch.stack([d_e.T @ x_e for d_e, x_e in pairs])

    return {
        "y": y,
        "dx": dx,
        "dp": dp,
        "dw1": wgrad(dh, x64),
        "dw2": wgrad(dy64, a.detach()),
        "db1": torch.stack([d_e.sum(0) for d_e in dh.split(splits)]),  # the unquantized dh
        "db2": torch.stack([d_e.sum(0) for d_e in dy64.split(splits)]),
    }


def fp8_mlp_wgrads(
    w1_E2FH: Tensor,
    w2_EHF: Tensor,
    x_TH: Tensor,
    probs_T: Tensor | None,
    dy_TH: Tensor,
    splits: list[int],
) -> tuple[Tensor, Tensor]:
    """fc1's and fc2's FP8 wgrads (no biases), fp64 products of the dequantized ``(128, 1)`` forms.

    ``h``, ``a``, ``da`` and ``dh`` are what the kernels' reference twins
    compute in ``x``'s dtype from the FP8 operands (the SwiGLU reading ``h``'s
    dequantized ``(1, 128)`` form); each wgrad operand is quantized from them.

    Returns:
        ``dw1`` ``(E, 2F, H)`` and ``dw2`` ``(E, H, F)`` in fp64.
    """

    def quantize(t: Tensor, block: object) -> Any:
        return quantize_fp8_ref(t, block=block, splits=splits if block != WEIGHTS else None)

    x_rows, x_tokens = quantize(x_TH, (ROWS, TOKENS))
    h = grouped_fprop_ref(x_rows, quantize(w1_E2FH, WEIGHTS), splits)
    h_kept = quantize_fp8_ref(h, block=ROWS)
    h = torch.as_tensor(h_kept.dequantize()).to(h.dtype)  # type: ignore[union-attr]
    dy_rows, dy_tokens = quantize(dy_TH, (ROWS, TOKENS))
    da = grouped_dgrad_ref(dy_rows, quantize(w2_EHF, WEIGHTS), splits)
    dh, _, a = swiglu_probs_backward_ref(da, h, probs_T)

    def wgrad(d_tokens: Any, x_tokens: Any) -> Tensor:
        d64, x64 = (torch.as_tensor(f.dequantize()).double() for f in (d_tokens, x_tokens))
        pairs = zip(d64.split(splits), x64.split(splits), strict=True)
        return torch.stack([d_e.T @ x_e for d_e, x_e in pairs])

    return wgrad(quantize(dh, TOKENS), x_tokens), wgrad(dy_tokens, quantize(a, TOKENS))
