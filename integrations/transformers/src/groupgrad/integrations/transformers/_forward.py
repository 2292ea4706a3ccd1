"""The ``"groupgrad"`` experts forward: route, sort by expert, grouped GEMMs, scatter back.

Legend: ``T`` tokens, ``k`` experts per token (top-k), ``S = T·k`` routed
slots, ``E`` experts, ``H`` hidden size, ``F`` expert width.

::

    slots s = t·k + j          token t's j-th choice: expert top_k_index[t, j]
    perm                       slots sorted by expert (stable)
    x_SH  = hidden[perm // k]  each slot's token row, grouped by expert
    y_SH  = experts(x_SH)      grouped_mlp (fused) or grouped_linear ∘ gate ∘ grouped_linear
    out_TH = Σ_j y[slot t·k + j] · top_k_weights[t, j]   (fp32 sum, one rounding)

The router weight multiplies each slot's expert output, as the model does.
Where the fused MLP is followed by nothing (no bias, no post-expert norm) the
three steps are one op, :func:`~groupgrad.modules.routed_grouped_mlp`: the
router weight scales the SwiGLU output inside it (the same value: fc2 is
linear and has no bias there), and it keeps no ``(S, H)`` tensor from forward
to backward — the peak memory of ``grouped_mm``'s chain or lower. Weight gradients go to autograd in each
parameter's ``grad_dtype`` straight from the GEMM epilogue (the module's own
packed parameters are passed to the grouped ops, not copies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn

from groupgrad.integrations.transformers._ep import (
    check_expert_parallel_layout,
    local_expert_weight,
)
from groupgrad.integrations.transformers._route import experts_route
from groupgrad.integrations.transformers._version import check_expert_parallel_support
from groupgrad.modules import grouped_linear, grouped_mlp, routed_grouped_mlp

__all__ = ["groupgrad_experts_forward", "groupgrad_fp8_experts_forward", "tokens_per_expert"]


def tokens_per_expert(sorted_ids_S: Tensor, num_experts: int) -> Tensor:
    """``(E,)`` token counts of expert ids sorted ascending, without a host sync on CUDA.

    CUDA uses ``histc`` on int32 (sync-free, graph-capturable, as transformers'
    ``grouped_mm`` does); other devices count exactly with ``bincount``.
    """
    if sorted_ids_S.device.type == "cuda":
        return torch.histc(sorted_ids_S.int(), bins=num_experts, min=0, max=num_experts - 1)
    return torch.bincount(sorted_ids_S, minlength=num_experts)


def _check_ids(top_k_index: Tensor, num_experts: int) -> None:
    """Expert ids run from 0 to ``num_experts``, the "no expert" slot; refuse any other.

    A negative id would drop its token from the counts; an id past
    ``num_experts`` makes transformers' eager loop raise. On the CPU the check
    names the offending id; on a GPU, and under ``torch.compile`` (which cannot
    read a tensor's value on the host in a full graph), it is an asynchronous
    device assertion (no host sync), which fails the next synchronizing call.
    """
    if top_k_index.numel() == 0:
        return
    if top_k_index.device.type == "cpu" and not torch.compiler.is_compiling():
        smallest, largest = int(top_k_index.min()), int(top_k_index.max())
        if smallest < 0:
            raise ValueError(
                f"top_k_index holds expert id {smallest}, expected ids >= 0 (an id below 0 "
                "would drop its token from every expert)"
            )
        if largest > num_experts:
            raise ValueError(
                f"top_k_index holds expert id {largest}, expected ids <= num_experts = "
                f"{num_experts} ({num_experts} itself is the slot for no expert)"
            )
    else:
        torch._assert_async(top_k_index.min() >= 0, "top_k_index holds a negative expert id")
        torch._assert_async(
            top_k_index.max() <= num_experts, "top_k_index holds an expert id past num_experts"
        )


def _tensor(experts: nn.Module, name: str) -> Tensor:
    """The experts module's tensor attribute ``name`` (a parameter), or a ``TypeError`` naming it."""
    value = getattr(experts, name, None)
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{type(experts).__name__}.{name} is {type(value).__name__}, expected a Tensor "
            "(the packed expert weights transformers' experts modules hold)"
        )
    return value


def _as_out_in(weight: Tensor, transposed: bool) -> Tensor:
    """``(E, out, in)`` as the grouped GEMMs take it (a contiguous copy of a transposed store)."""
    return weight.transpose(-2, -1).contiguous() if transposed else weight


