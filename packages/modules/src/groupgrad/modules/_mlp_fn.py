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
:class:`~groupgrad.modules._wgrad.WgradQueue`; ``backward_dw()`` runs them
(fc2, then fc1).

``splits`` is copied at forward; under ``torch.autocast`` the GEMMs run in
the autocast dtype (``x`` cast before the op, the materialized weights inside
it) and the wgrads still reach each parameter in its ``grad_dtype``.
:func:`grouped_mlp` is the functional form, for frameworks that own their
parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from groupgrad.kernels import swiglu_probs, swiglu_probs_backward
from groupgrad.modules._compiled import hand_over, refuse_derived_parameters
from groupgrad.modules._grads import LayerGrads
from groupgrad.modules._group import (
    Splits,
    WeightGroupSpec,
    autocast_input,
    check_biases,
    device_splits,
    expert_index,
    no_autocast,
    snapshot_splits,
)
from groupgrad.modules._linear_fn import add_bias, layer_dgrad, layer_fprop, stack_bias
from groupgrad.modules._wgrad import WgradQueue
from groupgrad.protocol import is_distributed_weight

__all__ = [
    "ACTIVATIONS",
    "GroupedMLPFunction",
    "MLPLayout",
    "apply_grouped_mlp",
    "check_activation",
    "check_distributed_pairing",
    "check_mlp_inputs",
    "check_mlp_shapes",
    "grouped_mlp",
    "layer_group",
    "mlp_arguments",
]

ACTIVATIONS = ("swiglu",)


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


class GroupedMLPFunction(torch.autograd.Function):
    """``y = fc2(silu(h[:, :F]) * h[:, F:] * probs[:, None])``, ``h = fc1(x)``: one backward.

    ``apply(x_TH, splits, probs_T, layout, queue, cast_dtype, *params)`` with ``params``
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
        cast_dtype: torch.dtype | None,
        *params: Tensor,
    ) -> Tensor:
        w1, b1, w2, b2 = layout.split(params)
        T = x_TH.shape[0]
        with no_autocast(x_TH.device):
            h_T2F, ctx.fc1, num_groups = layer_fprop(x_TH, splits, layout.fc1, w1, cast_dtype)
            splits = device_splits(splits, x_TH.device)  # checked by fc1; for fc2 and backward
            expert_T = None
            if layout.num_biases:
                expert_T = expert_index(splits, num_groups, T, x_TH.device)
                h_T2F = add_bias(h_T2F, stack_bias(b1, layout.fc1.packed), expert_T)

            a_TF = swiglu_probs(h_T2F, probs_T)

            y_TH, ctx.fc2, _ = layer_fprop(a_TF, splits, layout.fc2, w2, cast_dtype)
            del a_TF  # recomputed by backward's SwiGLU pass
            if expert_T is not None:
                y_TH = add_bias(y_TH, stack_bias(b2, layout.fc2.packed), expert_T)

        ctx.save_for_backward(x_TH, h_T2F, probs_T)
        ctx.splits = splits
        ctx.layout = layout
        ctx.queue = queue
        ctx.cast_dtype = cast_dtype
        ctx.params = (w1, b1, w2, b2)
        return y_TH

    @staticmethod
    def backward(ctx: Any, dy_TH: Tensor) -> tuple[Tensor | None, ...]:
        x_TH, h_T2F, probs_T = ctx.saved_tensors
        with no_autocast(dy_TH.device):
            return _mlp_backward(ctx, dy_TH.contiguous(), x_TH, h_T2F, probs_T)


def _mlp_backward(
    ctx: Any, dy_TH: Tensor, x_TH: Tensor, h_T2F: Tensor, probs_T: Tensor | None
) -> tuple[Tensor | None, ...]:
    layout: MLPLayout = ctx.layout
    w1, b1, w2, b2 = ctx.params
    splits = ctx.splits
    da_TF = layer_dgrad(dy_TH, splits, layout.fc2, w2, ctx.cast_dtype)
    dh_T2F, dprobs_T, a_TF = swiglu_probs_backward(da_TF, h_T2F, probs_T)
    del da_TF
    fc2 = LayerGrads(ctx.fc2, b2, ("dy", "fc2's input"))
    fc1 = LayerGrads(ctx.fc1, b1, ("fc1's output grad", "x"))
    # fc1's wgrad needs only dh and x: both wgrads (and their main_grad checks) run now
    grads = hand_over([fc2, fc1], [dy_TH, dh_T2F], [a_TF, x_TH], splits, ctx.queue)
    del a_TF
    fc2_grads, fc1_grads = grads[: len(fc2.params)], grads[len(fc2.params) :]

    dx_TH = None
    if ctx.needs_input_grad[0]:
        dx_TH = layer_dgrad(dh_T2F, splits, layout.fc1, w1, ctx.cast_dtype)
    dprobs_T = dprobs_T if ctx.needs_input_grad[2] else None
    return (dx_TH, None, dprobs_T, None, None, None, *fc1_grads, *fc2_grads)


def check_activation(activation: object, owner: str) -> None:
    """Raise ``ValueError`` unless ``activation`` is one the fused MLP supports."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation is {activation!r}; {owner} supports only "
            f"{', '.join(repr(a) for a in ACTIVATIONS)}"
        )


