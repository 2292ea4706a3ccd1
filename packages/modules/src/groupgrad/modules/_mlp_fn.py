"""The fused grouped MLP: fc1 → SwiGLU × router probs → fc2 as one autograd Function.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size;
``x_TH`` input, ``h_T2F`` fc1 output (gate then up), ``a_TF`` activation,
``y_TH`` output, ``probs_T`` router probabilities, ``splits_E`` tokens per
expert. fc1 weights are ``(2F, H)`` per expert, fc2 weights ``(H, F)``.

Forward::

    h = fc1(x)                     grouped fprop (+ bias)
    a = silu(h[:, :F]) * h[:, F:] * probs[:, None]
    y = fc2(a)                     grouped fprop (+ bias)

What forward saves for backward (and nothing else): ``x_TH``, ``h_T2F`` and
``probs_T`` when given — ``2·(H + 2F)`` bytes per token in bf16, plus
``probs``' element size. The activation ``a_TF`` is **not** saved: backward's
one-pass SwiGLU kernel recomputes it while producing ``dh`` (it reads ``h``
anyway), which saves ``2·F`` bytes per token for one extra ``(T, F)`` write.
Materialized (e.g. gathered distributed) weights are never saved; the
parameters themselves are kept on the context, not through
``save_for_backward``. The expert index of each row, needed for biases, is
rebuilt in backward from ``splits``.

Backward, one pass for every variant::

    da          = fc2 dgrad(dy)                 re-materialized fc2 weights
    dh, dprobs, a = SwiGLU backward(da, h, probs)
    fc2 wgrad   dy.T @ a   → wgrad_step (main_grad / distributed / autograd / deferred)
    dx          = fc1 dgrad(dh)                 re-materialized fc1 weights
    fc1 wgrad   dh.T @ x   → wgrad_step

With ``delay_wgrad_compute`` both wgrads go into one job of the module's
:class:`~groupgrad.modules._group.WgradQueue`; ``backward_dw()`` runs them
(fc2, then fc1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from groupgrad.kernels import grouped_dgrad, grouped_fprop
from groupgrad.modules._group import (
    DeferredWgrad,
    WeightGroupSpec,
    WgradQueue,
    expert_index,
    wgrad_step,
)
from groupgrad.modules._linear_fn import add_bias, bias_grad
from groupgrad.modules._swiglu import swiglu_probs, swiglu_probs_backward
from groupgrad.protocol import materialize_weight_for_backward, materialize_weight_for_forward

__all__ = ["GroupedMLPFunction", "MLPLayout"]

Splits = Sequence[int] | Tensor


@dataclass(frozen=True)
class MLPLayout:
    """How the flat parameter list of :class:`GroupedMLPFunction` splits into fc1 and fc2.

    ``apply`` receives ``*fc1_weights, *fc1_biases, *fc2_weights, *fc2_biases``;
    fc1 and fc2 have the same layout (per-expert or packed, bias or not).

    Attributes:
        fc1: fc1's weight layout.
        fc2: fc2's weight layout.
        num_weights: Weight parameters per layer (``E``, or 1 when packed).
        num_biases: Bias parameters per layer (0 without bias).
    """

    fc1: WeightGroupSpec
    fc2: WeightGroupSpec
    num_weights: int
    num_biases: int

    def split(
        self, params: Sequence[Tensor]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...]]:
        """``(fc1 weights, fc1 biases, fc2 weights, fc2 biases)``."""
        per_layer = self.num_weights + self.num_biases
        if len(params) != 2 * per_layer:
            raise ValueError(f"got {len(params)} parameters, expected {2 * per_layer}")
        fc1, fc2 = tuple(params[:per_layer]), tuple(params[per_layer:])
        w = self.num_weights
        return fc1[:w], fc1[w:], fc2[:w], fc2[w:]


def _bias_EN(biases: Sequence[Tensor], packed: bool) -> Tensor:
    return biases[0] if packed else torch.stack(list(biases))


def _bias_grads(
    dy_TX: Tensor, biases: Sequence[Tensor], expert_T: Tensor | None, packed: bool
) -> list[Tensor | None]:
    if expert_T is None or not any(b.requires_grad for b in biases):
        return [None] * len(biases)  # expert_T exists whenever there are biases
    num_groups = biases[0].shape[0] if packed else len(biases)
    db_EX = bias_grad(dy_TX, expert_T, num_groups, biases[0].dtype)
    return [db_EX] if packed else list(db_EX.unbind(0))


class GroupedMLPFunction(torch.autograd.Function):
    """``y = fc2(silu(h[:, :F]) * h[:, F:] * probs[:, None])``, ``h = fc1(x)``: one backward.

    ``apply(x_TH, splits, probs_T, layout, queue, *params)`` with ``params``
    ordered as :class:`MLPLayout` says; ``probs_T`` may be ``None``; ``queue``
    is the module's wgrad queue with ``delay_wgrad_compute``, else ``None``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x_TH: Tensor,
        splits: Splits,
        probs_T: Tensor | None,
        layout: MLPLayout,
        queue: WgradQueue | None,
        *params: Tensor,
    ) -> Tensor:
        w1, b1, w2, b2 = layout.split(params)
        T = x_TH.shape[0]

        fc1_weights = materialize_weight_for_forward(list(w1))
        h_T2F = grouped_fprop(x_TH, layout.fc1.gemm_weights(fc1_weights), splits)
        num_groups = layout.fc1.num_groups(fc1_weights)
        ctx.fc1_shape = tuple(fc1_weights[0].shape)
        del fc1_weights  # never saved: backward materializes again
        expert_T = expert_index(splits, num_groups, T, x_TH.device) if layout.num_biases else None
        if expert_T is not None:
            h_T2F = add_bias(h_T2F, _bias_EN(b1, layout.fc1.packed), expert_T)

        a_TF = swiglu_probs(h_T2F, probs_T)

        fc2_weights = materialize_weight_for_forward(list(w2))
        y_TH = grouped_fprop(a_TF, layout.fc2.gemm_weights(fc2_weights), splits)
        ctx.fc2_shape = tuple(fc2_weights[0].shape)
        del fc2_weights, a_TF  # a is recomputed by backward's SwiGLU pass
        if expert_T is not None:
            y_TH = add_bias(y_TH, _bias_EN(b2, layout.fc2.packed), expert_T)

        ctx.save_for_backward(x_TH, h_T2F, probs_T)
        ctx.splits = splits
        ctx.num_groups = num_groups
        ctx.layout = layout
        ctx.queue = queue
        ctx.params = (w1, b1, w2, b2)
        return y_TH

    @staticmethod
    def backward(ctx: Any, dy_TH: Tensor) -> tuple[Tensor | None, ...]:
        x_TH, h_T2F, probs_T = ctx.saved_tensors
        layout: MLPLayout = ctx.layout
        w1, b1, w2, b2 = ctx.params
        splits = ctx.splits
        dy_TH = dy_TH.contiguous()
        expert_T = None
        if layout.num_biases:
            expert_T = expert_index(splits, ctx.num_groups, x_TH.shape[0], x_TH.device)
        deferred: list[DeferredWgrad] | None = None if ctx.queue is None else []

        fc2_weights = materialize_weight_for_backward(list(w2))
        da_TF = grouped_dgrad(dy_TH, layout.fc2.gemm_weights(fc2_weights), splits)
        del fc2_weights
        dh_T2F, dprobs_T, a_TF = swiglu_probs_backward(da_TF, h_T2F, probs_T)
        del da_TF
        fc2_wgrads = wgrad_step(layout.fc2, ctx.fc2_shape, w2, dy_TH, a_TF, splits, deferred)
        del a_TF
        fc2_bgrads = _bias_grads(dy_TH, b2, expert_T, layout.fc2.packed)

        dx_TH = None
        if ctx.needs_input_grad[0]:
            fc1_weights = materialize_weight_for_backward(list(w1))
            dx_TH = grouped_dgrad(dh_T2F, layout.fc1.gemm_weights(fc1_weights), splits)
            del fc1_weights
        fc1_wgrads = wgrad_step(layout.fc1, ctx.fc1_shape, w1, dh_T2F, x_TH, splits, deferred)
        fc1_bgrads = _bias_grads(dh_T2F, b1, expert_T, layout.fc1.packed)

        if deferred is not None:
            ctx.queue.push(deferred)
        dprobs_T = dprobs_T if ctx.needs_input_grad[2] else None
        return (
            dx_TH,
            None,
            dprobs_T,
            None,
            None,
            *fc1_wgrads,
            *fc1_bgrads,
            *fc2_wgrads,
            *fc2_bgrads,
        )
