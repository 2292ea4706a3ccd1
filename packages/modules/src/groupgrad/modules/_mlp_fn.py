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
    fc2 wgrad   dy.T @ a  ┐ one hand_over: both main_grad groups checked first, then
    fc1 wgrad   dh.T @ x  ┘ main_grad / distributed / autograd / deferred, bias grads
    dx          = fc1 dgrad(dh)                 re-materialized fc1 weights

With ``delay_wgrad_compute`` both wgrads go into one job of the module's
:class:`~groupgrad.modules._wgrad_queue.WgradQueue`; ``backward_dw()`` runs them
(fc2, then fc1).

With ``fp8_recipe="blockwise"`` the same Function and backward run the FP8
GEMMs; :class:`~groupgrad.modules._mlp_forms.MLPForms` says which form of
each tensor a step reads and what is kept: ``x``'s ``(128, 1)`` form and
``h``'s ``(1, 128)`` form instead of the bf16 ``x`` and ``h`` (about
``1.03·(H + 2F)`` bytes per token, roughly half), the SwiGLU reading ``h``
dequantized in both directions. Bias gradients sum the unquantized ``dy`` and
``dh``; ``dprobs`` comes from the bf16 SwiGLU backward as without FP8.

``splits`` is copied at forward; under ``torch.autocast`` the GEMMs run in
the autocast dtype (``x`` cast before the op, the materialized weights inside
it) and the wgrads still reach each parameter in its ``grad_dtype``.
:func:`grouped_mlp` is the functional form, for frameworks that own their
parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from groupgrad.kernels import Fp8Blocks
from groupgrad.modules._compiled import hand_over, refuse_derived_parameters
from groupgrad.modules._fp8_cache import Fp8WeightCache
from groupgrad.modules._fp8_recipe import check_fp8_recipe, check_fp8_sizes, fp8_for_forward
from groupgrad.modules._grads import LayerGrads, gradient_nodes
from groupgrad.modules._group import (
    Splits,
    autocast_input,
    device_splits,
    expert_index,
    no_autocast,
    snapshot_splits,
)
from groupgrad.modules._linear_fn import (
    add_bias,
    check_forward_versions,
    forward_versions,
    layer_dgrad,
    layer_fprop,
    stack_bias,
)
from groupgrad.modules._mlp_args import (  # the argument helpers, re-exported for _routed
    MLPLayout,
    check_activation,
    check_mlp_inputs,
    mlp_arguments,
)
from groupgrad.modules._mlp_forms import MLPForms
from groupgrad.modules._no_grad import forward_without_backward, wgrad_follows
from groupgrad.modules._once import differentiable_once
from groupgrad.modules._operands import Operand, put_together, take_apart
from groupgrad.modules._tasks import enter_backward, forward_task
from groupgrad.modules._wgrad_queue import WgradQueue
from groupgrad.protocol import is_distributed_weight

__all__ = [
    "GroupedMLPFunction",
    "MLPLayout",
    "apply_grouped_mlp",
    "check_activation",
    "check_mlp_inputs",
    "grouped_mlp",
    "mlp_arguments",
    "mlp_forms",
]


