"""The fused MLP's operands in the form each step reads them: as they are (bf16), or FP8.

Legend: ``T`` tokens, ``H`` hidden_size, ``F`` ffn_hidden_size; ``x_TH`` the
input, ``h_T2F`` fc1's output, ``a_TF`` the SwiGLU output (fc2's input),
``dy_TH`` fc2's output gradient, ``dh_T2F`` fc1's output gradient.

:class:`MLPForms` resolves ``fp8_recipe`` once, before the autograd Function
runs: ``MLPForms()`` hands every tensor through unchanged (the bf16 path);
with each layer's :class:`~groupgrad.modules._fp8_recipe.Fp8Blockwise` it runs
the blockwise recipe, each FP8 form quantized from the unquantized tensor,
never from another FP8 form:

=====================  ======================================  ===========================
tensor                 forms (where)                           kept for backward
=====================  ======================================  ===========================
``x``                  ``(1, 128)`` fc1 fprop, ``(128, 1)``    the ``(128, 1)`` form
                       fc1 wgrad — one call (forward)
``h`` (after bias)     ``(1, 128)`` (forward): the SwiGLU      the ``(1, 128)`` form
                       reads it dequantized, in forward and
                       again in backward
``a``                  ``(1, 128)`` fc2 fprop (forward);       nothing (recomputed)
                       ``(128, 1)`` fc2 wgrad, from the
                       recomputed ``a`` (backward)
``dy``                 ``(1, 128)`` fc2 dgrad, ``(128, 1)``    —
                       fc2 wgrad — one call
``dh``                 ``(1, 128)`` fc1 dgrad, ``(128, 1)``    —
                       fc1 wgrad — one read
=====================  ======================================  ===========================

``h`` is kept in FP8, not bf16: with a bf16 ``h`` (``4F`` bytes per token)
the backward's saved bytes could not drop below about 0.7x the bf16 MLP's at
MoE shapes. The forward's SwiGLU reads the same dequantized ``h`` that the
backward's reads, so the backward recomputes the forward's ``a`` bit for bit
and the gradients are those of the values the forward computed (``h``'s
quantization counted as part of the forward, like the GEMM operands'). The
weights are quantized per GEMM, or served by each layer's cache.

The SwiGLU and the quantizations around it run fused, one kernel each way
(:func:`~groupgrad.kernels.swiglu_probs_fp8`: ``h``'s and ``a``'s ``(1, 128)``
forms from one read of ``h``; :func:`~groupgrad.kernels.swiglu_probs_backward_fp8`:
``dh``'s two forms and ``a``'s ``(128, 1)`` form from one read of ``da`` and
the kept ``h``). Layers with biases run the backward unfused (dequantize,
SwiGLU, quantize), because their bias gradients sum the unquantized ``dh``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, cast

from torch import Tensor

from groupgrad.kernels import (
    Fp8Blocks,
    swiglu_probs,
    swiglu_probs_backward,
    swiglu_probs_backward_fp8,
    swiglu_probs_fp8,
)
from groupgrad.modules._fp8_recipe import Fp8Blockwise
from groupgrad.modules._group import Splits
from groupgrad.modules._operands import Operand

__all__ = ["MLPForms", "SwigluGrads"]


class SwigluGrads(NamedTuple):
    """What the SwiGLU's backward hands on (each ``Operand`` a tensor in bf16, else an FP8 form).

    Attributes:
        dh_dgrad: ``dh`` for fc1's dgrad (``None``: not asked).
        dh_wgrad: ``dh`` for fc1's wgrad.
        dprobs: ``probs``' gradient (``None`` without ``probs``).
        a_wgrad: ``a`` (recomputed) for fc2's wgrad.
        dh_unquantized: the FP8 path's unquantized ``dh`` where biases need it, else ``None``.
    """

    dh_dgrad: Tensor | Fp8Blocks | None
    dh_wgrad: Operand
    dprobs: Tensor | None
    a_wgrad: Operand
    dh_unquantized: Tensor | None


@dataclass(frozen=True)
class MLPForms:
    """How one forward of the fused MLP (and its backward) feeds its GEMMs and its SwiGLU.

    Attributes:
        fc1: fc1's blockwise recipe (its weight cache), or ``None``: bf16.
        fc2: fc2's, ``None`` exactly when ``fc1`` is.
    """

    fc1: Fp8Blockwise | None = None
    fc2: Fp8Blockwise | None = None

    def input(
        self, x_TH: Tensor, splits: Splits, *, wgrad: bool
    ) -> tuple[Tensor | Fp8Blocks, Operand]:
        """``x`` for fc1's fprop and ``x`` as backward keeps it (fc1's wgrad operand, FP8's
        ``(128, 1)`` form where fc1's ``wgrad`` will run)."""
        if self.fc1 is None:
            return x_TH, x_TH
        return self.fc1.quantize_input(x_TH, splits, tokens=wgrad)

    def swiglu(self, h_T2F: Tensor, probs_T: Tensor | None) -> tuple[Tensor | Fp8Blocks, Operand]:
        """``a`` for fc2's fprop and ``h`` as backward keeps it (FP8: one fused pass)."""
        if self.fc1 is None:
            return swiglu_probs(h_T2F, probs_T), h_T2F
        h_kept, a_rows = swiglu_probs_fp8(h_T2F, probs_T)
        return a_rows, h_kept

    def swiglu_backward(
        self, da_TF: Tensor, h_kept: Operand, probs_T: Tensor | None, splits: Splits, *,
        dx: bool, fc1_trains: bool, fc2_trains: bool, biases: bool,
    ) -> SwigluGrads:  # fmt: skip
        """The SwiGLU's backward and the operands it feeds: fc1's dgrad and wgrad, fc2's wgrad.

        Args:
            da_TF: fc2's dgrad.
            h_kept: ``h`` as forward kept it.
            probs_T: The forward's ``probs``.
            splits: The forward's ``splits``.
            dx: Whether fc1's dgrad runs.
            fc1_trains: Whether fc1's wgrad runs (else its slot gets ``dh``, unread).
            fc2_trains: Whether fc2's wgrad runs (else its slot gets ``a``, unread).
            biases: Whether the layers have biases, whose gradients sum the
                unquantized ``dh`` (FP8 then runs the unfused chain, which keeps it).
        """
        if self.fc1 is None or self.fc2 is None:
            dh_T2F, dprobs_T, a_TF = swiglu_probs_backward(da_TF, cast(Tensor, h_kept), probs_T)
            return SwigluGrads(dh_T2F, dh_T2F, dprobs_T, a_TF, None)
        if not biases:
            dh_rows, dh_tokens, dprobs_T, a_tokens = swiglu_probs_backward_fp8(
                da_TF, cast(Fp8Blocks, h_kept), probs_T, splits=splits,
                dh_rows=dx, dh_tokens=fc1_trains, a_tokens=fc2_trains,
            )  # fmt: skip
            return SwigluGrads(dh_rows, dh_tokens or da_TF, dprobs_T, a_tokens or da_TF, None)
        h_T2F = cast(Fp8Blocks, h_kept).dequantize().to(h_kept.dtype)  # type: ignore[union-attr]
        dh_T2F, dprobs_T, a_TF = swiglu_probs_backward(da_TF, h_T2F, probs_T)
        dh_dgrad, dh_wgrad = self.grad(dh_T2F, splits, "fc1", rows=dx, tokens=fc1_trains)
        a_wgrad: Operand = a_TF
        if fc2_trains:
            a_wgrad = self.fc2.quantize_tokens(a_TF, splits, "the SwiGLU output")
        return SwigluGrads(dh_dgrad, dh_wgrad, dprobs_T, a_wgrad, dh_T2F)

    def grad(
        self, dy_TN: Tensor, splits: Splits, layer: str, *, rows: bool, tokens: bool
    ) -> tuple[Tensor | Fp8Blocks | None, Operand]:
        """A layer's output gradient for its dgrad (``None``: not asked) and for its wgrad.

        Args:
            dy_TN: fc2's ``dy`` or fc1's ``dh``, unquantized.
            splits: The forward's ``splits``.
            layer: ``"fc1"`` or ``"fc2"`` (whose recipe; named in errors).
            rows: Whether the dgrad runs.
            tokens: Whether the wgrad runs (else the wgrad slot gets ``dy_TN``,
                which no GEMM reads).
        """
        fp8 = self.fc1 if layer == "fc1" else self.fc2
        if fp8 is None:
            return dy_TN, dy_TN
        what = "fc1's output grad" if layer == "fc1" else "dy"
        dgrad, wgrad = fp8.quantize_grad(dy_TN, splits, rows=rows, tokens=tokens, what=what)
        return dgrad, dy_TN if wgrad is None else wgrad

    def bias_dys(self, dy_TH: Tensor, dh_T2F: Tensor | None) -> list[Tensor] | None:
        """The unquantized output gradients the bias gradients sum (``None``: the wgrad operands)."""
        if self.fc1 is None or dh_T2F is None:
            return None
        return [dy_TH, dh_T2F]
