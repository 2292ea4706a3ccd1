"""Fused SwiGLU experts for Megatron's MoE layer: one groupgrad ``GroupedMLP`` for all local experts.

Legend: ``T`` tokens routed to this rank's experts, ``E`` local experts,
``H`` hidden size, ``F`` ``moe_ffn_hidden_size``.

Megatron's ``MoELayer`` calls its experts as
``experts(x_TH, tokens_per_expert, probs_T) -> (y_TH, None)`` and
``experts.backward_dw()``. :class:`GroupgradFusedExperts` runs fc1 → SwiGLU ×
router probability → fc2 as groupgrad's fused op (one autograd Function, one
backward, both wgrads through the ``main_grad`` contract), where Megatron's
``SequentialMLP`` runs one MLP per expert and ``TEGroupedMLP`` two grouped
GEMMs with Megatron's activation between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn

from groupgrad.integrations.megatron_core._checkpoint import (
    COLUMN_PARALLEL_AXES,
    ROW_PARALLEL_AXES,
    ExpertLayerEntries,
    drop_extra_state_copies,
    experts_sharded_state_dict,
)
from groupgrad.integrations.megatron_core._config import (
    check_expert_config,
    check_expert_groups,
    check_fused_config,
    check_offloading,
    check_spec_experts,
    process_groups,
)
from groupgrad.integrations.megatron_core._fp8 import (
    FUSED_FP8,
    fused_experts_fp8_recipe,
    runs_in_bf16,
)
from groupgrad.integrations.megatron_core._hooks import WgradHooks
from groupgrad.integrations.megatron_core._params import expert_device, setup_expert_parameters
from groupgrad.modules import GroupedMLP

__all__ = ["GroupgradFusedExperts"]

_FC1_PREFIX = "grouped_mlp.fc1."
_FC2_PREFIX = "grouped_mlp.fc2."


def _forward_pre_hooks(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Run ``module``'s own forward pre-hooks, as calling it would.

    The fused MLP stands in for the forwards of ``fc1`` and ``fc2``, which own
    the expert weights but are never called: Megatron's DDP, with
    ``overlap_param_gather``, waits in these hooks for the all-gather of the
    bucket holding a module's own parameters and starts the next bucket's.
    Without them the experts would read weights no all-gather refreshed.
    """
    for key, hook in tuple(module._forward_pre_hooks.items()):
        if key in module._forward_pre_hooks_with_kwargs:
            hook(module, args, {})
        else:
            hook(module, args)