class GroupedMLPFunction(torch.autograd.Function):
    """``y = fc2(silu(h[:, :F]) * h[:, F:] * probs[:, None])``, ``h = fc1(x)``: one backward.

    ``apply(x_TH, splits, probs_T, layout, queue, cast_dtype, forms, *params)`` with
    ``params`` ordered as :class:`MLPLayout` says; ``probs_T`` may be ``None``;
    ``queue`` is the module's wgrad queue with ``delay_wgrad_compute``, else
    ``None``; ``forms`` the bf16 or FP8 operand forms (:class:`MLPForms`).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x_TH: Tensor,
        splits: Splits,
        probs_T: Tensor | None,
        layout: MLPLayout,
        queue: WgradQueue | None,
        cast_dtype: torch.dtype | None,
        forms: MLPForms,
        *params: Tensor,
    ) -> Tensor:
        w1, b1, w2, b2 = layout.split(params)
        T = x_TH.shape[0]
        with no_autocast(x_TH.device):
            x_gemm, x_kept = forms.input(x_TH, splits, wgrad=wgrad_follows(ctx, w1))
            h_T2F, ctx.fc1, num_groups = layer_fprop(
                x_gemm, splits, layout.fc1, w1, cast_dtype, fp8=forms.fc1
            )
            splits = device_splits(splits, x_TH.device)  # checked by fc1; for fc2 and backward
            expert_T = None
            if layout.num_biases:
                expert_T = expert_index(splits, num_groups, T, x_TH.device)
                h_T2F = add_bias(h_T2F, stack_bias(b1, layout.fc1.packed), expert_T)
            a_TF, h_kept = forms.swiglu(h_T2F, probs_T)
            del h_T2F

            y_TH, ctx.fc2, _ = layer_fprop(a_TF, splits, layout.fc2, w2, cast_dtype, fp8=forms.fc2)
            del a_TF  # recomputed by backward's SwiGLU pass
            if expert_T is not None:
                y_TH = add_bias(y_TH, stack_bias(b2, layout.fc2.packed), expert_T)

        (x_form, x_parts), (h_form, h_parts) = take_apart(x_kept), take_apart(h_kept)
        ctx.save_for_backward(*x_parts, *h_parts, probs_T)
        ctx.kept_forms = (x_form, h_form)
        ctx.forward_task = forward_task()
        ctx.tokens = T
        ctx.forms = forms
        ctx.splits = splits
        ctx.layout = layout
        ctx.queue = queue
        ctx.cast_dtype = cast_dtype
        ctx.params = (w1, b1, w2, b2)
        ctx.versions = (forward_versions(layout.fc1, w1), forward_versions(layout.fc2, w2))
        return y_TH

    @staticmethod
    @differentiable_once("grouped_mlp")
    def backward(ctx: Any, dy_TH: Tensor) -> tuple[Tensor | None, ...]:
        enter_backward(ctx.forward_task)
        saved = iter(ctx.saved_tensors)
        x_form, h_form = ctx.kept_forms
        x_kept = put_together(x_form, saved, ctx.tokens, ctx.splits)
        h_kept = put_together(h_form, saved, ctx.tokens, ctx.splits)
        probs_T = next(saved)
        with no_autocast(dy_TH.device):
            return _mlp_backward(ctx, dy_TH.contiguous(), x_kept, h_kept, probs_T)


def _mlp_backward(
    ctx: Any, dy_TH: Tensor, x_kept: Operand, h_kept: Operand, probs_T: Tensor | None
) -> tuple[Tensor | None, ...]:
    layout: MLPLayout = ctx.layout
    forms: MLPForms = ctx.forms
    w1, b1, w2, b2 = ctx.params
    if ctx.needs_input_grad[0]:  # before anything is written: dx reads fc1's weights
        check_forward_versions(layout.fc1, w1, ctx.versions[0])
    check_forward_versions(layout.fc2, w2, ctx.versions[1])  # every gradient reads da
    splits = ctx.splits
    fc1_nodes, _, fc2_nodes, _ = gradient_nodes(ctx, w1, b1, w2, b2)  # MLPLayout.split's order
    fc2 = LayerGrads(ctx.fc2, b2, ("dy", "fc2's input"), fc2_nodes)
    fc1 = LayerGrads(ctx.fc1, b1, ("fc1's output grad", "x"), fc1_nodes)
    fc2_trains = fc2.target.trainable()
    dy_dgrad, dy_wgrad = forms.grad(dy_TH, splits, "fc2", rows=True, tokens=fc2_trains)
    dy_dgrad = cast(Tensor | Fp8Blocks, dy_dgrad)  # rows=True: always there
    da_TF = layer_dgrad(dy_dgrad, splits, layout.fc2, w2, ctx.cast_dtype, fp8=forms.fc2)
    del dy_dgrad
    dh_dgrad, dh_wgrad, dprobs_T, a_wgrad, dh_T2F = forms.swiglu_backward(
        da_TF, h_kept, probs_T, splits, dx=ctx.needs_input_grad[0],
        fc1_trains=fc1.target.trainable(), fc2_trains=fc2_trains, biases=layout.num_biases > 0,
    )  # fmt: skip
    del da_TF, h_kept
    # fc1's wgrad needs only dh and x: both wgrads (and their main_grad checks) run now
    grads = hand_over(
        [fc2, fc1],
        [dy_wgrad, dh_wgrad],
        [a_wgrad, x_kept],
        splits,
        ctx.queue,
        bias_dys=forms.bias_dys(dy_TH, dh_T2F),
    )
    del a_wgrad, dy_wgrad, dh_wgrad
    fc2_grads, fc1_grads = grads[: len(fc2.params)], grads[len(fc2.params) :]

    dx_TH = None
    if ctx.needs_input_grad[0] and dh_dgrad is not None:
        dx_TH = layer_dgrad(dh_dgrad, splits, layout.fc1, w1, ctx.cast_dtype, fp8=forms.fc1)
    dprobs_T = dprobs_T if ctx.needs_input_grad[2] else None
    return (dx_TH, None, dprobs_T, None, None, None, None, *fc1_grads, *fc2_grads)


def apply_grouped_mlp(
    x_TH: Tensor,
    splits: Splits,
    probs_T: Tensor | None,
    layout: MLPLayout,
    queue: WgradQueue | None,
    params: Sequence[Tensor],
    forms: MLPForms | None = None,
) -> Tensor:
    """Run :class:`GroupedMLPFunction`, in autocast's dtype where autocast is on.

    ``forms``: the FP8 operand forms (``None``: bf16, ``MLPForms()``).
    """
    w1, _, w2, _ = layout.split(params)
    delayed = () if queue is None else (*w1, *w2)
    refuse_derived_parameters(params, layout.fc1.names[0], delayed=delayed)
    x_TH, cast_dtype = autocast_input(x_TH)
    splits = snapshot_splits(splits, layout.fc1.num_groups(params[: layout.num_weights]))
    forms = MLPForms() if forms is None else forms
    args = (x_TH, splits, probs_T, layout, queue, cast_dtype, forms, *params)
    if not torch.is_grad_enabled():  # no backward follows: see _no_grad
        return forward_without_backward(GroupedMLPFunction, *args)
    return GroupedMLPFunction.apply(*args)


def mlp_forms(
    fp8_recipe: str | None,
    caches: tuple[Fp8WeightCache | None, Fp8WeightCache | None],
    is_first_microbatch: bool | None,
    *,
    keep_weights: bool = False,
) -> MLPForms:
    """The operand forms of one forward: bf16, or FP8 with fc1's and fc2's cache use resolved.

    ``keep_weights``: as for :func:`~groupgrad.modules._fp8_recipe.fp8_for_forward`.
    """
    fc1 = fp8_for_forward(fp8_recipe, caches[0], is_first_microbatch, keep_weights=keep_weights)
    fc2 = fp8_for_forward(fp8_recipe, caches[1], is_first_microbatch, keep_weights=keep_weights)
    return MLPForms(fc1, fc2)


def grouped_mlp(
    x: Tensor,
    fc1_weights: Tensor | Sequence[Tensor],
    fc2_weights: Tensor | Sequence[Tensor],
    splits: Splits,
    probs: Tensor | None = None,
    *,
    fc1_bias: Tensor | Sequence[Tensor] | None = None,
    fc2_bias: Tensor | Sequence[Tensor] | None = None,
    activation: str = "swiglu",
    accumulate_into_main_grad: bool = False,
    fp8_recipe: str | None = None,
) -> Tensor:
    """Fused grouped SwiGLU MLP: ``fc2(silu(h[:, :F]) * h[:, F:] * probs[:, None])``, ``h = fc1(x)``.

    The functional form of :class:`~groupgrad.modules.GroupedMLP`, for
    frameworks that own their parameters (Hugging Face, Megatron): one
    autograd Function, one backward; weight gradients follow the ``main_grad``
    contract exactly as in the module. Rows of ``x`` are grouped by expert in
    order (``splits[e]`` rows for expert ``e``).

    Args:
        x: ``(T, H)`` input (bf16, fp16 or fp32; under ``torch.autocast`` the
            GEMMs run in the autocast dtype).
        fc1_weights: Packed ``(E, 2F, H)`` tensor or ``E`` ``(2F, H)`` tensors
            (gate rows first, then up), in ``x``'s dtype.
        fc2_weights: Packed ``(E, H, F)`` tensor or ``E`` ``(H, F)`` tensors, the
            same layout as ``fc1_weights``.
        splits: ``E`` token counts summing to ``T`` (sequence, CPU tensor or
            device tensor); copied now, so the caller may refill its buffer.
        probs: ``(T,)`` router probability per row (any floating dtype; it
            receives a gradient), or ``None`` for ones.
        fc1_bias: ``None``, packed ``(E, 2F)`` or ``E`` ``(2F,)`` tensors (same
            layout as the weights); with ``fc2_bias`` both or neither.
        fc2_bias: ``None``, packed ``(E, H)`` or ``E`` ``(H,)`` tensors.
        activation: Only ``"swiglu"``.
        accumulate_into_main_grad: Write each weight's gradient into its
            ``main_grad`` (adding, or overwriting where ``overwrite_main_grad``
            is set when the GEMM runs) instead of returning it to autograd.
        fp8_recipe: ``None`` (GEMMs in ``x``'s dtype) or ``"blockwise"``:
            the four GEMMs in FP8 e4m3 with fp32 block scales, as
            :func:`~groupgrad.modules.grouped_linear` runs them (weights
            quantized at every GEMM, nothing cached). Backward keeps ``x``'s
            ``(128, 1)`` form and ``h``'s ``(1, 128)`` form, which the SwiGLU
            reads dequantized in forward and backward alike. ``H`` and ``F``
            must be multiples of 128. Parameters stay as they are.

    Returns:
        ``(T, H)`` output in ``x``'s dtype (the autocast dtype under autocast).

    Raises:
        ValueError: A shape, layout, device or activation mismatch;
            ``fp8_recipe`` is not ``None`` or ``"blockwise"``, or with
            ``"blockwise"`` ``H`` or ``F`` is not a multiple of 128.
        TypeError: An argument of the wrong type.
        RuntimeError: ``main_grad`` is missing or malformed (at backward).
    """
    check_activation(activation, "grouped_mlp")
    recipe = check_fp8_recipe(fp8_recipe)
    if not isinstance(x, Tensor):
        raise TypeError(f"x is a {type(x).__name__}, expected a Tensor")
    layout, params, hidden = mlp_arguments(
        fc1_weights, fc2_weights, fc1_bias, fc2_bias, accumulate_into_main_grad, "grouped_mlp"
    )
    if hidden is None:  # a DistributedWeight group: its implementer owns the shapes
        hidden = x.shape[-1] if x.dim() == 2 else -1
    check_mlp_inputs(x, probs, hidden)
    if recipe is not None:
        sizes = {"hidden size (x's columns)": hidden}
        fc2_leader = params[layout.num_weights + layout.num_biases]
        if not is_distributed_weight(fc2_leader):  # a distributed group's shapes are its own
            sizes["ffn size (fc2_weights' last dimension)"] = fc2_leader.shape[-1]
        check_fp8_sizes(**sizes)
    forms = mlp_forms(recipe, (None, None), None)
    return apply_grouped_mlp(x, splits, probs, layout, None, params, forms)
