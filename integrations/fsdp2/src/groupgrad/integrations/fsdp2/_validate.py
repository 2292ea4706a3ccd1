"""What the FSDP2 integration supports, checked when a unit is sharded (never at step 1).

Every check raises at the API boundary with a message that names the module or
parameter, its value and what was expected. A *unit* is what one
``fully_shard`` call manages: the parameters of the given module(s), minus
those of submodules that are FSDP units of their own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from groupgrad.modules import GroupedLinear, GroupedMLP
from groupgrad.protocol import MAIN_GRAD_DTYPES, is_distributed_weight

__all__ = [
    "UNIT_MARK",
    "LayerFlags",
    "check_grad_dtype_support",
    "check_layer_flags",
    "check_layers",
    "check_modules",
    "check_nested_units",
    "check_plain_parameters",
    "check_reduce_dtype",
    "check_uniform_dtype",
    "compute_dtype",
    "groupgrad_layers",
    "mp_policy_of",
    "unit_members",
]

UNIT_MARK = "_groupgrad_fsdp2_reduce_dtype"
"""Attribute set on every module sharded by this integration (its reduce dtype, or ``None``)."""

GROUPGRAD_LAYERS = (GroupedLinear, GroupedMLP)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def check_grad_dtype_support() -> None:
    """Raise ``RuntimeError`` when this PyTorch has no ``Tensor.grad_dtype`` (added in 2.10)."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        raise RuntimeError(
            f"groupgrad.integrations.fsdp2 needs torch.Tensor.grad_dtype, which torch "
            f"{torch.__version__} lacks; expected PyTorch 2.10 or newer"
        )


def check_modules(module: object) -> list[nn.Module]:
    """The module(s) of one ``fully_shard`` call as a list (FSDP2 takes one or a list).

    Raises:
        TypeError: ``module`` is neither an ``nn.Module`` nor a non-empty list of them.
        ValueError: A module is an FSDP unit already.
    """
    modules: list[object] = list(module) if isinstance(module, list) else [module]
    if not modules:
        raise TypeError("module is an empty list, expected an nn.Module or a list of them")
    for index, sub in enumerate(modules):
        label = "module" if not isinstance(module, list) else f"module[{index}]"
        if not isinstance(sub, nn.Module):
            raise TypeError(f"{label} is a {type(sub).__name__}, expected an nn.Module")
        if isinstance(sub, FSDPModule):
            raise ValueError(
                f"{label} ({type(sub).__name__}) is an FSDP unit already; call fully_shard "
                "once per module"
            )
    return [sub for sub in modules if isinstance(sub, nn.Module)]


def mp_policy_of(fsdp_kwargs: Mapping[str, Any]) -> MixedPrecisionPolicy:
    """The ``mp_policy`` FSDP2 will use: the one given, else FSDP2's default (no casting).

    Raises:
        TypeError: ``mp_policy`` is not a ``MixedPrecisionPolicy``.
    """
    policy = fsdp_kwargs.get("mp_policy", MixedPrecisionPolicy())
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy is a {type(policy).__name__}, expected a "
            "torch.distributed.fsdp.MixedPrecisionPolicy"
        )
    return policy


def check_plain_parameters(fsdp_kwargs: Mapping[str, Any]) -> None:
    """Reject ``dp_mesh_dims``: FSDP2 over ``DTensor`` parameters (its SPMD mesh mode).

    There the unsharded parameters are ``DTensor`` s, which the grouped GEMMs
    do not take and whose ``grad_dtype`` does not reach the local gradient.

    Raises:
        ValueError: ``dp_mesh_dims`` is given (not ``None``).
    """
    dims = fsdp_kwargs.get("dp_mesh_dims")
    if dims is not None:
        raise ValueError(
            f"dp_mesh_dims is {dims!r}, expected None: FSDP2 over DTensor parameters (an SPMD "
            "mesh) is not supported by groupgrad.integrations.fsdp2, whose grouped GEMMs take "
            "plain tensors; pass a data-parallel mesh (1-D, or 2-D for HSDP) instead"
        )


