"""The grouped-linear op: one autograd Function, one backward.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features;
``x_TK`` input, ``y_TN`` output, ``splits_E`` tokens per expert, ``b_EN`` bias.

Forward materializes the weights (a ``DistributedWeight`` leader gathers the
group), runs the grouped fprop GEMM and never saves the materialized weights.
Backward re-materializes them for dgrad and hands the parameter gradients
over through :func:`groupgrad.modules._compiled.hand_over` (the wgrad step of
``_grads`` and ``_wgrad``, which resolves every ``main_grad`` / distributed /
deferred variant into a plan before its GEMM).

With ``fp8_recipe="blockwise"`` (``_fp8_recipe``) the same Function runs the
FP8 GEMMs: forward quantizes ``x`` once into its ``(1, 128)`` form (fprop) and
its ``(128, 1)`` form (wgrad), and saves only the latter (about half the bytes
of a bf16 ``x``); backward quantizes ``dy`` once into both of its forms, and
the weights (materialized again, or the layer's cached FP8 weights) for
dgrad. The wgrad takes the same route as bf16, on the FP8 forms; bias
gradients sum the unquantized ``dy``.

Under ``torch.autocast`` the GEMMs run in the autocast dtype, like
``nn.Linear``: ``x`` is cast before the op (autograd casts ``dx`` back) and
the materialized weights inside it; the weight gradient still reaches each
parameter in its ``grad_dtype`` straight from the GEMM's epilogue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from groupgrad.kernels import Fp8Blocks, grouped_dgrad, grouped_fprop
from groupgrad.modules._compiled import hand_over, refuse_derived_parameters
from groupgrad.modules._fp8_recipe import (
    Fp8Blockwise,
    check_fp8_recipe,
    check_fp8_sizes,
    fp8_for_forward,
)
from groupgrad.modules._grads import LayerGrads, gradient_nodes
from groupgrad.modules._group import (
    Splits,
    WeightGroupSpec,
    as_gemm_dtype,
    autocast_input,
    check_biases,
    device_splits,
    expert_index,
    no_autocast,
    snapshot_splits,
)
from groupgrad.modules._no_grad import forward_without_backward, wgrad_follows
from groupgrad.modules._once import differentiable_once
from groupgrad.modules._operands import Operand, put_together, take_apart
from groupgrad.modules._tasks import enter_backward, forward_task
from groupgrad.modules._wgrad import WgradTarget
from groupgrad.modules._wgrad_queue import WgradQueue
from groupgrad.protocol import (
    is_distributed_weight,
    is_fsdp_param,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
)

__all__ = [
    "GroupedLinearFunction",
    "add_bias",
    "apply_grouped_linear",
    "check_forward_versions",
    "forward_versions",
    "grouped_linear",
    "layer_dgrad",
    "layer_fprop",
]


def add_bias(y_TN: Tensor, b_EN: Tensor, expert_T: Tensor) -> Tensor:
    """Return ``y_TN`` plus each row's expert bias.

    Out of place on purpose: an in-place add on a custom op's output inside
    an autograd Function's forward lost every gradient under
    ``torch.compile`` on CUDA (torch 2.11, aot_eager).
    """
    return y_TN + b_EN.index_select(0, expert_T).to(y_TN.dtype)


def stack_bias(biases: Sequence[Tensor], packed: bool) -> Tensor:
    """The ``(E, N)`` bias of a layer: the packed parameter, or the per-expert ones stacked."""
    return biases[0] if packed else torch.stack(list(biases))


def _gemm_weights(
    spec: WeightGroupSpec,
    weights: Sequence[Tensor],
    materialized: Sequence[Tensor],
    cast_dtype: torch.dtype | None,
    fp8: Fp8Blockwise | None,
    forward: bool,
) -> Tensor | list[Tensor] | Fp8Blocks:
    """The weights a GEMM takes: materialized (and cast), or their FP8 form (maybe cached)."""

    def cast_weights() -> Tensor | list[Tensor]:
        return spec.gemm_weights(as_gemm_dtype(materialized, cast_dtype))

    if fp8 is None:
        return cast_weights()
    dtype = cast_dtype or materialized[0].dtype
    return fp8.weights(weights, cast_weights, dtype, forward=forward, names=spec.names)


def forward_versions(spec: WeightGroupSpec, weights: Sequence[Tensor]) -> tuple[int, ...] | None:
    """The weights' version counters as the forward reads them, for backward's dgrad to check
    (:func:`check_forward_versions`), as autograd checks the tensors it saves.

    ``None`` (nothing to check) unless ``spec.checks_versions``, and for
    Megatron-FSDP groups: Megatron-FSDP writes the gathered weights into the
    parameters again between forward and backward, and backward reads what
    it gathers then. A ``DistributedWeight`` group's members are checked: they
    are its shards, which its implementer gathers from (into other memory),
    so only an edit moves them between forward and backward, after which the
    backward's gather would give values the forward never saw.
    """
    if not spec.checks_versions or is_fsdp_param(weights[0]):
        return None
    return tuple(w._version for w in weights)


def check_forward_versions(
    spec: WeightGroupSpec, weights: Sequence[Tensor], versions: tuple[int, ...] | None
) -> None:
    """Raise if a weight was modified in place since the forward that recorded ``versions``.

    Backward's dgrad reads the weights again: after an in-place change it
    would compute the gradient of values the forward never saw.
    """
    if versions is None:
        return
    for name, w, version in zip(spec.names, weights, versions, strict=True):
        if w._version != version:
            raise RuntimeError(
                f"{name} was modified in place after the forward that used it (its version is "
                f"{w._version}, expected {version}); the input gradient would not match the "
                "values the forward saw (autograd raises the same for a tensor it saved). "
                "Modify the weights after backward, or run the forward again"
            )


def layer_fprop(
    x: Tensor | Fp8Blocks,
    splits: Splits,
    spec: WeightGroupSpec,
    weights: Sequence[Tensor],
    cast_dtype: torch.dtype | None,
    *,
    fp8: Fp8Blockwise | None = None,
) -> tuple[Tensor, WgradTarget, int]:
    """One layer's grouped fprop ``x_e @ w_e.T`` on its weights materialized for forward.

    The materialized weights (cast to ``cast_dtype`` where autocast asks) are
    dropped on return, never saved: backward materializes them again. With
    ``fp8``, ``x`` is its ``(1, 128)`` form and the weights are quantized (or
    taken from the layer's cache).

    Returns:
        The output, the layer's :class:`WgradTarget` for backward, and ``E``.
    """
    if torch.compiler.is_compiling() and is_distributed_weight(weights[0]):
        raise RuntimeError(
            f"parameter {spec.names[0]!r} is a DistributedWeight; torch.compile does not trace "
            "groupgrad layers on DistributedWeight groups (their gathers and reductions run "
            "eagerly): compile the rest of the model and leave this layer out "
            "(torch.compiler.disable), or run it without torch.compile"
        )
    materialized = materialize_weight_for_forward(list(weights))
    frozen = tuple(not w.requires_grad for w in weights)
    target = WgradTarget(spec, tuple(materialized[0].shape), tuple(weights), frozen)
    gemm_weights = _gemm_weights(spec, weights, materialized, cast_dtype, fp8, forward=True)
    y = grouped_fprop(x, gemm_weights, splits, names=spec.names)
    return y, target, spec.num_groups(materialized)


def layer_dgrad(
    dy: Tensor | Fp8Blocks,
    splits: Splits,
    spec: WeightGroupSpec,
    weights: Sequence[Tensor],
    cast_dtype: torch.dtype | None,
    *,
    fp8: Fp8Blockwise | None = None,
) -> Tensor:
    """One layer's grouped dgrad ``dy_e @ w_e`` on its weights materialized again for backward.

    With ``fp8``, ``dy`` is its ``(1, 128)`` form and the weights are the
    ones the forward kept, or taken from the layer's cache while it still
    matches, or quantized again.
    """
    materialized = materialize_weight_for_backward(list(weights))
    gemm_weights = _gemm_weights(spec, weights, materialized, cast_dtype, fp8, forward=False)
    return grouped_dgrad(dy, gemm_weights, splits, names=spec.names)


class GroupedLinearFunction(torch.autograd.Function):
    """``y_e = x_e @ w_e.T (+ b_e)`` for every expert, with the ``main_grad`` contract in backward.

    ``apply(x_TK, splits, spec, queue, cast_dtype, fp8, num_biases, *weights, *biases)``
    (``cast_dtype``: autocast's dtype for the materialized weights, or ``None``;
    ``fp8``: the blockwise FP8 recipe of this forward, or ``None``): the
    weights (and biases) are the layer's own parameters, leader first; they
    are kept on the autograd context directly (not through
    ``save_for_backward``), so ``saved_tensors_hooks`` cannot strip a
    ``DistributedWeight`` subclass.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x_TK: Tensor,
        splits: Splits,
        spec: WeightGroupSpec,
        queue: WgradQueue | None,
        cast_dtype: torch.dtype | None,
        fp8: Fp8Blockwise | None,
        num_biases: int,
        *params: Tensor,
    ) -> Tensor:
        weights = params[: len(params) - num_biases]
        biases = params[len(params) - num_biases :]
        with no_autocast(x_TK.device):
            x_gemm: Tensor | Fp8Blocks = x_TK
            x_saved: Operand = x_TK
            if fp8 is not None:  # x's forms from x; the wgrad's is saved, where it runs
                tokens = wgrad_follows(ctx, weights)
                x_gemm, x_saved = fp8.quantize_input(x_TK, splits, tokens=tokens)
            y_TN, ctx.target, num_groups = layer_fprop(
                x_gemm, splits, spec, weights, cast_dtype, fp8=fp8
            )
            splits = device_splits(splits, x_TK.device)  # checked by the fprop; for backward
            if biases:
                expert_T = expert_index(splits, num_groups, x_TK.shape[0], x_TK.device)
                y_TN = add_bias(y_TN, stack_bias(biases, spec.packed), expert_T)

        ctx.x_form, saved = take_apart(x_saved)
        ctx.save_for_backward(*saved)
        ctx.forward_task = forward_task()
        ctx.tokens = x_TK.shape[0]
        ctx.fp8 = fp8
        ctx.splits = splits
        ctx.spec = spec
        ctx.queue = queue
        ctx.cast_dtype = cast_dtype
        ctx.weights = weights
        ctx.versions = forward_versions(spec, weights)
        ctx.biases = biases
        return y_TN

    @staticmethod
    @differentiable_once("grouped_linear")
    def backward(ctx: Any, dy_TN: Tensor) -> tuple[Tensor | None, ...]:
        enter_backward(ctx.forward_task)
        if ctx.needs_input_grad[0]:  # before anything is written
            check_forward_versions(ctx.spec, ctx.weights, ctx.versions)
        x_TK = put_together(ctx.x_form, iter(ctx.saved_tensors), ctx.tokens, ctx.splits)
        dy_TN = dy_TN.contiguous()
        fp8: Fp8Blockwise | None = ctx.fp8
        with no_autocast(dy_TN.device):
            dy_gemm: Tensor | Fp8Blocks | None = dy_TN
            dy_wgrad: Operand | None = dy_TN
            if fp8 is not None:  # from dy: the forms its GEMMs need
                dy_gemm, dy_wgrad = fp8.quantize_grad(
                    dy_TN, ctx.splits, rows=ctx.needs_input_grad[0], tokens=ctx.target.trainable()
                )
            dx_TK = None
            if ctx.needs_input_grad[0] and dy_gemm is not None:
                dx_TK = layer_dgrad(
                    dy_gemm, ctx.splits, ctx.spec, ctx.weights, ctx.cast_dtype, fp8=fp8
                )
            nodes, _ = gradient_nodes(ctx, ctx.weights, ctx.biases)
            layer = LayerGrads(ctx.target, ctx.biases, nodes=nodes)
            grads = hand_over(
                [layer],
                [dy_TN if dy_wgrad is None else dy_wgrad],  # None: no weight takes a gradient
                [x_TK],
                ctx.splits,
                ctx.queue,
                bias_dys=None if fp8 is None else [dy_TN],
            )
        return (dx_TK, None, None, None, None, None, None, *grads)


