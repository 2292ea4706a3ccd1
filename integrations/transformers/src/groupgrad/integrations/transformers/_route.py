"""How one transformers experts module maps onto groupgrad's grouped ops.

transformers' ``@use_experts_implementation`` modules hold their experts as
packed parameters and describe them with flags (set by the decorator):

=====================  ====================================================
``has_gate``           ``gate_up_proj`` ``(E, 2F, H)`` (else ``up_proj``
                       ``(E, F, H)``) and ``down_proj`` ``(E, H, F)``
``is_concatenated``    gate rows ``[0, F)`` then up rows ``[F, 2F)`` (else
                       interleaved ``g0, u0, g1, u1, …``)
``is_transposed``      weights stored ``(E, in, out)`` instead of
                       ``(E, out, in)``
``has_bias``           ``gate_up_proj_bias`` ``(E, 2F)``, ``down_proj_bias``
                       ``(E, H)``
``has_post_expert_norm``  (5.24) a norm after ``down_proj``
=====================  ====================================================

groupgrad's fused MLP takes exactly the concatenated, non-transposed gated
layout (fc1 ``(E, 2F, H)`` gate rows first, fc2 ``(E, H, F)``) with
``silu(gate) * up``; anything else runs as two grouped linears around the
model's own gate or activation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from transformers import activations
from transformers.integrations import moe

__all__ = ["ExpertsRoute", "dispatches", "experts_route"]


def _silu_types() -> tuple[type[nn.Module], ...]:
    found: list[type[nn.Module]] = [nn.SiLU]
    for key in ("silu", "swish"):
        entry = activations.ACT2CLS.get(key)
        cls = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


SILU_TYPES = _silu_types()


@dataclass(frozen=True)
class ExpertsRoute:
    """How :func:`~groupgrad.integrations.transformers.groupgrad_experts_forward` runs a module.

    Attributes:
        fused: One fused :func:`~groupgrad.modules.grouped_mlp` on the
            module's own ``gate_up_proj`` / ``down_proj`` parameters (else two
            :func:`~groupgrad.modules.grouped_linear` around the model's gate
            or activation).
        probs_in_mlp: The router weights scale the SwiGLU output inside the
            fused MLP (equal to scaling the expert output, as the model does,
            when nothing non-linear or additive follows ``down_proj``); else
            the expert output is scaled after ``down_proj`` (and its bias and
            post-expert norm), as the model does.
        transposed: Weights are stored ``(E, in, out)`` and transposed to a
            contiguous copy each forward; their gradient then flows back
            through the copy in the compute dtype, so a ``grad_dtype`` wider
            than the weights does not reach the GEMM.
        reason: Why the fused MLP is not used (empty when it is), or why
            transformers does not call groupgrad for the module at all.
        dispatched: Whether transformers calls the experts implementation
            for this module: only a class decorated with
            ``@use_experts_implementation`` dispatches (JetMoE's and
            Llama-4's experts do not; ``set_experts_implementation`` leaves
            them on their own forward).
    """

    fused: bool
    probs_in_mlp: bool
    transposed: bool
    reason: str = ""
    dispatched: bool = True


def _uses_default_gate(experts: nn.Module) -> bool:
    """Whether the module gates with transformers' default ``act(gate) * up`` on concatenated halves."""
    default = getattr(moe, "_default_apply_gate", None)
    return default is not None and getattr(type(experts), "_apply_gate", None) is default


def dispatches(experts: nn.Module) -> bool:
    """Whether transformers dispatches ``experts`` to the chosen experts implementation.

    True for a class whose ``forward`` is the wrapper transformers'
    ``@use_experts_implementation`` installs.
    """
    forward = getattr(type(experts), "forward", None)
    code = getattr(forward, "__code__", None)
    return (
        getattr(forward, "__wrapped__", None) is not None
        and code is not None
        and code.co_filename == moe.__file__
    )


def experts_route(experts: nn.Module) -> ExpertsRoute:
    """Decide how groupgrad runs a transformers experts module (reads its flags, changes nothing).

    Args:
        experts: A module decorated with transformers'
            ``@use_experts_implementation`` (e.g. ``Qwen3MoeExperts``,
            ``MixtralExperts``).

    Returns:
        The route. Qwen3-MoE, Mixtral and the other concatenated SwiGLU
        models without bias take the fused MLP with the router weights inside;
        a module transformers does not dispatch says so
        (``dispatched=False``, with the reason).
    """
    if not dispatches(experts):
        return ExpertsRoute(
            fused=False,
            probs_in_mlp=False,
            transposed=False,
            reason=(
                f"{type(experts).__name__} is not decorated with transformers' "
                "@use_experts_implementation, so transformers never calls the groupgrad "
                "implementation for it: it runs its own forward"
            ),
            dispatched=False,
        )
    has_gate = bool(getattr(experts, "has_gate", True))
    transposed = bool(getattr(experts, "is_transposed", False))
    reasons = []
    if not has_gate:
        reasons.append("the experts have no gate (has_gate=False)")
    if not getattr(experts, "is_concatenated", True):
        reasons.append("gate and up rows are interleaved (is_concatenated=False)")
    if transposed:
        reasons.append("the weights are stored transposed (is_transposed=True)")
    if has_gate and not _uses_default_gate(experts):
        reasons.append(f"{type(experts).__name__} has its own _apply_gate")
    elif has_gate and not isinstance(getattr(experts, "act_fn", None), SILU_TYPES):
        act = type(getattr(experts, "act_fn", None)).__name__
        reasons.append(f"the gate's activation is {act}, not SiLU")
    fused = not reasons
    after_down = bool(getattr(experts, "has_bias", False)) or bool(
        getattr(experts, "has_post_expert_norm", False)
    )
    return ExpertsRoute(
        fused=fused,
        probs_in_mlp=fused and not after_down,
        transposed=transposed,
        reason="; ".join(reasons),
    )