def groupgrad_fp8_experts_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """:func:`groupgrad_experts_forward` with the GEMMs in FP8 (``fp8_recipe="blockwise"``).

    Registered as ``"groupgrad_fp8"``. The expert weights stay as they are
    (bf16); each GEMM quantizes its operands (1×128 activations, 128×128
    weights, 128-token blocks for the weight gradients) and the weight
    gradients still reach autograd in each parameter's ``grad_dtype``.
    Hidden size and expert width must be multiples of 128 (else a
    ``ValueError`` naming the size). The fused experts run
    :func:`~groupgrad.modules.grouped_mlp` between the gather and the combine
    (:func:`~groupgrad.modules.routed_grouped_mlp` has no FP8 yet).
    """
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, "blockwise")


def groupgrad_experts_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """Run a transformers experts module on groupgrad's grouped GEMMs.

    Registered as ``"groupgrad"`` in transformers' experts-implementation
    registry; ``model.set_experts_implementation("groupgrad")`` makes every
    ``@use_experts_implementation`` module of the model call it in place of
    its eager loop, with the same arguments and result.

    Args:
        self: The experts module (``Qwen3MoeExperts``, ``MixtralExperts``, ...):
            ``num_experts``, packed ``gate_up_proj`` ``(E, 2F, H)`` (or
            ``up_proj``) and ``down_proj`` ``(E, H, F)``, the flags
            described in :func:`experts_route`.
        hidden_states: ``(T, H)`` token rows.
        top_k_index: ``(T, k)`` int expert ids per token.
        top_k_weights: ``(T, k)`` router weight of each choice (any floating
            dtype; it receives a gradient in its dtype).

    Returns:
        ``(T, H)`` in ``hidden_states``' dtype: each token's router-weighted
        sum of its experts' outputs (summed in fp32, rounded once).

    Under transformers' expert parallelism (``_is_expert_parallel``) the
    module holds its local experts (local ids; ``num_experts`` is the
    sentinel of a route to another rank's expert) and its weights are the
    local shards of ``DTensor`` parameters, whose ``grad_dtype`` the weight
    gradients keep (``_ep``).

    Raises:
        RuntimeError: The module runs expert-parallel on a transformers
            release older than the first whose expert parallelism groupgrad
            supports (named in the message), or with FSDP sharding or
            replication beside it (``fsdp_size`` or ``dp_replicate_size`` above 1).
        ValueError: ``top_k_index`` and ``top_k_weights`` disagree in shape,
            ``hidden_states`` is not ``(T, H)`` with ``T`` their rows, or an
            expert id is negative or past ``num_experts`` (``num_experts``
            itself is the "no expert" slot: such a choice computes nothing,
            whatever its weight, as in transformers' eager loop).
        TypeError: ``top_k_index`` is not an integer tensor or
            ``top_k_weights`` not a floating one; a weight attribute of the
            module is not a tensor; ``hidden_states`` has another dtype than
            the expert weights outside ``torch.autocast``.
    """
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, None)


