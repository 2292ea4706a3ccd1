"""The ``grad_dtype`` route: FSDP2's unsharded parameters ask autograd for ``reduce_dtype``.

FSDP2 swaps each managed parameter of a module between a sharded ``DTensor``
and an unsharded plain ``nn.Parameter`` (a view of the all-gather output). The
unsharded parameter is what forward and backward see, and its ``.grad`` is
what FSDP2 copies into the reduce-scatter buffer (of ``reduce_dtype``). Its
``grad_dtype`` decides the dtype autograd hands that gradient in: groupgrad's
grouped GEMMs write their weight gradient in it straight from the epilogue
(bf16 operands, fp32 output), every other layer's gradient is cast to it by
autograd's AccumulateGrad, so the unit's gradients are uniformly
``reduce_dtype`` (FSDP2 asserts one dtype per reduce-scatter).

FSDP2 creates the unsharded parameter at the first all-gather and may create it
again (e.g. after a state-dict load that assigns new storage), so the dtype is
set every time the unit is unsharded for forward: by a forward pre-hook that
runs after FSDP2's own (FSDP2 registers its hook first, with ``prepend=True``).
Backward reuses the parameter forward saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ParamSlot", "UnshardedGradDtype", "managed_slots"]

ParamSlot = tuple[nn.Module, str]
"""Where a managed parameter lives: its owning module and its name there."""


def plain_param_slots(modules: Sequence[nn.Module]) -> list[tuple[ParamSlot, int]]:
    """Every ``(owner, name)`` slot holding a plain (non-``DTensor``) parameter, with its id."""
    slots: list[tuple[ParamSlot, int]] = []
    for root in modules:
        for owner in root.modules():
            for name, param in owner.named_parameters(recurse=False):
                if not isinstance(param, DTensor):
                    slots.append(((owner, name), id(param)))
    return slots


def managed_slots(before: list[tuple[ParamSlot, int]]) -> list[ParamSlot]:
    """The slots a ``fully_shard`` call took over: plain before it, a ``DTensor`` after it.

    ``before`` is :func:`plain_param_slots` taken right before the call; FSDP2
    replaces each parameter it manages with a sharded ``DTensor`` (ignored
    parameters and those of sub-units stay as they were). A parameter
    registered under several names appears once per slot.
    """
    return [
        (owner, name)
        for (owner, name), _ in before
        if isinstance(owner._parameters.get(name), DTensor)
    ]


class UnshardedGradDtype:
    """Forward pre-hook: the unit's unsharded parameters get ``grad_dtype = reduce_dtype``.

    Registered on each module of an FSDP2 unit after FSDP2's own pre-forward
    hook, so the module's parameters are the unsharded ones when it runs.
    Slots still holding a ``DTensor`` (not unsharded) and integer parameters
    are left alone; a parameter that has the dtype already is not touched.

    Args:
        slots: The unit's managed parameter slots (:func:`managed_slots`).
        dtype: ``mp_policy.reduce_dtype``.
    """

    def __init__(self, slots: Sequence[ParamSlot], dtype: torch.dtype) -> None:
        self.slots = list(slots)
        self.dtype = dtype

    @torch.compiler.disable  # runs outside a compiled unit's graph (see _shard)
    def __call__(self, module: nn.Module, args: Any) -> None:
        for owner, name in self.slots:
            param = owner._parameters.get(name)
            if (
                param is None
                or isinstance(param, DTensor)
                or not param.dtype.is_floating_point
                or param.grad_dtype == self.dtype
            ):
                continue
            param.grad_dtype = self.dtype