def unit_members(modules: Sequence[nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every module of the unit, FSDP sub-units excluded.

    Names are relative to the given module (``""`` for itself; prefixed
    ``[i]`` for a list of several). A submodule that is an FSDP unit already
    is not entered.
    """
    for index, root in enumerate(modules):
        stack: list[tuple[str, nn.Module]] = [(f"[{index}]" if len(modules) > 1 else "", root)]
        while stack:
            name, sub = stack.pop()
            yield name, sub
            for child_name, child in reversed(list(sub.named_children())):
                if not isinstance(child, FSDPModule):
                    stack.append((_join(name, child_name), child))


def _sub_units(modules: Sequence[nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """FSDP units directly below the unit (the children ``unit_members`` does not enter)."""
    for name, sub in unit_members(modules):
        for child_name, child in sub.named_children():
            if isinstance(child, FSDPModule):
                yield _join(name, child_name), child


def runs_on_groupgrad(module: nn.Module) -> bool:
    """Whether ``module`` is a groupgrad layer, or a Hugging Face experts module whose model
    runs its experts on groupgrad (transformers' experts interface: ``"groupgrad"``,
    ``"groupgrad_fp8"``; read off the module, transformers not imported)."""
    if isinstance(module, GROUPGRAD_LAYERS):
        return True
    chosen = getattr(getattr(module, "config", None), "_experts_implementation", None)
    experts = hasattr(module, "is_concatenated")  # set by @use_experts_implementation
    return experts and isinstance(chosen, str) and chosen.startswith("groupgrad")


def check_nested_units(modules: Sequence[nn.Module]) -> None:
    """Reject a sub-unit that holds groupgrad layers (:func:`runs_on_groupgrad`) but was
    sharded by plain FSDP2.

    Its weight gradients would reach FSDP2 in the compute dtype (bf16) and be
    upcast only for the reduce-scatter: the rounding this integration removes.

    Raises:
        ValueError: Such a sub-unit exists.
    """
    for name, unit in _sub_units(modules):
        if hasattr(unit, UNIT_MARK):
            continue
        layers = [n for n, m in unit.named_modules() if runs_on_groupgrad(m)]
        if layers:
            raise ValueError(
                f"submodule {name!r} holds groupgrad layers ({', '.join(repr(n) for n in layers)}) "
                "but was sharded by torch.distributed.fsdp.fully_shard directly, so their weight "
                "gradients would reach its reduce-scatter rounded to the compute dtype; shard it "
                "with groupgrad.integrations.fsdp2.fully_shard"
            )


def check_layer_flags(layer: GroupedLinear | GroupedMLP, label: str) -> None:
    """Reject the flags of a groupgrad layer FSDP2 cannot serve (at setup, and at each forward
    of its unit: :class:`LayerFlags`, since a flag may be switched on later).

    Raises:
        ValueError: ``accumulate_into_main_grad`` or ``delay_wgrad_compute`` is on.
    """
    kind = type(layer).__name__
    if layer.accumulate_into_main_grad:
        raise ValueError(
            f"{kind} {label!r} has accumulate_into_main_grad=True, expected False under "
            "FSDP2: FSDP2 reduce-scatters .grad and gives its unsharded parameters no "
            "main_grad; the weight gradient reaches .grad in mp_policy.reduce_dtype straight "
            "from the GEMM without it"
        )
    if layer.delay_wgrad_compute:
        raise ValueError(
            f"{kind} {label!r} has delay_wgrad_compute=True, expected False under FSDP2: "
            "FSDP2 reduce-scatters a unit's gradients when its backward ends, before "
            "backward_dw() could write the weight gradients"
        )


class LayerFlags:
    """Forward pre-hook of an FSDP2 unit: :func:`check_layer_flags` on its groupgrad layers
    again (a flag switched on after ``fully_shard`` would lose or misroute the gradient).

    Args:
        layers: ``(label, layer)`` of the unit's groupgrad layers.
    """

    def __init__(self, layers: Sequence[tuple[str, GroupedLinear | GroupedMLP]]) -> None:
        self.layers = list(layers)

    @torch.compiler.disable  # runs outside a compiled unit's graph (see _shard)
    def __call__(self, module: nn.Module, args: Any) -> None:
        for label, layer in self.layers:
            check_layer_flags(layer, label)


def groupgrad_layers(modules: Sequence[nn.Module]) -> list[tuple[str, GroupedLinear | GroupedMLP]]:
    """``(label, layer)`` of every groupgrad layer in the unit ``modules``."""
    return [
        (_label(name), sub)
        for name, sub in unit_members(modules)
        if isinstance(sub, GROUPGRAD_LAYERS)
    ]


def check_layers(modules: Sequence[nn.Module]) -> None:
    """Reject groupgrad layers set up in a way FSDP2 cannot serve.

    * ``accumulate_into_main_grad=True``: FSDP2 reduce-scatters ``.grad`` and
      gives unsharded parameters no ``main_grad``.
    * ``delay_wgrad_compute=True``: FSDP2 reduce-scatters a unit's gradients
      in its post-backward hook, before ``backward_dw()`` could write them.
    * A ``DistributedWeight`` parameter: its gradient would have two owners.
    * A ``DTensor`` parameter (sharded by something else, e.g. tensor
      parallelism): the grouped GEMMs take plain tensors.

    Raises:
        ValueError: One of the above, naming the layer or parameter.
    """
    for name, sub in unit_members(modules):
        for param_name, param in sub.named_parameters(recurse=False):
            if is_distributed_weight(param):
                raise ValueError(
                    f"parameter {_join(name, param_name)!r} is a DistributedWeight "
                    f"({type(param).__name__}); FSDP2 shards and reduces every parameter of the "
                    "unit itself, so its gradient would have two owners; shard the module with "
                    "FSDP2 or with the DistributedWeight implementer, not both"
                )
        if not isinstance(sub, GROUPGRAD_LAYERS):
            continue
        kind, label = type(sub).__name__, _label(name)
        check_layer_flags(sub, label)
        for param_name, param in sub.named_parameters():
            inner = _inner_unit(sub, param_name)
            if inner:
                raise ValueError(
                    f"{_join(name, inner)!r} inside {kind} {label!r} is an FSDP unit of its own; "
                    f"expected {kind} {label!r} sharded whole: its grouped op runs fc1 and fc2 "
                    "itself and never calls their forward, so FSDP2 would never gather their "
                    "parameters (shard the layer, or a module holding it, as one unit)"
                )
            if isinstance(param, DTensor):
                raise ValueError(
                    f"parameter {_join(name, param_name)!r} of {kind} {label!r} is already a "
                    f"DTensor (placements {param.placements}); groupgrad's grouped GEMMs take "
                    "plain tensors, expected an unsharded parameter before fully_shard"
                )


def _inner_unit(layer: nn.Module, param_name: str) -> str:
    """The name of the FSDP unit inside ``layer`` that holds parameter ``param_name``, or ``""``."""
    path = param_name.split(".")[:-1]
    for depth in range(1, len(path) + 1):
        if isinstance(layer.get_submodule(".".join(path[:depth])), FSDPModule):
            return ".".join(path[:depth])
    return ""


def check_uniform_dtype(modules: Sequence[nn.Module]) -> None:
    """Reject a unit whose trainable parameters have more than one dtype (FSDP2 needs one).

    FSDP2 itself fails at the unit's first forward, naming no parameter.

    Raises:
        ValueError: Two trainable parameters of the unit differ in dtype; the
            message names one of each.
    """
    first: tuple[str, torch.dtype] | None = None
    for name, sub in unit_members(modules):
        for param_name, param in sub.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if first is None:
                first = (_join(name, param_name), param.dtype)
            elif param.dtype != first[1]:
                raise ValueError(
                    f"parameter {_join(name, param_name)!r} has dtype {param.dtype} but "
                    f"{first[0]!r} has {first[1]}; FSDP2 expects one original dtype per unit: "
                    "cast the module (e.g. module.float(), with mp_policy's param_dtype for the "
                    "compute dtype) or shard the odd parameters' module as a unit of its own"
                )


def compute_dtype(param: torch.Tensor, policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype FSDP2 runs ``param`` in: ``policy.param_dtype`` for floating params, else its own."""
    if policy.param_dtype is not None and param.dtype.is_floating_point:
        return policy.param_dtype
    return param.dtype


def check_reduce_dtype(
    modules: Sequence[nn.Module], policy: MixedPrecisionPolicy
) -> torch.dtype | None:
    """Check the policy's dtypes and return the dtype gradients must reach FSDP2 in.

    ``reduce_dtype`` (and ``param_dtype``) must be one the grouped GEMMs'
    epilogues write: fp32, bf16 or fp16. A unit computed in 16 bits needs an
    explicit ``reduce_dtype``: without one FSDP2 would reduce in bf16/fp16,
    the rounding this integration exists to remove (pass the 16-bit dtype
    itself to reduce in it on purpose).

    Returns:
        ``policy.reduce_dtype`` (``None`` when unset: every gradient is
        already in its parameter's compute dtype, nothing to route).

    Raises:
        ValueError: A dtype is not fp32, bf16 or fp16, or a 16-bit unit has
            no ``reduce_dtype``.
    """
    supported = ", ".join(str(d) for d in MAIN_GRAD_DTYPES)
    for field in ("param_dtype", "reduce_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and dtype not in MAIN_GRAD_DTYPES:
            raise ValueError(f"mp_policy.{field} is {dtype}, expected None or one of {supported}")
    if policy.reduce_dtype is not None:
        return policy.reduce_dtype
    for name, sub in unit_members(modules):
        for param_name, param in sub.named_parameters(recurse=False):
            dtype = compute_dtype(param, policy)
            if dtype in LOW_PRECISION:
                raise ValueError(
                    f"parameter {_join(name, param_name)!r} is computed in {dtype} and "
                    "mp_policy.reduce_dtype is None, so FSDP2 would reduce-scatter its gradient "
                    f"in {dtype}; expected an explicit reduce_dtype, e.g. "
                    f"mp_policy=MixedPrecisionPolicy(param_dtype={dtype}, "
                    f"reduce_dtype=torch.float32) (or reduce_dtype={dtype} to reduce in {dtype} "
                    "on purpose)"
                )
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _label(name: str) -> str:
    """How messages name a module of the unit (the given module itself is ``<module>``)."""
    return name or "<module>"