class GroupgradFusedExperts(MegatronModule):
    """Megatron MoE experts as one fused groupgrad :class:`~groupgrad.modules.GroupedMLP`.

    Each local expert ``e`` computes, on its rows of the dispatched tokens,
    ``y = (silu(h[:, :F]) * h[:, F:] * probs[:, None]) @ fc2_e.T`` with
    ``h = x @ fc1_e.T`` — Megatron's SwiGLU experts with the router
    probability applied after the activation, the result of Megatron's
    ``SequentialMLP`` and ``TEGroupedMLP`` for the same weights. SwiGLU ×
    probability and both GEMMs' gradients come from one backward.

    Parameters live in the submodule ``grouped_mlp`` (``grouped_mlp.fc1.weight{e}``
    ``(2F, H)``, gate rows first, and ``grouped_mlp.fc2.weight{e}`` ``(H, F)``,
    in ``config.params_dtype``). Megatron's settings are honoured as by
    :class:`GroupgradGroupedLinear`: ``gradient_accumulation_fusion`` (wgrads
    straight into ``main_grad``), ``delay_wgrad_compute`` (both wgrads at
    :meth:`backward_dw`, then Megatron DDP's hooks), ``init_method`` /
    ``output_layer_init_method`` per expert, ``allreduce = False`` under
    expert parallelism. :meth:`sharded_state_dict` writes the checkpoint
    layout of ``SequentialMLP`` and ``TEGroupedMLP`` (interchangeable).

    FP8: ``config.fp8="e4m3"`` with ``config.fp8_recipe="blockwise"`` runs
    the ``GroupedMLP`` with ``fp8_recipe="blockwise"`` (``hidden_size`` and
    ``moe_ffn_hidden_size`` multiples of 128), except in the layers
    ``first_last_layers_bf16`` keeps in bf16 (:meth:`set_layer_number`).
    The FP8 weights are cached for one optimizer step the way Megatron
    drives Transformer Engine's modules: the attribute
    ``is_first_microbatch``, set ``True`` by Megatron's schedule
    (``MegatronModule.set_is_first_microbatch()`` at the first micro-batch of
    every ``forward_backward_func`` call), makes the next forward quantize
    and cache; the forward then sets it ``False`` and later micro-batches
    reuse the cache (``disable_parameter_transpose_cache``: never cached).

    Args:
        num_local_experts: ``E``.
        config: Megatron's ``TransformerConfig`` (``hidden_size``,
            ``moe_ffn_hidden_size``, ``params_dtype`` …).
        submodules: Accepted for Megatron's experts signature; must be ``None``.
        pg_collection: Megatron's process groups; default: its MoE defaults.
        name: Accepted for Megatron's signature (0.19 passes it); unused.

    Raises:
        ValueError: An unsupported setting, named with its value: anything
            but SwiGLU (``gated_linear_unit`` with ``F.silu``, no clamp, no GLU
            offset or interleaving), biases (Megatron scales fc2's bias by the
            router probability, the fused op does not), a latent projection,
            expert tensor parallelism, FP4, and any FP8 setting but
            ``fp8="e4m3"`` with ``fp8_recipe="blockwise"`` (``fp8="hybrid"``,
            other recipes, ``fp8_param``, ``fp8_wgrad=False``, 0.19's
            ``quant_recipe``).
    """

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        submodules: Any = None,
        pg_collection: Any = None,
        name: str | None = None,
    ) -> None:
        owner = type(self).__name__
        if submodules is not None:
            raise ValueError(
                f"{owner}: submodules is {submodules!r}, expected None (the fused experts build "
                "their own layers)"
            )
        check_expert_config(config, owner)
        fp8_recipe = fused_experts_fp8_recipe(config, owner)
        check_spec_experts(type(self), config, owner)
        check_fused_config(config, owner)
        check_offloading(config, owner, fused=True)
        super().__init__(config=config)
        pg_collection = process_groups(pg_collection)
        check_expert_groups(pg_collection, owner)
        self.num_local_experts = num_local_experts
        self.pg_collection = pg_collection
        self.grouped_mlp = GroupedMLP(
            num_local_experts,
            config.hidden_size,
            config.moe_ffn_hidden_size,
            dtype=config.params_dtype,
            device=expert_device(config),
            accumulate_into_main_grad=config.gradient_accumulation_fusion,
            delay_wgrad_compute=config.delay_wgrad_compute,
            fp8_recipe=fp8_recipe,
        )
        self.fp8_recipe = fp8_recipe
        self.layer_number: int | None = None
        self.is_first_microbatch = True  # Megatron's schedule sets it; see the class docstring
        for layer, init_method, partition_dim in (
            (self.grouped_mlp.fc1, config.init_method, 0),
            (self.grouped_mlp.fc2, config.output_layer_init_method, 1),
        ):
            weights, biases = layer.current_parameters()
            setup_expert_parameters(
                weights,
                biases,
                config=config,
                init_method=init_method,
                partition_dim=partition_dim,
            )
        self._wgrad_hooks = WgradHooks()
        self._register_load_state_dict_pre_hook(
            drop_extra_state_copies([_FC1_PREFIX, _FC2_PREFIX], keep_first=False), with_module=True
        )

    def _weights(self) -> list[Tensor]:
        return [
            *self.grouped_mlp.fc1.current_parameters()[0],
            *self.grouped_mlp.fc2.current_parameters()[0],
        ]

    def set_layer_number(self, layer_number: int) -> None:
        """Learn the transformer layer's global number (1-based): FP8 off where Megatron keeps bf16.

        Megatron calls ``set_layer_number`` on the MoE layer, which does not
        pass it on to its experts; ``GroupgradMoELayer`` (this package's specs
        with ``layer_numbers=True``) does. With ``first_last_layers_bf16`` the
        first ``num_layers_at_start_in_bf16`` and last
        ``num_layers_at_end_in_bf16`` layers run in the parameters' dtype.
        """
        self.layer_number = layer_number
        if self.fp8_recipe is None:
            return
        # the GroupedMLP's recipe, which it sets on fc1 and fc2 too
        self.grouped_mlp.fp8_recipe = (
            None if runs_in_bf16(self.config, layer_number) else self.fp8_recipe
        )

    def _cache_flag(self) -> bool | None:
        """The ``is_first_microbatch`` this forward passes to the ``GroupedMLP``; clears the attribute.

        Raises:
            RuntimeError: FP8 with ``first_last_layers_bf16`` but no layer
                number: whether this layer runs FP8 is unknown.
        """
        flag, self.is_first_microbatch = self.is_first_microbatch, False
        if self.fp8_recipe is None:
            return None
        if self.config.first_last_layers_bf16 and self.layer_number is None:
            raise RuntimeError(
                f"{type(self).__name__}: first_last_layers_bf16 is True with {FUSED_FP8} but "
                "the experts were never told their layer number; build the MoE layer with "
                "get_moe_module_groupgrad_spec(..., layer_numbers=True) or "
                "get_gpt_layer_groupgrad_spec(..., layer_numbers=True), whose MoE layer passes "
                "set_layer_number() on, or call experts.set_layer_number(layer_number)"
            )
        if getattr(self.config, "disable_parameter_transpose_cache", False):
            return None
        return bool(flag)

    def forward(
        self, permuted_local_hidden_states: Tensor, tokens_per_expert: Any, permuted_probs: Tensor
    ) -> tuple[Tensor, None]:
        """Run every local expert on its rows, scaled by the router probabilities.

        Args:
            permuted_local_hidden_states: ``(T, H)`` tokens grouped by local
                expert in order, in ``params_dtype``.
            tokens_per_expert: ``E`` token counts summing to ``T`` (a CPU or
                device tensor, or a list).
            permuted_probs: ``(T,)`` router probability of each row.

        Returns:
            ``(y, None)``: ``y`` ``(T, H)``; experts have no bias.
        """
        x_TH, probs_T = permuted_local_hidden_states, permuted_probs
        for owner in (self.grouped_mlp.fc1, self.grouped_mlp.fc2):
            _forward_pre_hooks(owner, (x_TH,))
        cache = self._cache_flag()
        if self.config.moe_apply_probs_on_input:  # Megatron's option: scale x, not the output
            if self.config.moe_router_topk != 1:
                raise ValueError(
                    f"moe_apply_probs_on_input needs moe_router_topk=1, got "
                    f"{self.config.moe_router_topk}"
                )
            x_TH = (probs_T.unsqueeze(-1) * x_TH).to(x_TH.dtype)
            return self.grouped_mlp(x_TH, tokens_per_expert, None, cache), None
        return self.grouped_mlp(x_TH, tokens_per_expert, probs_T, cache), None

    def backward_dw(self) -> None:
        """Run the deferred fc2 and fc1 weight-gradient GEMMs, then Megatron DDP's wgrad hooks.

        Only with ``config.delay_wgrad_compute``; a no-op otherwise.

        Raises:
            RuntimeError: No backward has queued a weight gradient, or the
                weights have ``main_grad`` but no DDP hook was registered
                (then nothing is written and the job stays queued).
        """
        if not self.grouped_mlp.delay_wgrad_compute:
            return
        self._wgrad_hooks.check(type(self).__name__, self._weights())  # before a GEMM writes
        self.grouped_mlp.backward_dw()
        self._wgrad_hooks.fire()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], object]) -> None:
        """Megatron DDP's entry point: ``hook`` runs after every :meth:`backward_dw`."""
        self._wgrad_hooks.register(hook)

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[Any, ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Megatron distributed-checkpoint entries in ``SequentialMLP``'s / ``TEGroupedMLP``'s layout.

        Checkpoint keys ``{prefix}experts.linear_fc1.weight`` (gate and up
        halves, each expert a slice along the expert axis) and
        ``{prefix}experts.linear_fc2.weight``, plus empty ``_extra_state``
        objects; state-dict keys are this module's own
        (``{prefix}grouped_mlp.fc1.weight{e}`` …).
        """
        fc1, fc2 = self.grouped_mlp.fc1, self.grouped_mlp.fc2
        layers = [
            ExpertLayerEntries(
                "linear_fc1", _FC1_PREFIX, *fc1.current_parameters(), COLUMN_PARALLEL_AXES
            ),
            ExpertLayerEntries(
                "linear_fc2", _FC2_PREFIX, *fc2.current_parameters(), ROW_PARALLEL_AXES
            ),
        ]
        return experts_sharded_state_dict(
            layers,
            gated=True,
            prefix=prefix,
            sharded_offsets=sharded_offsets,
            metadata=metadata,
            pg_collection=self.pg_collection,
        )
