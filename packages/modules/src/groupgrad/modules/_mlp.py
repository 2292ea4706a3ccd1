"""``GroupedMLP``: every expert's SwiGLU MLP, fc1 → SwiGLU × router probs → fc2, fused.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from groupgrad.modules._base import FLAG_REPR_FIELDS, GroupedModule
from groupgrad.modules._fp8_recipe import (
    check_fp8_recipe,
    check_fp8_sizes,
    keeps_weights_for_backward,
    weight_cache,
)
from groupgrad.modules._group import Splits, checks_weight_versions
from groupgrad.modules._linear import GroupedLinear, check_sizes
from groupgrad.modules._mlp_args import (
    MLPLayout,
    check_activation,
    check_distributed_pairing,
    check_mlp_inputs,
)
from groupgrad.modules._mlp_fn import apply_grouped_mlp, mlp_forms

__all__ = ["GroupedMLP"]


_OP_SETTINGS = ("delay_wgrad_compute", "fp8_recipe")  # the fused op's, not each layer's


class GroupedMLP(GroupedModule):
    """``E`` SwiGLU MLPs applied to consecutive row groups of one input, as one fused op.

    Expert ``e`` computes, on its ``splits[e]`` rows::

        h = x_e @ fc1_e.T (+ b1_e)                       (T_e, 2F)
        y_e = (silu(h[:, :F]) * h[:, F:] * probs_e[:, None]) @ fc2_e.T (+ b2_e)

    as one autograd Function with one backward (see ``_mlp_fn`` for the exact
    steps). The parameters live in the submodules :attr:`fc1` (a
    :class:`GroupedLinear` ``H → 2F``: ``fc1.weight0 …`` of shape ``(2F, H)``,
    or packed ``fc1.weight`` ``(E, 2F, H)``) and :attr:`fc2` (``F → H``:
    ``(H, F)`` per expert or ``(E, H, F)``); with ``bias=True`` also
    ``fc1.bias0 …`` / ``fc2.bias0 …`` (or packed ``(E, 2F)`` / ``(E, H)``).
    They are looked up by name at every forward, so a framework may replace
    them (e.g. with ``DistributedWeight`` leaders — for fc1 and fc2 both, or
    neither). Initialization: each expert like ``nn.Linear``.

    Activation memory: forward saves ``x`` ``(T, H)``, ``h`` ``(T, 2F)`` and
    ``probs`` ``(T,)`` when given — ``2·(H + 2F)`` bytes per token in bf16
    (plus 4 for fp32 ``probs``); the SwiGLU output ``(T, F)`` is always
    recomputed by backward's fused SwiGLU pass (no extra read: that pass reads
    ``h`` anyway), saving ``2·F`` bytes per token. Weights are never saved.

    Weight gradients follow the ``main_grad`` contract of
    :mod:`groupgrad.protocol` for fc1 and fc2 alike: with
    ``accumulate_into_main_grad=True`` each wgrad GEMM writes straight into
    ``main_grad`` — adding, or overwriting where ``overwrite_main_grad`` is
    set when the GEMM runs.

    Args:
        num_groups: ``E``, the number of experts.
        hidden_size: ``H``, the model width (input and output features).
        ffn_hidden_size: ``F``, each expert's intermediate width.
        activation: Only ``"swiglu"``: ``silu(gate) * up`` with the gate in
            the first ``F`` columns of fc1's output.
        bias: Whether fc1 and fc2 have per-expert biases.
        dtype: Parameter dtype (default: PyTorch's default dtype).
        device: Parameter device.
        single_grouped_weight: Hold each layer's experts in one packed
            parameter (``fc1.weight``, ``fc2.weight``).
        accumulate_into_main_grad: Write fc1's and fc2's weight gradients into
            each weight parameter's ``main_grad`` through the GEMM's epilogue
            (accumulating or overwriting, per ``overwrite_main_grad``);
            autograd receives a zero dummy (``grad_added_to_main_grad``, the
            shared cached buffer described in
            :class:`~groupgrad.modules.GroupedLinear`) or ``None``. Settable
            later: it sets both layers.
        delay_wgrad_compute: Backward computes only the input, ``probs`` and
            bias gradients; both weight-gradient GEMMs run at
            :meth:`backward_dw`.
        fp8_recipe: ``None`` (GEMMs in the input's dtype) or ``"blockwise"``:
            the four GEMMs in FP8 e4m3 with fp32 block scales, as
            :class:`~groupgrad.modules.GroupedLinear` runs them (``fc1`` and
            ``fc2`` get the same recipe). ``x``, ``a`` (fc2's input), ``dy``
            and ``dh`` (fc1's output gradient) are each quantized into the
            ``(1, 128)`` and ``(128, 1)`` forms their GEMMs read, from the
            unquantized tensor. Backward keeps ``x``'s ``(128, 1)`` form and
            fc1's output ``h`` in its ``(1, 128)`` form (about half the bf16
            bytes), and the SwiGLU reads that ``h`` dequantized in forward
            and backward alike, so the recomputed ``a`` is the forward's.
            ``hidden_size`` and ``ffn_hidden_size`` must be multiples of 128.
            Parameters keep their dtype and every ``main_grad`` option works
            as without FP8. See :meth:`forward`'s ``is_first_microbatch``.

    Raises:
        ValueError: A size is not a positive int, or ``activation`` is not
            ``"swiglu"``; ``fp8_recipe`` is not ``None`` or ``"blockwise"``,
            or with ``"blockwise"`` a size is not a multiple of 128.
    """

    _repr_fields = (
        ("num_groups", "num_groups"),
        ("hidden_size", "hidden_size"),
        ("ffn_hidden_size", "ffn_hidden_size"),
        ("activation", "activation"),
        *FLAG_REPR_FIELDS,
        ("fp8_recipe", "fp8_recipe"),
    )

    def __init__(
        self,
        num_groups: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        single_grouped_weight: bool = False,
        accumulate_into_main_grad: bool = False,
        delay_wgrad_compute: bool = False,
        fp8_recipe: str | None = None,
    ) -> None:
        check_sizes(num_groups=num_groups, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        check_activation(activation, "GroupedMLP")
        if check_fp8_recipe(fp8_recipe) is not None:
            check_fp8_sizes(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        super().__init__(num_groups, bias, single_grouped_weight, delay_wgrad_compute)
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.fp8_recipe = fp8_recipe

        def layer(in_features: int, out_features: int) -> GroupedLinear:
            return GroupedLinear(
                num_groups,
                in_features,
                out_features,
                bias=bias,
                dtype=dtype,
                device=device,
                single_grouped_weight=single_grouped_weight,
                accumulate_into_main_grad=accumulate_into_main_grad,
                delay_wgrad_compute=delay_wgrad_compute,
                fp8_recipe=fp8_recipe,
            )

        self.fc1 = layer(hidden_size, 2 * ffn_hidden_size)
        self.fc2 = layer(ffn_hidden_size, hidden_size)
        self.fc1._in_fused_op = self.fc2._in_fused_op = True

    def __setattr__(self, name: str, value: Any) -> None:
        """``delay_wgrad_compute`` and ``fp8_recipe`` are the fused op's: set on fc1 and fc2 too."""
        super().__setattr__(name, value)
        if name in _OP_SETTINGS and "fc2" in self._modules:
            setattr(self.fc1, name, value)
            setattr(self.fc2, name, value)

    def _check_layers(self) -> None:
        """Refuse fc1 or fc2 given an op-wide setting of its own (the op would ignore it)."""
        for fc in ("fc1", "fc2"):
            for name in _OP_SETTINGS:
                mine, theirs = getattr(self, name), getattr(getattr(self, fc), name)
                if theirs != mine:
                    raise ValueError(
                        f"{fc}.{name} is {theirs!r} but the GroupedMLP's is {mine!r}: the "
                        f"GroupedMLP runs fc1 and fc2 as one op with its own {name}; set it on "
                        "the GroupedMLP (which sets both layers)"
                    )

    @property
    def accumulate_into_main_grad(self) -> bool:
        """Whether fc1's and fc2's wgrads go into ``main_grad`` (set on both layers at once)."""
        return self.fc1.accumulate_into_main_grad and self.fc2.accumulate_into_main_grad

    @accumulate_into_main_grad.setter
    def accumulate_into_main_grad(self, value: bool) -> None:
        self.fc1.accumulate_into_main_grad = value
        self.fc2.accumulate_into_main_grad = value

    def reset_parameters(self) -> None:
        """Re-initialize every expert of fc1 and fc2 like ``nn.Linear``."""
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def forward(
        self,
        x: Tensor,
        splits: Splits,
        probs: Tensor | None = None,
        is_first_microbatch: bool | None = None,
    ) -> Tensor:
        """Apply every expert's MLP to its rows, scaled per token by ``probs``.

        Args:
            x: ``(T, H)`` input, rows grouped by expert in order, in the
                parameters' dtype.
            splits: ``E`` token counts summing to ``T`` (sequence, CPU tensor
                or device tensor; the GPU path never reads a device tensor on
                the host).
            probs: ``(T,)`` router probability of each row (any floating
                dtype; it receives a gradient in its dtype), or ``None`` for
                ones.
            is_first_microbatch: The FP8 weight caches of ``fc1`` and ``fc2``
                (ignored without ``fp8_recipe``), exactly as
                :meth:`GroupedLinear.forward <groupgrad.modules.GroupedLinear.forward>`
                uses its own: ``None`` quantizes the weights at every forward
                (and keeps them for dgrad where ``GroupedLinear`` does);
                ``True`` quantizes and caches; ``False`` reuses a cache that
                still matches. After a write through ``.data`` pass ``True``.
                ``DistributedWeight`` groups are never cached; not under
                ``torch.compile``.

        Returns:
            ``(T, H)`` output in ``x``'s dtype, or in the autocast dtype under
            ``torch.autocast``.

        ``splits`` is copied now: backward and :meth:`backward_dw` use the
        copy, so the caller may refill its buffer at once.

        Raises:
            ValueError: ``x`` is not ``(T, H)``; ``probs`` is not ``(T,)`` or
                on another device; fc1 and fc2 are not both distributed or
                both plain (the kernels check ``splits``, dtypes and devices);
                fc1 or fc2 was given its own ``delay_wgrad_compute`` or
                ``fp8_recipe`` (set them on the GroupedMLP).
            TypeError: ``probs`` is not a floating-point tensor, or
                ``is_first_microbatch`` not ``None`` or a bool.
        """
        check_mlp_inputs(x, probs, self.hidden_size)
        self._check_layers()
        caches = (
            weight_cache(self, self.fc1._fp8_weights),
            weight_cache(self, self.fc2._fp8_weights),
        )
        forms = mlp_forms(
            self.fp8_recipe,
            caches,
            is_first_microbatch,
            keep_weights=keeps_weights_for_backward(self),
        )
        fc1_weights, fc1_biases = self.fc1.current_parameters()
        fc2_weights, fc2_biases = self.fc2.current_parameters()
        checks = checks_weight_versions(self)
        fc1, fc2 = self.fc1.group_spec("fc1", checks), self.fc2.group_spec("fc2", checks)
        check_distributed_pairing(
            fc1_weights[0], fc1.names[0], fc2_weights[0], fc2.names[0], "GroupedMLP"
        )
        layout = MLPLayout(fc1, fc2, num_weights=len(fc1_weights), num_biases=len(fc1_biases))
        params = [*fc1_weights, *fc1_biases, *fc2_weights, *fc2_biases]
        out = apply_grouped_mlp(x, splits, probs, layout, self._forward_queue(), params, forms)
        return self._after_forward(out)