def apply_grouped_linear(
    x_TK: Tensor,
    splits: Splits,
    spec: WeightGroupSpec,
    queue: WgradQueue | None,
    params: Sequence[Tensor],
    num_biases: int,
    fp8: Fp8Blockwise | None = None,
) -> Tensor:
    """Run :class:`GroupedLinearFunction`, in autocast's dtype where autocast is on."""
    weights = params[: len(params) - num_biases]
    refuse_derived_parameters(params, spec.names[0], delayed=() if queue is None else weights)
    x_TK, cast_dtype = autocast_input(x_TK)
    splits = snapshot_splits(splits, spec.num_groups(weights))
    args = (x_TK, splits, spec, queue, cast_dtype, fp8, num_biases, *params)
    if not torch.is_grad_enabled():  # no backward follows: see _no_grad
        return forward_without_backward(GroupedLinearFunction, *args)
    return GroupedLinearFunction.apply(*args)


def grouped_linear(
    x: Tensor,
    weights: Tensor | Sequence[Tensor],
    splits: Splits,
    bias: Tensor | Sequence[Tensor] | None = None,
    *,
    accumulate_into_main_grad: bool = False,
    fp8_recipe: str | None = None,
) -> Tensor:
    """Grouped linear layer: ``y_e = x_e @ w_e.T + b_e`` for every expert ``e``.

    Rows of ``x`` are grouped by expert in order (``splits[e]`` rows for
    expert ``e``). Differentiable in ``x``, the weights and the bias.

    Args:
        x: ``(T, K)`` input (bf16, fp16 or fp32).
        weights: One packed ``(E, N, K)`` parameter, or a sequence of ``E``
            ``(N, K)`` parameters (the ``nn.Linear`` layout), in ``x``'s dtype.
            The first is the group's leader: a ``DistributedWeight`` leader
            materializes the group for each GEMM and finalizes its gradients.
        splits: ``E`` token counts summing to ``T``: a sequence of ints, a CPU
            tensor, or a device tensor (never read on the host on the GPU path).
        bias: ``None``, a packed ``(E, N)`` tensor (with a packed weight), or
            ``E`` ``(N,)`` tensors.
        accumulate_into_main_grad: Write each weight's gradient into its
            ``main_grad`` (accumulating, or overwriting where
            ``overwrite_main_grad`` is set) instead of returning it to
            autograd. A distributed group ignores it: its implementer owns
            ``main_grad``.
        fp8_recipe: ``None`` (GEMMs in ``x``'s dtype) or ``"blockwise"``:
            FP8 e4m3 GEMMs with fp32 block scales — ``x`` and ``dy`` in
            ``(1, 128)`` blocks for fprop and dgrad and ``(128, 1)`` token
            blocks per expert for the wgrad, weights in ``(128, 128)`` tiles,
            each quantized from the unquantized tensor (the weights at every
            forward and again for dgrad; nothing is cached). ``K`` and ``N``
            must be multiples of 128. Parameters stay as they are; the wgrad
            reaches ``main_grad`` or autograd exactly as without FP8 (fp32
            straight from the GEMM where that is the destination's dtype).
            ``x`` may be bf16, fp16 or fp32 (quantized from its own dtype, or
            from autocast's); ``y`` has that dtype.

    Returns:
        ``(T, N)`` output in ``x``'s dtype; under ``torch.autocast`` in the
        autocast dtype (like ``nn.Linear``), while each weight gradient still
        reaches its parameter in the parameter's ``grad_dtype``.

    ``splits`` is copied at forward; backward uses the copy. Without
    ``main_grad``, weight and bias gradients reach autograd in each
    parameter's ``grad_dtype`` straight from the GEMM (a bf16 weight whose
    ``grad_dtype`` is fp32 gets an fp32 gradient, never rounded to bf16).

    Raises:
        ValueError: ``x`` is not 2-D, or the weights and bias disagree in
            layout or number (the kernels check shapes, dtypes, devices and
            ``splits``); ``fp8_recipe`` is not ``None`` or ``"blockwise"``,
            or with ``"blockwise"`` ``K`` or ``N`` is not a multiple of 128.
        RuntimeError: ``main_grad`` is missing or malformed (at backward).
    """
    recipe = check_fp8_recipe(fp8_recipe)
    spec, params, num_biases = _group_arguments(x, weights, bias, accumulate_into_main_grad)
    if recipe is not None:
        _check_fp8_operands(x, params[0])
    fp8 = fp8_for_forward(recipe, None, None)
    return apply_grouped_linear(x, splits, spec, None, params, num_biases, fp8)


