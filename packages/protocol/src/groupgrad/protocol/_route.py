"""Reading a weight group: where its wgrad goes, and in which dtype autograd takes it.

:func:`wgrad_route` decides the route from the parameters' attributes;
:func:`autograd_grad_dtype` gives the dtype of the autograd route's GEMM
output. Both read every member, every call: ``requires_grad``,
``grad_dtype`` and the framework attributes can change between two
backwards without any trace. The common group (what a per-expert layer on
the autograd/``grad_dtype`` route holds: plain parameters, all trainable, of
one shape and one grad dtype, nothing attached) is recognised in one C-level
pass over the group (:func:`plain_members` for the route,
:func:`uniform_plain_facts` for the plan) instead of a Python loop per
member; every other group takes the per-member reading, which names a
misfit.
"""

from __future__ import annotations

import enum
import functools
import operator
from collections.abc import Sequence
from typing import cast

import torch

from groupgrad.protocol._attrs import grad_dtype_of, is_fsdp_param
from groupgrad.protocol._distributed import WeightGroup, as_weight_list, is_distributed_weight

__all__ = [
    "WgradRoute",
    "autograd_dtype",
    "autograd_grad_dtype",
    "check_shape",
    "member_labels",
    "plain_members",
    "route_of",
    "uniform_plain_facts",
    "wgrad_route",
]


class WgradRoute(enum.Enum):
    """Where a group's weight gradient goes."""

    AUTOGRAD = "autograd"
    """Returned to autograd in the parameter's ``grad_dtype``; autograd accumulates ``.grad``."""

    MAIN_GRAD = "main_grad"
    """Written by the GEMM straight into each parameter's ``main_grad``."""

    DISTRIBUTED = "distributed"
    """Written into ``weight_grad_buffers``; the leader's ``finalize_group_grads`` owns the rest."""


@functools.lru_cache(maxsize=64)
def _default_labels(count: int) -> tuple[str, ...]:
    return tuple(f"weights[{i}]" for i in range(count))


def member_labels(count: int, names: Sequence[str] | None) -> tuple[str, ...]:
    """How messages name each of ``count`` members: ``names``, or ``weights[i]``."""
    if names is None:
        return _default_labels(count)
    if len(names) != count:
        raise ValueError(f"names has {len(names)} entries but the group has {count} weights")
    return tuple(names)


_PLAIN_TYPES = frozenset((torch.nn.Parameter, torch.Tensor))
_FACTS = operator.attrgetter("requires_grad", "grad_dtype", "shape")


def plain_members(weights: object) -> bool:
    """Whether ``weights`` is a non-empty list or tuple of plain members, read in one pass.

    Plain: a ``torch.nn.Parameter`` (or a plain tensor) with no attribute
    attached, so neither a ``DistributedWeight`` nor Megatron-FSDP's, and
    without any attribute of the ``main_grad`` contract. ``map`` over the
    group, no Python per member; read again at every call (attributes come and
    go without a trace). Such a group needs no
    :func:`~groupgrad.protocol._distributed.as_weight_list` check: every member
    is a tensor.
    """
    return (
        isinstance(weights, list | tuple)
        and bool(weights)
        and set(map(type, weights)) <= _PLAIN_TYPES
        and not any(map(vars, weights))
    )


def uniform_plain_facts(weights: object) -> tuple[torch.dtype, torch.Size] | None:
    """``(grad_dtype, shape)`` of a uniform plain group; ``None`` for anything else.

    Uniform plain: :func:`plain_members`, every member requiring grad, one
    ``grad_dtype`` and one shape. One ``attrgetter`` pass reads the three facts
    of every member and one ``count`` compares them, so the answer costs no
    Python per member; anything else gets ``None`` and the per-member reading,
    which names a misfit.
    """
    if not plain_members(weights):
        return None
    members = cast(Sequence[torch.Tensor], weights)
    try:
        facts = list(map(_FACTS, members))
    except RuntimeError:  # a non-leaf member has no grad_dtype: the per-member reading
        return None
    first = facts[0]
    trainable, dtype, shape = first
    if trainable and isinstance(dtype, torch.dtype) and facts.count(first) == len(facts):
        return dtype, shape
    return None


def wgrad_route(
    weights: WeightGroup, *, wgrad_into_main_grad: bool, names: Sequence[str] | None = None
) -> WgradRoute:
    """Decide where the group's weight gradient goes, without touching any buffer.

    A group whose leader is a ``DistributedWeight`` is distributed even when
    the layer writes into ``main_grad``.

    Args:
        weights: The group's parameters, leader first.
        wgrad_into_main_grad: Whether the layer was asked to write into
            ``main_grad`` (its ``accumulate_into_main_grad`` option).
        names: Parameter names for error messages.

    Raises:
        RuntimeError: A parameter is both a Megatron-FSDP parameter and a
            ``DistributedWeight``: two owners would reduce its gradient.
    """
    if plain_members(weights):  # no member is distributed or FSDP's
        member_labels(len(cast(Sequence[torch.Tensor], weights)), names)  # names, checked
        return WgradRoute.MAIN_GRAD if wgrad_into_main_grad else WgradRoute.AUTOGRAD
    members = as_weight_list(weights)
    return route_of(members, member_labels(len(members), names), wgrad_into_main_grad)


def route_of(
    members: list[torch.Tensor], names: Sequence[str], wgrad_into_main_grad: bool
) -> WgradRoute:
    """:func:`wgrad_route` for a normalized group with its labels, member by member."""
    for label, member in zip(names, members, strict=True):
        if is_fsdp_param(member) and is_distributed_weight(member):
            raise RuntimeError(
                f"parameter {label!r} is both a Megatron-FSDP parameter (__fsdp_param__) and a "
                "DistributedWeight; a parameter can have only one owner of its gradient "
                "reduction"
            )
    if is_distributed_weight(members[0]):
        return WgradRoute.DISTRIBUTED
    return WgradRoute.MAIN_GRAD if wgrad_into_main_grad else WgradRoute.AUTOGRAD


def check_shape(members: list[torch.Tensor], shape: tuple[int, ...], names: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the first member whose shape is not ``shape``."""
    for label, param in zip(names, members, strict=True):
        if tuple(param.shape) != shape:
            raise ValueError(
                f"parameter {label!r} has shape {tuple(param.shape)}, but the wgrad GEMM "
                f"produces {shape}"
            )


def autograd_grad_dtype(weights: WeightGroup) -> torch.dtype:
    """The dtype a plain group's wgrad GEMM writes for autograd: its members' ``grad_dtype``.

    The widest :func:`~groupgrad.protocol.grad_dtype_of` among the members that
    require grad (all of them when none does): autograd casts each gradient
    to its parameter's ``grad_dtype`` anyway, so a mixed group rounds once,
    from the widest.
    """
    uniform = uniform_plain_facts(weights)  # all trainable, one grad_dtype: that one
    return autograd_dtype(as_weight_list(weights)) if uniform is None else uniform[0]


def autograd_dtype(members: list[torch.Tensor]) -> torch.dtype:
    """:func:`autograd_grad_dtype` for a normalized group, member by member."""
    live = [p for p in members if p.requires_grad] or members
    dtype = grad_dtype_of(live[0])
    for param in live[1:]:
        dtype = torch.promote_types(dtype, grad_dtype_of(param))
    return dtype
