"""``GroupedLinear``: one ``nn.Linear`` per expert, run as grouped GEMMs.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from groupgrad.modules._base import FLAG_REPR_FIELDS, GroupedModule
from groupgrad.modules._fp8_cache import Fp8WeightCache
from groupgrad.modules._fp8_recipe import (
    check_fp8_recipe,
    check_fp8_sizes,
    fp8_for_forward,
    keeps_weights_for_backward,
    weight_cache,
)
from groupgrad.modules._group import Splits, WeightGroupSpec, checks_weight_versions
from groupgrad.modules._linear_fn import apply_grouped_linear

__all__ = ["GroupedLinear", "check_sizes"]


def check_sizes(**sizes: object) -> None:
    """Raise ``ValueError`` naming the first size that is not a positive int (``True`` is not)."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} is {value!r}, expected a positive int")


class GroupedLinear(GroupedModule):
    """``E`` linear layers applied to consecutive row groups of one input.

    Expert ``e`` computes ``y_e = x_e @ w_e.T + b_e`` on its ``splits[e]``
    rows. Parameters are ``weight0 … weight{E-1}`` (``(N, K)`` each) and
    ``bias0 …`` (``(N,)``), or with ``single_grouped_weight=True`` one
    ``weight`` ``(E, N, K)`` and ``bias`` ``(E, N)``. They are looked up by name
    at every forward, so a framework may replace them after construction
    (e.g. ``weight0`` with a ``DistributedWeight`` leader).

    Initialization follows ``nn.Linear`` for each expert: weights and biases
    uniform in ``[-1/sqrt(K), 1/sqrt(K)]`` (Kaiming-uniform with ``a=sqrt(5)``).

    Args:
        num_groups: ``E``, the number of experts.
        in_features: ``K``.
        out_features: ``N``.
        bias: Whether each expert has a bias.
        dtype: Parameter dtype (default: PyTorch's default dtype).
        device: Parameter device.
        single_grouped_weight: Hold all experts in one packed parameter.
        accumulate_into_main_grad: Write the weight gradient into each weight
            parameter's ``main_grad`` (fp32 in mixed-precision training) through
            the GEMM's epilogue: adding, or overwriting where the parameter's
            ``overwrite_main_grad`` is set when the GEMM runs. Autograd then
            receives a zero dummy where the parameter carries
            ``grad_added_to_main_grad`` (set ``True``), else ``None``. Dummies
            are aliases of one cached zero buffer per shape and grad dtype, so
            those parameters share ``.grad`` storage (as in TransformerEngine;
            frameworks that honour the flag ignore ``.grad``); the buffer is
            zeroed again before a hand-out if anything wrote into it. A
            parameter with ``requires_grad=False`` is never written and needs
            no ``main_grad``.
        delay_wgrad_compute: Backward computes only the input (and bias)
            gradients; the weight-gradient GEMMs run at :meth:`backward_dw`.
        fp8_recipe: ``None`` (GEMMs in the input's dtype) or ``"blockwise"``:
            FP8 e4m3 GEMMs with fp32 block scales (``(1, 128)`` blocks of
            ``x`` and ``dy``, ``(128, 128)`` weight tiles, ``(128, 1)``
            token blocks per expert for the wgrad), each form quantized from
            the unquantized tensor. ``in_features`` and ``out_features``
            must be multiples of 128. Parameters keep their dtype; every
            ``main_grad`` option above works as without FP8, the wgrad
            written by the FP8 GEMM straight into ``main_grad`` (or returned
            in ``grad_dtype``). Backward keeps only the FP8 wgrad form of
            ``x`` (about half a bf16 ``x``'s bytes). See :meth:`forward`'s
            ``is_first_microbatch`` for caching the FP8 weights.
    """

    _repr_fields = (
        ("num_groups", "num_groups"),
        ("in_features", "in_features"),
        ("out_features", "out_features"),
        *FLAG_REPR_FIELDS,
        ("fp8_recipe", "fp8_recipe"),
    )

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        single_grouped_weight: bool = False,
        accumulate_into_main_grad: bool = False,
        delay_wgrad_compute: bool = False,
        fp8_recipe: str | None = None,
    ) -> None:
        check_sizes(num_groups=num_groups, in_features=in_features, out_features=out_features)
        if check_fp8_recipe(fp8_recipe) is not None:
            check_fp8_sizes(in_features=in_features, out_features=out_features)
        super().__init__(num_groups, bias, single_grouped_weight, delay_wgrad_compute)
        self.in_features = in_features
        self.out_features = out_features
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.fp8_recipe = fp8_recipe
        self._fp8_weights = Fp8WeightCache()

        factory: dict[str, Any] = {"dtype": dtype, "device": device}
        if single_grouped_weight:
            self.weight = nn.Parameter(
                torch.empty(num_groups, out_features, in_features, **factory)
            )
            if bias:
                self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory))
        else:
            for e in range(num_groups):
                self.register_parameter(
                    f"weight{e}", nn.Parameter(torch.empty(out_features, in_features, **factory))
                )
                if bias:
                    self.register_parameter(
                        f"bias{e}", nn.Parameter(torch.empty(out_features, **factory))
                    )
        self.reset_parameters()

    @property
    def weight_names(self) -> tuple[str, ...]:
        """Names of the weight parameters, leader first."""
        if self.single_grouped_weight:
            return ("weight",)
        return tuple(f"weight{e}" for e in range(self.num_groups))

    @property
    def bias_names(self) -> tuple[str, ...]:
        """Names of the bias parameters (empty without bias)."""
        if not self.use_bias:
            return ()
        if self.single_grouped_weight:
            return ("bias",)
        return tuple(f"bias{e}" for e in range(self.num_groups))

    def reset_parameters(self) -> None:
        """Re-initialize every expert like ``nn.Linear``."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            for name in (*self.weight_names, *self.bias_names):
                getattr(self, name).uniform_(-bound, bound)

    def group_spec(self, prefix: str = "", checks_versions: bool = False) -> WeightGroupSpec:
        """The weight layout the grouped GEMMs see; messages name parameters ``prefix.name``;
        ``checks_versions``: as :class:`WeightGroupSpec`'s."""
        names = tuple(f"{prefix}.{n}" if prefix else n for n in self.weight_names)
        return WeightGroupSpec(
            names, self.single_grouped_weight, self.accumulate_into_main_grad, checks_versions
        )

    def current_parameters(self) -> tuple[list[Tensor], list[Tensor]]:
        """The weight and bias parameters as they are now (looked up by name), leader first."""
        weights = [getattr(self, name) for name in self.weight_names]
        biases = [getattr(self, name) for name in self.bias_names]
        return weights, biases

    def forward(self, x: Tensor, splits: Splits, is_first_microbatch: bool | None = None) -> Tensor:
        """Apply every expert to its rows.

        Args:
            x: ``(T, K)`` input, rows grouped by expert in order.
            splits: ``E`` token counts summing to ``T`` (sequence, CPU tensor,
                or device tensor; the GPU path never reads a device tensor on
                the host).
            is_first_microbatch: The FP8 weight cache (TransformerEngine's
                convention; ignored without ``fp8_recipe``). ``None``: the
                weights are quantized at this forward, nothing cached across
                forwards; the layer keeps them for its backward's dgrad,
                unless they are gathered per use (distributed, Megatron-FSDP,
                FSDP2), saved-tensor hooks are active (checkpointing,
                offloading) or under ``torch.compile``, where dgrad quantizes
                them again. ``True``: quantized now and cached (the first
                micro-batch after an optimizer step). ``False``: the cached
                FP8 weights are reused, in forward and dgrad; with nothing
                cached, or a cache that no longer matches, they are quantized
                and cached without a word. A cached weight is dropped when a
                parameter is another object, or its ``data_ptr``, shape or
                version counter changed (in-place updates, ``torch.optim``).
                A write through ``.data`` (``p.data.copy_(...)``) changes none
                of these: after one, pass ``True``. ``DistributedWeight``
                groups are never cached. Not under ``torch.compile`` (a
                ``RuntimeError``; pass ``None`` there).

        Returns:
            ``(T, N)`` output in ``x``'s dtype, or in the autocast dtype under
            ``torch.autocast`` (like ``nn.Linear``).

        ``splits`` is copied now: backward and :meth:`backward_dw` use the
        copy, so the caller may refill its buffer at once.
        """
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != self.in_features:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"x has shape {shape}, expected (tokens, {self.in_features}) for in_features="
                f"{self.in_features}"
            )
        fp8 = fp8_for_forward(
            self.fp8_recipe,
            weight_cache(self, self._fp8_weights),
            is_first_microbatch,
            keep_weights=keeps_weights_for_backward(self),
        )
        weights, biases = self.current_parameters()
        out = apply_grouped_linear(
            x,
            splits,
            self.group_spec(checks_versions=checks_weight_versions(self)),
            self._forward_queue(),
            [*weights, *biases],
            len(biases),
            fp8,
        )
        return self._after_forward(out)
