"""groupgrad grouped linears in the fc1 / fc2 slots of Megatron's grouped-experts layer.

Legend: ``T`` routed tokens of this rank, ``E`` local experts, ``K``
in_features, ``N`` out_features.

Megatron's ``TEGroupedMLP`` builds its two layers from builders with
Transformer Engine's grouped-linear signature and calls them as
``layer(x_TK, tokens_per_expert) -> (y_TN, bias)`` and ``layer.backward_dw()``.
:class:`GroupgradColumnParallelGroupedLinear` (fc1) and
:class:`GroupgradRowParallelGroupedLinear` (fc2) are
:class:`groupgrad.modules.GroupedLinear` layers with that interface, the
parameter names of Transformer Engine's layer (``weight0 …``, ``bias0 …``)
and its checkpoint entries, so ``TEGroupedMLP`` runs, saves and loads them as
it does its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from groupgrad.integrations.megatron_core._checkpoint import (
    COLUMN_PARALLEL_AXES,
    ROW_PARALLEL_AXES,
    drop_extra_state_copies,
    grouped_sharded_state_dict,
)
from groupgrad.integrations.megatron_core._config import (
    check_expert_config,
    check_expert_groups,
    check_offloading,
    check_spec_experts,
    check_unfused_recompute,
    process_groups,
)
from groupgrad.integrations.megatron_core._fp8 import refuse_unfused_fp8
from groupgrad.integrations.megatron_core._hooks import WgradHooks
from groupgrad.integrations.megatron_core._params import expert_device, setup_expert_parameters
from groupgrad.modules import GroupedLinear

__all__ = [
    "GroupgradColumnParallelGroupedLinear",
    "GroupgradGroupedLinear",
    "GroupgradRowParallelGroupedLinear",
]


class GroupgradGroupedLinear(GroupedLinear):
    """A :class:`~groupgrad.modules.GroupedLinear` with Megatron's grouped-linear interface.

    Built by Megatron's experts layer with the same arguments as Transformer
    Engine's ``TEGroupedLinear``; use :class:`GroupgradColumnParallelGroupedLinear`
    (fc1) or :class:`GroupgradRowParallelGroupedLinear` (fc2). Parameters:
    ``weight0 … weight{E-1}`` of shape ``(N, K)`` in ``config.params_dtype``
    and, with ``bias``, ``bias0 …`` ``(N,)``.

    What it takes from Megatron's ``config``:

    * ``gradient_accumulation_fusion``: the wgrad GEMM writes each expert's
      weight gradient straight into its ``main_grad`` (Megatron DDP's fp32
      buffer), sets ``grad_added_to_main_grad`` and gives autograd a zero
      dummy (``accumulate_into_main_grad=True`` of the groupgrad layer);
      otherwise the gradient goes to autograd and Megatron's DDP hook adds it.
    * ``delay_wgrad_compute``: backward computes dgrad (and bias gradients);
      :meth:`backward_dw` runs the wgrad GEMM and then the hooks Megatron's
      DDP registered through :meth:`register_wgrad_accumulation_and_reduce_hooks`.
    * ``init_method`` (the argument): applied to every expert's weight on its
      own, as Megatron's own expert linears do — on an fp32 master copy with
      ``use_cpu_initialization``, else under the expert-parallel RNG tracker —
      when ``perform_initialization``; biases are zeroed; ``params_dtype``.
    * ``expert_model_parallel_size > 1``: every parameter gets
      ``allreduce = False`` (Megatron's expert data-parallel buffers).

    Args:
        num_gemms: ``E``, the number of local experts.
        input_size: ``K``.
        output_size: ``N``.
        parallel_mode: ``"column"`` (fc1) or ``"row"`` (fc2): the
            checkpoint layout and the tensor-parallel labels of the weights;
            ``None`` takes the class's ``default_parallel_mode`` (set by the
            column and row subclasses).
        config: Megatron's ``TransformerConfig``.
        init_method: Initializes one expert's ``(N, K)`` weight in place.
        bias: Whether each expert has a bias.
        skip_bias_add: Return the biases (a list of ``E`` ``(N,)`` tensors)
            for the caller to add instead of adding them (Megatron's fc2,
            whose bias the experts layer scales by the router probability).
        is_expert: Must be ``True``.
        tp_comm_buffer_name: Accepted for Megatron's signature; unused.
        pg_collection: Megatron's process groups (``ep``, ``expt_tp``,
            ``expt_dp``); default: Megatron's MoE defaults.
        name: Accepted for Megatron's signature (0.19 passes it); unused.

    Raises:
        ValueError: ``is_expert`` is not ``True``, ``parallel_mode`` is not
            ``"column"``/``"row"``, or an unsupported setting (expert tensor
            parallelism, FP4, FP8: the fused experts are groupgrad's FP8
            route), each named with its value.
    """

    default_parallel_mode: str | None = None

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None = None,
        config: Any,
        init_method: Callable[[Tensor], Any],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = True,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any = None,
        name: str | None = None,
    ) -> None:
        owner = type(self).__name__
        if parallel_mode is None:
            parallel_mode = self.default_parallel_mode
        if is_expert is not True:
            raise ValueError(
                f"{owner}: is_expert is {is_expert!r}, expected True (groupgrad grouped linears "
                "hold MoE experts only)"
            )
        if parallel_mode not in ("column", "row"):
            raise ValueError(
                f"{owner}: parallel_mode is {parallel_mode!r}, expected 'column' or 'row'"
            )
        check_expert_config(config, owner)
        refuse_unfused_fp8(config, owner)
        check_unfused_recompute(config, owner)
        check_offloading(config, owner, fused=False)
        check_spec_experts(type(self), config, owner)
        pg_collection = process_groups(pg_collection)
        check_expert_groups(pg_collection, owner)
        add_bias_here = bias and not skip_bias_add
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            bias=add_bias_here,
            dtype=config.params_dtype,
            device=expert_device(config),
            accumulate_into_main_grad=config.gradient_accumulation_fusion,
            delay_wgrad_compute=config.delay_wgrad_compute,
        )
        self.config = config
        self.parallel_mode = parallel_mode
        self.skip_bias_add = skip_bias_add
        self.pg_collection = pg_collection
        self.returned_bias_names: tuple[str, ...] = ()
        if bias and skip_bias_add:  # kept here, returned by forward, never added by the GEMM op
            factory: dict[str, Any] = {
                "dtype": config.params_dtype,
                "device": expert_device(config),
            }
            for e in range(num_gemms):
                self.register_parameter(
                    f"bias{e}", nn.Parameter(torch.empty(output_size, **factory))
                )
            self.returned_bias_names = tuple(f"bias{e}" for e in range(num_gemms))
        weights, biases = self._all_parameters()
        setup_expert_parameters(
            weights,
            biases,
            config=config,
            init_method=init_method,
            partition_dim=0 if parallel_mode == "column" else 1,
        )
        self._wgrad_hooks = WgradHooks()
        self._register_load_state_dict_pre_hook(
            drop_extra_state_copies([""], keep_first=True), with_module=True
        )

    def _all_parameters(self) -> tuple[list[Tensor], list[Tensor]]:
        weights, biases = self.current_parameters()
        returned = [getattr(self, name) for name in self.returned_bias_names]
        return weights, [*biases, *returned]

    def forward(  # type: ignore[override]  # Megatron's grouped-linear interface returns (y, bias)
        self, x: Tensor, m_splits: Any
    ) -> tuple[Tensor, list[Tensor] | None]:
        """Apply every expert to its rows.

        Args:
            x: ``(T, K)`` rows grouped by expert in order.
            m_splits: ``E`` token counts summing to ``T`` (Megatron passes a
                list of ints; a CPU or device tensor works too).

        Returns:
            ``(y, None)`` with ``y`` ``(T, N)``; with ``skip_bias_add`` and
            biases, ``(y, [bias0, …])`` with the biases not added.
        """
        y = super().forward(x, m_splits)
        if self.returned_bias_names:
            return y, [getattr(self, name) for name in self.returned_bias_names]
        return y, None

    def backward_dw(self) -> None:
        """Run the deferred weight-gradient GEMMs, then Megatron DDP's wgrad hooks.

        Only with ``config.delay_wgrad_compute``; a no-op otherwise. Megatron
        calls it once per backward (its delayed-wgrad schedule, or
        ``MoELayer.backward_dw()``).

        Raises:
            RuntimeError: No backward has queued a weight gradient, or the
                weights have ``main_grad`` but no DDP hook was registered
                (then nothing is written and the job stays queued).
        """
        if not self.delay_wgrad_compute:
            return
        weights, _ = self.current_parameters()
        self._wgrad_hooks.check(type(self).__name__, weights)  # before a GEMM writes
        super().backward_dw()
        self._wgrad_hooks.fire()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], object]) -> None:
        """Megatron DDP's entry point: ``hook`` runs after every :meth:`backward_dw`."""
        self._wgrad_hooks.register(hook)

    def get_extra_state(self) -> None:
        """No extra state (Megatron's own linears return ``None`` too, for TE compatibility)."""

    def set_extra_state(self, state: Any) -> None:
        """Ignore a loaded extra state (Transformer Engine's FP8 metadata has no use here)."""

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[Any, ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Megatron distributed-checkpoint entries, as Transformer Engine's grouped linear writes them.

        Keys ``{prefix}weight{e}`` (and ``bias{e}``, ``_extra_state{e}``);
        each a slice of the global ``{prefix}weight`` along the expert axis.
        Megatron's experts layer splits fc1 into gate and up halves and puts
        the keys under ``experts.``, so the checkpoint interchanges with
        ``SequentialMLP``'s and ``TEGroupedMLP``'s.
        """
        weights, biases = self._all_parameters()
        return grouped_sharded_state_dict(
            weights,
            biases,
            key_prefix=prefix,
            dict_prefix=prefix,
            tp_axes=COLUMN_PARALLEL_AXES if self.parallel_mode == "column" else ROW_PARALLEL_AXES,
            sharded_offsets=sharded_offsets,
            metadata=metadata,
            pg_collection=self.pg_collection,
        )


class GroupgradColumnParallelGroupedLinear(GroupgradGroupedLinear):
    """fc1 of Megatron's grouped-experts layer on groupgrad (``TEColumnParallelGroupedLinear``'s slot).

    The arguments of :class:`GroupgradGroupedLinear`, with ``parallel_mode``
    ``"column"`` by default: the weights' tensor-parallel axis is 0 and fc1's
    bias is split with them in the checkpoint layout.
    """

    default_parallel_mode = "column"


class GroupgradRowParallelGroupedLinear(GroupgradGroupedLinear):
    """fc2 of Megatron's grouped-experts layer on groupgrad (``TERowParallelGroupedLinear``'s slot).

    The arguments of :class:`GroupgradGroupedLinear`, with ``parallel_mode``
    ``"row"`` by default: the weights' tensor-parallel axis is 1 and the bias
    is not split in the checkpoint layout.
    """

    default_parallel_mode = "row"
