"""Module specs that put groupgrad experts into Megatron-Core models, in Megatron's own style.

Megatron chooses an MoE layer's experts through a ``BackendSpecProvider``
(``LocalSpecProvider``: ``SequentialMLP``; ``TESpecProvider``:
``TEGroupedMLP`` on Transformer Engine's grouped linears).
:class:`GroupgradSpecProvider` is the local provider with groupgrad experts;
the helpers below build, from it and Megatron's own spec functions, the
experts entry, the MoE layer spec and a GPT transformer-layer spec — like
Megatron's ``get_moe_module_spec`` and ``get_gpt_layer_local_spec``.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.moe.moe_layer import MoELayer

from groupgrad.integrations.megatron_core._compat import (
    TEGroupedMLP,
    experts_entry,
    grouped_mlp_submodules,
    provider_experts_entry,
    with_moe_layer,
)
from groupgrad.integrations.megatron_core._config import SPEC_NUM_EXPERTS
from groupgrad.integrations.megatron_core._experts import GroupgradFusedExperts
from groupgrad.integrations.megatron_core._linear import (
    GroupgradColumnParallelGroupedLinear,
    GroupgradRowParallelGroupedLinear,
)

__all__ = [
    "GroupgradMoELayer",
    "GroupgradSpecProvider",
    "get_gpt_layer_groupgrad_spec",
    "get_groupgrad_experts_spec",
    "get_moe_module_groupgrad_spec",
]


class GroupgradMoELayer(MoELayer):
    """Megatron's ``MoELayer`` that passes its layer number on to its experts.

    Megatron's ``TransformerLayer`` calls ``mlp.set_layer_number()``; the
    MoE layer gives it to its router only. The fused experts need it for
    ``first_last_layers_bf16`` (FP8 off in those layers).
    """

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's ``set_layer_number``, then the experts' (when they have one)."""
        super().set_layer_number(layer_number)
        set_experts_layer = getattr(self.experts, "set_layer_number", None)
        if set_experts_layer is not None:
            set_experts_layer(layer_number)


def _experts_class_and_submodules(fused: bool, num_experts: int | None = None) -> tuple[type, Any]:
    """The experts class (and submodules) of a spec; bound to ``num_experts`` when given.

    A bound class checks, when Megatron builds it, that ``config.num_moe_experts``
    is the spec's number (``_config.check_spec_experts``).
    """
    if not isinstance(fused, bool):
        raise TypeError(f"fused is a {type(fused).__name__}, expected a bool")
    if fused:
        return _bound(GroupgradFusedExperts, num_experts), None
    return TEGroupedMLP, grouped_mlp_submodules(
        _bound(GroupgradColumnParallelGroupedLinear, num_experts),
        _bound(GroupgradRowParallelGroupedLinear, num_experts),
    )


def _bound(cls: type, num_experts: int | None) -> type:
    """``cls``, or a subclass of the same name that knows the spec's ``num_experts``."""
    if num_experts is None:
        return cls
    attrs = {SPEC_NUM_EXPERTS: num_experts, "__module__": cls.__module__}
    return type(cls.__name__, (cls,), {**attrs, "__qualname__": cls.__qualname__})


def get_groupgrad_experts_spec(fused: bool = True) -> Any:
    """The experts entry of Megatron's ``MoESubmodules`` for groupgrad experts.

    Args:
        fused: ``True``: :class:`GroupgradFusedExperts` (fc1 → SwiGLU × router
            probability → fc2 as one fused op; SwiGLU without biases only).
            ``False``: Megatron's own grouped-experts layer ``TEGroupedMLP``
            with :class:`GroupgradColumnParallelGroupedLinear` /
            :class:`GroupgradRowParallelGroupedLinear` in its fc1 / fc2 slots
            (any activation Megatron's layer supports, biases; it needs no
            Transformer Engine).

    Returns:
        A ``ModuleSpec`` on megatron-core 0.16, an experts builder on 0.19
        (what each release's ``MoESubmodules.experts`` takes).
    """
    return experts_entry(*_experts_class_and_submodules(fused))