def check_mlp_inputs(x: object, probs: object, hidden_size: int) -> None:
    """Check ``x`` is ``(T, H)`` and ``probs`` is ``None`` or a floating ``(T,)`` on ``x``'s device.

    Raises:
        ValueError: A shape or device mismatch.
        TypeError: ``probs`` is not a floating-point tensor.
    """
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != hidden_size:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"x has shape {shape}, expected (tokens, {hidden_size}) for hidden_size={hidden_size}"
        )
    if probs is None:
        return
    if not isinstance(probs, Tensor):
        raise TypeError(f"probs is a {type(probs).__name__}, expected a Tensor or None")
    if tuple(probs.shape) != (x.shape[0],):
        raise ValueError(
            f"probs has shape {tuple(probs.shape)}, expected (T,) = ({x.shape[0]},): one "
            "router probability per row of x"
        )
    if not probs.dtype.is_floating_point:
        raise TypeError(f"probs has dtype {probs.dtype}, expected a floating-point dtype")
    if probs.device != x.device:
        raise ValueError(f"probs is on {probs.device}, expected x's device {x.device}")


def check_distributed_pairing(
    fc1_leader: Tensor, fc1_name: str, fc2_leader: Tensor, fc2_name: str, owner: str
) -> None:
    """Raise ``ValueError`` unless fc1 and fc2 are both distributed or both plain."""
    fc1_distributed = is_distributed_weight(fc1_leader)
    if fc1_distributed == is_distributed_weight(fc2_leader):
        return
    distributed, plain = (fc1_name, fc2_name) if fc1_distributed else (fc2_name, fc1_name)
    raise ValueError(
        f"{distributed} is a DistributedWeight but {plain} is a plain tensor; {owner} needs fc1 "
        "and fc2 both distributed or both plain"
    )


def check_mlp_shapes(fc1: Tensor, fc1_name: str, fc2: Tensor, fc2_name: str) -> int:
    """Check fc1 is ``(·, 2F, H)`` and fc2 ``(·, H, F)`` with one ``E``; return ``H``."""
    (*e1, two_f, hidden), (*e2, out, ffn) = fc1.shape, fc2.shape
    if two_f != 2 * ffn or out != hidden or e1 != e2:
        raise ValueError(
            f"{fc1_name} has shape {tuple(fc1.shape)} and {fc2_name} has shape "
            f"{tuple(fc2.shape)}; expected fc1 (·, 2F, H) and fc2 (·, H, F) with one E, F and H"
        )
    return int(hidden)


def apply_grouped_mlp(
    x_TH: Tensor,
    splits: Splits,
    probs_T: Tensor | None,
    layout: MLPLayout,
    queue: WgradQueue | None,
    params: Sequence[Tensor],
) -> Tensor:
    """Run :class:`GroupedMLPFunction`, in autocast's dtype where autocast is on."""
    refuse_derived_parameters(params, layout.fc1.names[0])
    x_TH, cast_dtype = autocast_input(x_TH)
    splits = snapshot_splits(splits, layout.fc1.num_groups(params[: layout.num_weights]))
    return GroupedMLPFunction.apply(x_TH, splits, probs_T, layout, queue, cast_dtype, *params)


