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
                       fc1 wgrad — one read (forward)
``h`` (after bias)     ``(1, 128)`` (forward): the SwiGLU      the ``(1, 128)`` form
                       reads it dequantized, in forward and
                       again in backward
``a``                  ``(1, 128)`` fc2 fprop (forward);       nothing (recomputed)
                       ``(128, 1)`` fc2 wgrad, from the
                       recomputed ``a`` (backward)
``dy``                 ``(1, 128)`` fc2 dgrad, ``(128, 1)``    —
                       fc2 wgrad — one read
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
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from groupgrad.kernels import Fp8Blocks
from groupgrad.modules._fp8_recipe import Fp8Blockwise
from groupgrad.modules._group import Splits
from groupgrad.modules._operands import Operand

__all__ = ["MLPForms"]


@dataclass(frozen=True)
class MLPForms:
    """How one forward of the fused MLP (and its backward) feeds its GEMMs and its SwiGLU.

    Attributes:
        fc1: fc1's blockwise recipe (its weight cache), or ``None``: bf16.
        fc2: fc2's, ``None`` exactly when ``fc1`` is.
    """

    fc1: Fp8Blockwise | None = None
    fc2: Fp8Blockwise | None = None

    def input(self, x_TH: Tensor, splits: Splits) -> tuple[Tensor | Fp8Blocks, Operand]:
        """``x`` for fc1's fprop and ``x`` as backward keeps it (fc1's wgrad operand)."""
        if self.fc1 is None:
            return x_TH, x_TH
        return self.fc1.quantize_input(x_TH, splits)

    def fc1_output(self, h_T2F: Tensor) -> tuple[Tensor, Operand]:
        """``h`` as the SwiGLU reads it, and ``h`` as backward keeps it."""
        if self.fc1 is None:
            return h_T2F, h_T2F
        kept = self.fc1.quantize_rows(h_T2F, "fc1's output")
        return self.swiglu_input(kept), kept

    def swiglu_input(self, h_kept: Operand) -> Tensor:
        """The ``h`` the SwiGLU reads, from the ``h`` kept: the same tensor in forward and backward."""
        if isinstance(h_kept, Tensor):
            return h_kept
        return h_kept.dequantize().to(h_kept.dtype)  # type: ignore[union-attr]

    def fc2_input(self, a_TF: Tensor) -> Tensor | Fp8Blocks:
        """``a`` for fc2's fprop."""
        if self.fc2 is None:
            return a_TF
        return self.fc2.quantize_rows(a_TF, "the SwiGLU output")

    def fc2_wgrad_input(self, a_TF: Tensor, splits: Splits, *, needed: bool) -> Operand:
        """``a`` for fc2's wgrad, from the ``a`` backward's SwiGLU recomputed (not needed: ``a``)."""
        if self.fc2 is None or not needed:
            return a_TF
        return self.fc2.quantize_tokens(a_TF, splits, "the SwiGLU output")

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

    def bias_dys(self, dy_TH: Tensor, dh_T2F: Tensor) -> list[Tensor] | None:
        """The unquantized output gradients the bias gradients sum (``None``: the wgrad operands)."""
        return None if self.fc1 is None else [dy_TH, dh_T2F]