class GroupgradSpecProvider(LocalSpecProvider):
    """Megatron's local backend (``LocalSpecProvider``) with groupgrad MoE experts.

    Everything but the experts is Megatron-Core's own local modules; pass it
    to Megatron's ``get_moe_module_spec_for_backend`` or any spec builder
    that takes a backend.

    Args:
        fused: Which groupgrad experts (see :func:`get_groupgrad_experts_spec`).
        num_experts: The model's ``num_moe_experts``, if known: the experts
            then check it against the config they are built with (another
            number raises ``ValueError``).
    """

    def __init__(self, fused: bool = True, num_experts: int | None = None) -> None:
        super().__init__()
        if num_experts is not None:
            _check_num_experts(num_experts)
        self.entry = _experts_class_and_submodules(fused, num_experts)
        self.fused = fused

    def grouped_mlp_modules(  # one signature serves 0.16 (two flags) and 0.19 (one)
        self, moe_use_grouped_gemm: bool = True, moe_use_legacy_grouped_gemm: bool = False
    ) -> Any:
        """The experts for Megatron's spec builders: groupgrad's, whatever the flags say.

        Returns:
            ``(module, submodules)`` on megatron-core 0.16, the experts
            builder on 0.19.
        """
        return provider_experts_entry(*self.entry)


def _check_num_experts(num_experts: object) -> int:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts is {num_experts!r}, expected a positive int")
    return num_experts


def get_moe_module_groupgrad_spec(
    num_experts: int, *, fused: bool = True, layer_numbers: bool = False
) -> Any:
    """Megatron's MoE layer spec (``MoELayer``, router, shared experts) with groupgrad experts.

    Built by Megatron's ``get_moe_module_spec_for_backend`` with a
    :class:`GroupgradSpecProvider`, on Megatron's own ``MoELayer`` — or, with
    ``layer_numbers=True``, on :class:`GroupgradMoELayer`, which tells the
    experts their layer number: FP8 with ``first_last_layers_bf16`` needs it.
    On megatron-core 0.16 ``TransformerLayer`` hands its ``pg_collection``
    only to Megatron's exact ``MoELayer`` class, so a ``GroupgradMoELayer``
    runs on Megatron's global process groups (a warning says "Unknown MLP
    type"): leave ``layer_numbers`` off where a model is built with other
    process groups.

    Args:
        num_experts: The model's number of experts (``num_moe_experts``);
            building the layer from a config with another number raises.
        fused: Which groupgrad experts (see :func:`get_groupgrad_experts_spec`).
        layer_numbers: Build the layer as :class:`GroupgradMoELayer`.

    Returns:
        What a transformer layer's ``mlp`` takes: a ``ModuleSpec`` on
        megatron-core 0.16, an MoE-layer builder on 0.19.
    """
    spec = get_moe_module_spec_for_backend(
        backend=GroupgradSpecProvider(fused=fused, num_experts=_check_num_experts(num_experts)),
        num_experts=num_experts,
        moe_grouped_gemm=True,
    )
    return with_moe_layer(spec, GroupgradMoELayer) if layer_numbers else spec


def get_gpt_layer_groupgrad_spec(
    num_experts: int,
    *,
    fused: bool = True,
    qk_layernorm: bool = False,
    normalization: str | None = None,
    layer_numbers: bool = False,
) -> Any:
    """A GPT transformer-layer spec of Megatron-Core's local modules with groupgrad MoE experts.

    Megatron's ``get_gpt_layer_local_spec`` (attention, norms, residuals on
    Megatron-Core modules, no Transformer Engine) whose MLP is
    :func:`get_moe_module_groupgrad_spec`. Pass it as ``transformer_layer_spec``
    to ``GPTModel``.

    Args:
        num_experts: The model's number of experts (``num_moe_experts``).
        fused: Which groupgrad experts (see :func:`get_groupgrad_experts_spec`).
        qk_layernorm: As in ``get_gpt_layer_local_spec``.
        normalization: As in ``get_gpt_layer_local_spec`` (``"RMSNorm"`` or
            ``None`` for LayerNorm).
        layer_numbers: The MoE layer as :class:`GroupgradMoELayer` (FP8 with
            ``first_last_layers_bf16``; see :func:`get_moe_module_groupgrad_spec`).

    Returns:
        A ``ModuleSpec`` of Megatron's ``TransformerLayer``.
    """
    spec = get_gpt_layer_local_spec(
        num_experts=_check_num_experts(num_experts),
        moe_grouped_gemm=False,
        qk_layernorm=qk_layernorm,
        normalization=normalization,
    )
    spec.submodules.mlp = get_moe_module_groupgrad_spec(
        num_experts, fused=fused, layer_numbers=layer_numbers
    )
    return spec