def layer_group(
    name: str, weights: object, bias: Tensor | Sequence[Tensor] | None
) -> tuple[WeightGroupSpec, list[Tensor], list[Tensor]]:
    """One layer's weights and biases as a spec and parameter lists (functional form)."""
    if isinstance(weights, Tensor):
        if weights.dim() != 3 and not is_distributed_weight(weights):
            raise ValueError(
                f"{name}_weights has shape {tuple(weights.shape)}, expected (E, ·, ·) or a "
                "sequence of E 2-D tensors"
            )
        members: list[Tensor] = [weights]
        names: tuple[str, ...] = (f"{name}_weights",)
    elif isinstance(weights, Sequence) and not isinstance(weights, str | bytes) and weights:
        members = list(weights)
        for index, w in enumerate(members):
            if not isinstance(w, Tensor):
                raise TypeError(
                    f"{name}_weights[{index}] is a {type(w).__name__}, expected a Tensor"
                )
        names = tuple(f"{name}_weights[{i}]" for i in range(len(members)))
    else:
        raise TypeError(
            f"{name}_weights is {type(weights).__name__}, expected an (E, ·, ·) tensor or a "
            "non-empty sequence of E 2-D tensors"
        )
    packed = isinstance(weights, Tensor)
    biases: list[Tensor] = []
    if bias is not None:
        if packed != isinstance(bias, Tensor):
            raise ValueError(
                f"{name}_bias is a {type(bias).__name__}; expected a packed (E, ·) tensor with "
                f"packed {name}_weights, or a sequence of E 1-D tensors with per-expert weights"
            )
        biases = [bias] if isinstance(bias, Tensor) else list(bias)
        if len(biases) != len(members):
            raise ValueError(
                f"{name}_bias has {len(biases)} entries, expected {len(members)} (one per "
                f"{name} weight)"
            )
        if not is_distributed_weight(members[0]):
            check_biases(biases, members, packed, f"{name}_bias", f"{name}_weights")
    return WeightGroupSpec(names, packed, False), members, biases


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

    Returns:
        ``(T, H)`` output in ``x``'s dtype (the autocast dtype under autocast).

    Raises:
        ValueError: A shape, layout, device or activation mismatch.
        TypeError: An argument of the wrong type.
        RuntimeError: ``main_grad`` is missing or malformed (at backward).
    """
    check_activation(activation, "grouped_mlp")
    if not isinstance(x, Tensor):
        raise TypeError(f"x is a {type(x).__name__}, expected a Tensor")
    layout, params, hidden = mlp_arguments(
        fc1_weights, fc2_weights, fc1_bias, fc2_bias, accumulate_into_main_grad, "grouped_mlp"
    )
    if hidden is None:  # a DistributedWeight group: its implementer owns the shapes
        hidden = x.shape[-1] if x.dim() == 2 else -1
    check_mlp_inputs(x, probs, hidden)
    return apply_grouped_mlp(x, splits, probs, layout, None, params)


def mlp_arguments(
    fc1_weights: Tensor | Sequence[Tensor],
    fc2_weights: Tensor | Sequence[Tensor],
    fc1_bias: Tensor | Sequence[Tensor] | None,
    fc2_bias: Tensor | Sequence[Tensor] | None,
    accumulate_into_main_grad: bool,
    owner: str,
) -> tuple[MLPLayout, list[Tensor], int | None]:
    """A functional fused MLP's weights and biases as a layout and its parameter list.

    Returns:
        The layout, the parameters (``*fc1 weights, *fc1 biases, *fc2 weights,
        *fc2 biases``) and ``H`` (``None`` for a ``DistributedWeight`` group,
        whose shapes are its implementer's).

    Raises:
        ValueError: A shape or layout mismatch between fc1 and fc2 or their biases.
        TypeError: A weight that is not a tensor.
    """
    if (fc1_bias is None) != (fc2_bias is None):
        raise ValueError(
            "fc1_bias and fc2_bias must be given both or neither, got "
            f"fc1_bias={'None' if fc1_bias is None else 'a bias'} and "
            f"fc2_bias={'None' if fc2_bias is None else 'a bias'}"
        )
    fc1, w1, b1 = layer_group("fc1", fc1_weights, fc1_bias)
    fc2, w2, b2 = layer_group("fc2", fc2_weights, fc2_bias)
    if fc1.packed != fc2.packed or len(w1) != len(w2):
        raise ValueError(
            f"fc1_weights and fc2_weights differ in layout ({len(w1)} "
            f"{'packed' if fc1.packed else 'per-expert'} vs {len(w2)} "
            f"{'packed' if fc2.packed else 'per-expert'}); expected the same"
        )
    check_distributed_pairing(w1[0], fc1.names[0], w2[0], fc2.names[0], owner)
    hidden = None
    if not is_distributed_weight(w1[0]):
        hidden = check_mlp_shapes(w1[0], fc1.names[0], w2[0], fc2.names[0])
    layout = MLPLayout(
        fc1=WeightGroupSpec(fc1.names, fc1.packed, accumulate_into_main_grad),
        fc2=WeightGroupSpec(fc2.names, fc2.packed, accumulate_into_main_grad),
        num_weights=len(w1),
        num_biases=len(b1),
    )
    return layout, [*w1, *b1, *w2, *b2], hidden
