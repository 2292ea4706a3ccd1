"""The routed fused MLP: gather each token's rows, the fused MLP, weighted combine — one Function.

Legend: ``T`` tokens, ``k`` experts per token (top-k), ``S = T·k`` routed
slots, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size; slot
``s = t·k + j`` is token ``t``'s ``j``-th choice.

::

    x_SH   = x_TH[slots // k]                  gathered inside the op, not saved
    h_S2F  = fc1(x_SH)                         saved (freed in backward once used)
    a_SF   = silu(h[:, :F]) * h[:, F:] * w_S   w_S = top_k_weights in slot order
    y_SH   = fc2(a_SF)
    out_TH = Σ_j y[slot t·k + j]               fp32 sum, one rounding

Why a separate op from :func:`~groupgrad.modules.grouped_mlp`: peak memory.
A backward keeps its saved tensors and its incoming gradient until it
returns. With the gather and the combine outside the fused MLP, its backward
holds the gathered ``x_SH``, ``h``, the ``(S, H)`` output gradient, ``dh``,
``dx`` and both weight gradients at once — ``h`` and an ``S × H`` more than
``torch._grouped_mm`` chained through autograd, whose nodes free as they
go. Here the incoming gradient is ``(T, H)``; backward gathers its
``(S, H)`` rows, runs fc2's dgrad and wgrad, frees them and ``h``, gathers
``x_SH`` again for fc1's wgrad, frees it, then runs fc1's dgrad: the
backward's peak is ``dh`` + one ``S × H`` + the weight gradients.

``h`` is our own intermediate (never the caller's), so backward releases its
storage once the SwiGLU backward has read it; a second backward over the same
forward (``retain_graph=True``) is refused by name. Under ``torch.compile``
nothing is released (the compiler plans the memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from groupgrad.kernels import swiglu_probs, swiglu_probs_backward
from groupgrad.modules._compiled import hand_over, refuse_derived_parameters
from groupgrad.modules._grads import LayerGrads, gradient_nodes
from groupgrad.modules._group import (
    Splits,
    autocast_input,
    device_splits,
    no_autocast,
    snapshot_splits,
)
from groupgrad.modules._linear_fn import layer_dgrad, layer_fprop
from groupgrad.modules._mlp_fn import MLPLayout, check_activation, check_mlp_inputs, mlp_arguments
from groupgrad.modules._no_grad import forward_without_backward
from groupgrad.modules._once import differentiable_once

__all__ = ["routed_grouped_mlp"]


def _release(t: Tensor) -> None:
    """Free ``t``'s memory now (the autograd engine would keep it until the backward returns)."""
    if not torch.compiler.is_compiling() and t.device.type != "meta":
        t.untyped_storage().resize_(0)