def _experts_forward(
    self: nn.Module,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    fp8_recipe: str | None,
) -> Tensor:
    if top_k_index.shape != top_k_weights.shape or top_k_index.dim() != 2:
        raise ValueError(
            f"top_k_index has shape {tuple(top_k_index.shape)} and top_k_weights "
            f"{tuple(top_k_weights.shape)}, expected one (tokens, top_k) shape"
        )
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index has dtype {top_k_index.dtype}, expected an integer dtype")
    if not top_k_weights.dtype.is_floating_point:
        raise TypeError(
            f"top_k_weights has dtype {top_k_weights.dtype}, expected a floating-point dtype"
        )
    tokens, top_k = top_k_index.shape
    if hidden_states.dim() != 2 or hidden_states.shape[0] != tokens:
        raise ValueError(
            f"hidden_states has shape {tuple(hidden_states.shape)}, expected ({tokens}, hidden) "
            "like top_k_index's rows"
        )
    route = experts_route(self)
    num_experts = int(cast(int, self.num_experts))
    _check_ids(top_k_index, num_experts)
    # id num_experts is the "no expert" slot (an expert-parallel sentinel): its rows sort last
    # and ride along with the last expert's GEMMs as zero rows (zero in FP8's blocks, finite in
    # fp16), zeroed again before the sum: they contribute nothing and receive no gradient
    sorted_ids_S, perm_S = torch.sort(top_k_index.reshape(-1), stable=True)
    splits_E = tokens_per_expert(sorted_ids_S.clamp(max=num_experts - 1), num_experts)
    has_gate = bool(getattr(self, "has_gate", True))
    has_bias = bool(getattr(self, "has_bias", False))
    up_name = "gate_up_proj" if has_gate else "up_proj"
    up, down = _tensor(self, up_name), _tensor(self, "down_proj")
    up_bias = _tensor(self, f"{up_name}_bias") if has_bias else None
    down_bias = _tensor(self, "down_proj_bias") if has_bias else None
    expert_parallel = bool(getattr(self, "_is_expert_parallel", False))
    if expert_parallel:  # local shards of DTensor parameters
        check_expert_parallel_support()
        check_expert_parallel_layout(self)
        up, down = local_expert_weight(up), local_expert_weight(down)
        up_bias = None if up_bias is None else local_expert_weight(up_bias)
        down_bias = None if down_bias is None else local_expert_weight(down_bias)
    if hidden_states.dtype != up.dtype and not torch.is_autocast_enabled(hidden_states.device.type):
        raise TypeError(
            f"hidden_states has dtype {hidden_states.dtype} but {type(self).__name__}.{up_name} "
            f"has dtype {up.dtype}; expected one dtype (or torch.autocast), as the eager "
            "experts require"
        )
    if fp8_recipe is not None:
        _check_fp8_sizes(self, hidden_states.shape[-1], down.shape[-2 if route.transposed else -1])
    if route.probs_in_mlp and fp8_recipe is None and not expert_parallel:  # one op: least memory
        # no router gives the "no expert" id outside expert parallelism; one given rides along
        # with the last expert at router weight 0 (its rows computed, not zeroed: README)
        weights_Tk = top_k_weights.masked_fill(top_k_index >= num_experts, 0)
        out_TH = routed_grouped_mlp(hidden_states, up, down, perm_S, splits_E, weights_Tk)
        return out_TH.to(hidden_states.dtype)
    x_SH = hidden_states[perm_S // top_k].masked_fill((sorted_ids_S == num_experts)[:, None], 0)
    probs_S = top_k_weights.reshape(-1)[perm_S]

    if route.probs_in_mlp:  # FP8: the router weight scales the SwiGLU output inside the MLP
        y_SH = grouped_mlp(x_SH, up, down, splits_E, probs_S, fp8_recipe=fp8_recipe)
    elif route.fused:
        y_SH = grouped_mlp(
            x_SH, up, down, splits_E, fc1_bias=up_bias, fc2_bias=down_bias, fp8_recipe=fp8_recipe
        )
    else:
        if route.transposed:
            _refuse_transposed_under_compile(self, up_name, up, down)
        up_w, down_w = _as_out_in(up, route.transposed), _as_out_in(down, route.transposed)
        h_SN = grouped_linear(x_SH, up_w, splits_E, up_bias, fp8_recipe=fp8_recipe)
        gate = cast(Callable[[Tensor], Tensor], self._apply_gate if has_gate else self.act_fn)
        a_SF = gate(h_SN)
        y_SH = grouped_linear(a_SF, down_w, splits_E, down_bias, fp8_recipe=fp8_recipe)
    if getattr(self, "has_post_expert_norm", False):
        y_SH = cast(Callable[[Tensor], Tensor], self.post_expert_norm)(y_SH)
    if not route.probs_in_mlp:
        y_SH = y_SH * probs_S.unsqueeze(-1)
    y_SH = torch.where((sorted_ids_S < num_experts).unsqueeze(-1), y_SH, 0)

    unsorted_SH = torch.empty_like(y_SH).index_copy(0, perm_S, y_SH)
    out_TH = unsorted_SH.view(tokens, top_k, y_SH.shape[-1]).sum(dim=1, dtype=torch.float32)
    return out_TH.to(hidden_states.dtype)


def _refuse_transposed_under_compile(module: nn.Module, up_name: str, *weights: Tensor) -> None:
    """Name the module where torch.compile traces transposed weights that get a gradient: the
    layers multiply a contiguous copy, and compiled, groupgrad hands gradients to ``.grad``
    itself, which a copy's gradient would never reach (the layers refuse it, by their names)."""
    if not (torch.compiler.is_compiling() and torch.is_grad_enabled()):
        return
    if any(w.requires_grad for w in weights):
        raise RuntimeError(
            f"{type(module).__name__}.{up_name} and .down_proj are stored transposed "
            "((E, in, out)): groupgrad's experts multiply a contiguous copy of them, whose "
            "gradient torch.compile cannot hand to the parameters. Compile without "
            "fullgraph=True (the experts then run eagerly at a graph break, exactly), or use "
            "the 'grouped_mm' experts implementation for this model"
        )


def _check_fp8_sizes(module: nn.Module, hidden: int, width: int) -> None:
    """Refuse a hidden size or expert width FP8's 128-wide blocks cannot tile, naming them."""
    sizes = (("hidden size", hidden), ("expert width", width))
    bad = [f"{name} {size}" for name, size in sizes if size % 128]
    if bad:
        raise ValueError(
            f"{type(module).__name__} has {' and '.join(bad)}; the experts implementation "
            f"'groupgrad_fp8' needs multiples of 128 (its FP8 blocks are 128 wide): use "
            "'groupgrad' for this model"
        )