def _check_fp8_operands(x: Tensor, leader: Tensor) -> None:
    """``K`` (``x``'s columns) and ``N`` (a plain weight's rows) are multiples of 128."""
    sizes = {"in_features (x's columns)": x.shape[1]}
    if not is_distributed_weight(leader):  # a distributed group's shapes are its implementer's
        sizes["out_features (the weights' rows)"] = leader.shape[-2]
    check_fp8_sizes(**sizes)


def _group_arguments(
    x: Tensor,
    weights: Tensor | Sequence[Tensor],
    bias: Tensor | Sequence[Tensor] | None,
    wgrad_into_main_grad: bool,
) -> tuple[WeightGroupSpec, list[Tensor], int]:
    if not isinstance(x, Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x has shape {shape}, expected a 2-D (tokens, in_features) tensor")
    if isinstance(weights, Tensor):
        if weights.dim() != 3 and not is_distributed_weight(weights):
            raise ValueError(
                f"weights has shape {tuple(weights.shape)}, expected (E, N, K) or a sequence "
                "of (N, K) tensors"
            )
        params = [weights]
        names: tuple[str, ...] = ("weight",)
    else:
        params = list(weights)
        if not params:
            raise ValueError("weights is empty; expected E >= 1 expert weights")
        for index, w in enumerate(params):
            if not isinstance(w, Tensor):
                raise TypeError(f"weights[{index}] is a {type(w).__name__}, expected a Tensor")
        names = tuple(f"weight{i}" for i in range(len(params)))
    spec = WeightGroupSpec(names, isinstance(weights, Tensor), wgrad_into_main_grad)
    biases: list[Tensor] = []
    if bias is not None:
        if spec.packed != isinstance(bias, Tensor):
            raise ValueError(
                f"bias is a {type(bias).__name__}; expected a packed (E, N) tensor with a packed "
                "(E, N, K) weight, or a sequence of E (N,) tensors with per-expert weights"
            )
        biases = [bias] if isinstance(bias, Tensor) else list(bias)
        if not spec.packed and len(biases) != len(params):
            raise ValueError(
                f"bias has {len(biases)} entries, expected {len(params)} (one per expert weight)"
            )
        if not is_distributed_weight(params[0]):
            check_biases(biases, params, spec.packed, "bias", "weights")
    return spec, params + biases, len(biases)