def _released(t: Tensor) -> bool:
    """Whether :func:`_release` freed ``t`` (never under ``torch.compile``, which frees nothing)."""
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return False
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _combine(y_SH: Tensor, slots_S: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """``out[t] = Σ_j y[slot t·k + j]``: back to slot order, summed in fp32, rounded once."""
    unsorted_SH = torch.empty_like(y_SH).index_copy_(0, slots_S, y_SH)
    rows = unsorted_SH.view(*shape, y_SH.shape[-1])  # (T, k, H)
    # a fresh tensor also where dtype is fp32: torch 2.11's Dynamo handed the backward of a
    # traced Function whose output was the sum itself a zero gradient (wgrads of 0)
    return rows.sum(dim=1, dtype=torch.float32).to(dtype, copy=True)


class RoutedMLPFunction(torch.autograd.Function):
    """``out = combine(fc2(swiglu(fc1(x[slots // k])) · w))``: one forward, one backward.

    ``apply(x_TH, top_k_weights_Tk, slots_S, splits, layout, cast_dtype, *params)``
    with ``params`` = fc1's weights, then fc2's (no biases).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x_TH: Tensor,
        weights_Tk: Tensor,
        slots_S: Tensor,
        splits: Splits,
        layout: MLPLayout,
        cast_dtype: torch.dtype | None,
        *params: Tensor,
    ) -> Tensor:
        w1, _, w2, _ = layout.split(params)
        top_k = weights_Tk.shape[1]
        rows_S = torch.div(slots_S, top_k, rounding_mode="floor")
        probs_S = weights_Tk.reshape(-1).index_select(0, slots_S)
        with no_autocast(x_TH.device):
            x_SH = x_TH.index_select(0, rows_S)
            h_S2F, ctx.fc1, _ = layer_fprop(x_SH, splits, layout.fc1, w1, cast_dtype)
            del x_SH  # gathered again by backward
            splits = device_splits(splits, x_TH.device)  # checked by fc1; for the rest
            a_SF = swiglu_probs(h_S2F, probs_S)
            y_SH, ctx.fc2, _ = layer_fprop(a_SF, splits, layout.fc2, w2, cast_dtype)
            del a_SF  # recomputed by backward's SwiGLU pass
            out_TH = _combine(y_SH, slots_S, weights_Tk.shape, y_SH.dtype)
        ctx.save_for_backward(x_TH, rows_S, slots_S, h_S2F, probs_S)
        ctx.splits = splits
        ctx.layout = layout
        ctx.cast_dtype = cast_dtype
        ctx.params = (w1, w2)
        ctx.weights_meta = (weights_Tk.shape, weights_Tk.dtype)
        return out_TH

    @staticmethod
    @differentiable_once("routed_grouped_mlp")
    def backward(ctx: Any, dout_TH: Tensor) -> tuple[Tensor | None, ...]:
        x_TH, rows_S, slots_S, h_S2F, probs_S = ctx.saved_tensors
        if _released(h_S2F):
            raise RuntimeError(
                "routed_grouped_mlp's backward ran a second time over one forward "
                "(retain_graph=True): its first backward freed the saved fc1 output to lower "
                "peak memory; run the forward again, or use grouped_mlp"
            )
        with no_autocast(dout_TH.device):
            return _routed_backward(ctx, dout_TH, x_TH, rows_S, slots_S, h_S2F, probs_S)


def _routed_backward(
    ctx: Any,
    dout_TH: Tensor,
    x_TH: Tensor,
    rows_S: Tensor,
    slots_S: Tensor,
    h_S2F: Tensor,
    probs_S: Tensor,
) -> tuple[Tensor | None, ...]:
    layout: MLPLayout = ctx.layout
    w1, w2 = ctx.params
    splits = ctx.splits
    dy_SH = dout_TH.index_select(0, rows_S).to(h_S2F.dtype)
    da_SF = layer_dgrad(dy_SH, splits, layout.fc2, w2, ctx.cast_dtype)
    dh_S2F, dprobs_S, a_SF = swiglu_probs_backward(da_SF, h_S2F, probs_S)
    del da_SF
    _release(h_S2F)
    fc1_nodes, fc2_nodes = gradient_nodes(ctx, w1, w2)
    fc2 = LayerGrads(ctx.fc2, (), ("dy", "fc2's input"), fc2_nodes)
    fc1 = LayerGrads(ctx.fc1, (), ("fc1's output grad", "x"), fc1_nodes)
    # fc1's refusals first: compiled, fc2's call writes its .grad
    fc2_grads = hand_over([fc2], [dy_SH], [a_SF], splits, None, ahead=[fc1])
    del dy_SH, a_SF
    x_SH = x_TH.index_select(0, rows_S)
    if ctx.cast_dtype is not None:
        x_SH = x_SH.to(ctx.cast_dtype)
    fc1_grads = hand_over([fc1], [dh_S2F], [x_SH], splits, None)
    del x_SH

    dx_TH = None
    if ctx.needs_input_grad[0]:
        dx_SH = layer_dgrad(dh_S2F, splits, layout.fc1, w1, ctx.cast_dtype)
        del dh_S2F
        dx_TH = _combine(dx_SH, slots_S, ctx.weights_meta[0], x_TH.dtype)
    dweights_Tk = None
    if ctx.needs_input_grad[1]:
        assert dprobs_S is not None
        shape, dtype = ctx.weights_meta
        flat = torch.zeros(slots_S.shape[0], dtype=dtype, device=slots_S.device)
        dweights_Tk = flat.index_copy_(0, slots_S, dprobs_S).view(shape)
    return (dx_TH, dweights_Tk, None, None, None, None, *fc1_grads, *fc2_grads)


def _check_routing(x: object, slots: object, top_k_weights: object, hidden: int) -> None:
    """``x`` ``(T, H)``, ``top_k_weights`` floating ``(T, k)``, ``slots`` an integer ``(T·k,)``.

    Raises:
        ValueError: A shape or device mismatch.
        TypeError: An argument of the wrong type or dtype.
    """
    check_mlp_inputs(x, None, hidden)
    assert isinstance(x, Tensor)
    if not isinstance(top_k_weights, Tensor) or not top_k_weights.dtype.is_floating_point:
        kind = top_k_weights.dtype if isinstance(top_k_weights, Tensor) else type(top_k_weights)
        raise TypeError(f"top_k_weights is {kind}, expected a floating-point (T, k) tensor")
    if top_k_weights.dim() != 2 or top_k_weights.shape[0] != x.shape[0]:
        raise ValueError(
            f"top_k_weights has shape {tuple(top_k_weights.shape)}, expected ({x.shape[0]}, k): "
            "one row of router weights per token of x"
        )
    if not isinstance(slots, Tensor) or slots.dtype not in (torch.int32, torch.int64):
        kind = slots.dtype if isinstance(slots, Tensor) else type(slots)
        raise TypeError(f"slots is {kind}, expected an int64 or int32 tensor")
    if tuple(slots.shape) != (top_k_weights.numel(),):
        raise ValueError(
            f"slots has shape {tuple(slots.shape)}, expected ({top_k_weights.numel()},): every "
            "slot t·k + j of top_k_weights once"
        )
    for name, t in (("top_k_weights", top_k_weights), ("slots", slots)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected x's device {x.device}")


def _check_permutation(slots_S: Tensor) -> None:
    """Every slot exactly once: a ``ValueError`` in eager code on the CPU; compiled, or on a
    GPU, an asynchronous assertion (no host sync) that fails the call with the same words."""
    S = slots_S.shape[0]
    if S == 0:
        return
    compiled = torch.compiler.is_compiling()  # its kernels may run before the assertions
    on_host = slots_S.device.type == "cpu" and not compiled
    in_range = (slots_S.min() >= 0) & (slots_S.max() < S)
    if on_host and not bool(in_range):
        raise ValueError(f"slots holds a slot outside [0, {S}), expected a permutation")
    if not on_host:
        torch._assert_async(in_range, "slots holds a slot outside [0, T·k): expected a permutation")
    seen = torch.zeros(S, dtype=torch.bool, device=slots_S.device)
    seen.index_fill_(0, slots_S.clamp(0, S - 1) if compiled else slots_S, True)
    if on_host and not bool(seen.all()):
        raise ValueError("slots repeats a slot, expected a permutation of range(T·k)")
    if not on_host:
        torch._assert_async(seen.all(), "slots repeats a slot: expected a permutation")


def routed_grouped_mlp(
    x: Tensor,
    fc1_weights: Tensor | Sequence[Tensor],
    fc2_weights: Tensor | Sequence[Tensor],
    slots: Tensor,
    splits: Splits,
    top_k_weights: Tensor,
    *,
    activation: str = "swiglu",
) -> Tensor:
    """Token-choice MoE experts in one op: gather, fused SwiGLU MLP, router-weighted combine.

    ``out[t] = Σ_j top_k_weights[t, j] · mlp_e(x[t])`` over token ``t``'s
    ``k`` choices, with ``mlp_e(v) = fc2_e(silu(gate_e v) * (up_e v))`` the
    fused MLP of :func:`~groupgrad.modules.grouped_mlp` and the sum in fp32,
    rounded once. The caller routes: ``slots`` lists the ``T·k`` slots
    (``s = t·k + j``, token ``t``'s ``j``-th choice) grouped by expert,
    ``splits[e]`` of them for expert ``e`` (e.g. ``torch.sort`` of the
    flattened expert ids). A slot that should compute nothing (an
    expert-parallel "no expert" choice) rides along in any expert's group
    with router weight 0.

    Against gathering ``x`` and combining around :func:`grouped_mlp`, the op
    keeps no ``(T·k, H)`` tensor from forward to backward and frees each
    backward operand once used, so its peak memory is lower (the module
    docstring of ``groupgrad.modules._routed`` counts it); the results are
    the same.

    Args:
        x: ``(T, H)`` tokens (bf16, fp16 or fp32; under ``torch.autocast``
            the GEMMs run in the autocast dtype).
        fc1_weights: Packed ``(E, 2F, H)`` tensor or ``E`` ``(2F, H)`` tensors
            (gate rows first, then up), in ``x``'s dtype.
        fc2_weights: Packed ``(E, H, F)`` tensor or ``E`` ``(H, F)`` tensors.
        slots: ``(T·k,)`` int64 or int32 permutation of ``range(T·k)``, grouped
            by expert (checked: on a GPU by an asynchronous device assertion).
        splits: ``E`` slot counts summing to ``T·k`` (sequence, CPU tensor
            or device tensor, never read on the host on the GPU path).
        top_k_weights: ``(T, k)`` router weight of each choice (any floating
            dtype; it receives a gradient).
        activation: Only ``"swiglu"``.

    Returns:
        ``(T, H)`` in ``x``'s dtype (the autocast dtype under autocast).

    Weight gradients reach autograd in each parameter's ``grad_dtype``
    straight from the GEMM epilogue (a ``main_grad`` route and
    ``DistributedWeight`` groups take :func:`grouped_mlp`). A second backward
    over one forward (``retain_graph=True``) raises ``RuntimeError``: the
    first freed the saved fc1 output.

    Raises:
        ValueError: A shape, layout, device or activation mismatch, or
            ``slots`` not a permutation (on the CPU).
        TypeError: An argument of the wrong type or dtype, or a
            ``DistributedWeight`` group.
    """
    check_activation(activation, "routed_grouped_mlp")
    layout, params, hidden = mlp_arguments(
        fc1_weights, fc2_weights, None, None, False, "routed_grouped_mlp", plain_only=True
    )
    _check_routing(x, slots, top_k_weights, cast(int, hidden))  # plain weights: H known
    slots = slots.to(torch.int64)  # int32 taken too: the index ops want int64
    _check_permutation(slots)
    refuse_derived_parameters(params, layout.fc1.names[0])
    x, cast_dtype = autocast_input(x)
    splits = snapshot_splits(splits, layout.fc1.num_groups(params[: layout.num_weights]))
    args = (x, top_k_weights, slots, splits, layout, cast_dtype, *params)
    if not torch.is_grad_enabled():  # no backward follows: see _no_grad
        return forward_without_backward(RoutedMLPFunction, *args)
    return RoutedMLPFunction.apply(*args)
