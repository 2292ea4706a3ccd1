"""Keep ``overwrite_main_grad`` off where Megatron-FSDP's gradient buffer is not sharded.

Megatron-FSDP sets ``overwrite_main_grad = True`` on every parameter each time
it gathers parameters (``MegatronFSDP.all_gather_and_wait_parameters_ready``,
before every forward and backward of an FSDP unit). That is right where the
gradient buffer is sharded (``optim_grads``, ``optim_grads_params``):
``get_main_grad()`` then hands out a fresh communication bucket that is
reduce-scattered after every backward. It is wrong where the gradient buffer
is *not* sharded (ZeRO-1 ``optim``, or a data-parallel group of size 1, such
as an expert group of one rank): there ``get_main_grad()`` returns the
persistent buffer that is reduced once per optimizer step, so overwriting it
drops every earlier micro-batch's gradient without an error.

:func:`keep_unsharded_grads_accumulating` wraps that method on one
``MegatronFSDP`` instance so that, right after it runs, the groupgrad weights
whose gradient buffer is not sharded get ``overwrite_main_grad = False``
again (their wgrad GEMM then accumulates, beta = 1). Other parameters are left
as Megatron-FSDP made them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from groupgrad.modules import GroupedLinear
from groupgrad.protocol import set_overwrite_main_grad

__all__ = ["groupgrad_weight_names", "keep_unsharded_grads_accumulating", "unsharded_grad_params"]

_FIXED = "_groupgrad_keeps_unsharded_grads_accumulating"


def groupgrad_weight_names(module: nn.Module) -> list[str]:
    """Return the qualified names of every groupgrad layer's weights in ``module``.

    Covers each :class:`~groupgrad.modules.GroupedLinear` (``GroupedMLP``'s
    ``fc1`` and ``fc2`` included): ``weight0 … weight{E-1}`` or ``weight``.
    """
    names: list[str] = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, GroupedLinear):
            names += [f"{prefix}.{w}" if prefix else w for w in sub.weight_names]
    return names


def _grad_buffer_is_sharded(model: Any, param: torch.Tensor) -> bool | None:
    """Mirror Megatron-FSDP's own test (``_grad_acc``); ``None`` when there is no grad buffer."""
    buffer = model.param_and_grad_buffer
    group = buffer.parameter_groups[buffer.param_to_param_group[param]]
    gbuf = group.hfsdp_helper_gbuf if group.hfsdp_helper_gbuf else group.main_grad_buffer
    if gbuf is None:
        return None
    return bool(gbuf.is_data_distributed)


def unsharded_grad_params(model: Any, names: Iterable[str]) -> list[torch.Tensor]:
    """Return the parameters named ``names`` whose Megatron-FSDP gradient buffer is not sharded.

    Args:
        model: A ``megatron_fsdp.MegatronFSDP``.
        names: Qualified parameter names in ``model.module``.
    """
    params = [model.raw_param[name] for name in names]
    return [p for p in params if _grad_buffer_is_sharded(model, p) is False]


def keep_unsharded_grads_accumulating(model: Any, names: Iterable[str]) -> list[torch.Tensor]:
    """Make the named weights accumulate into an unsharded gradient buffer.

    Wraps ``model.all_gather_and_wait_parameters_ready`` (on this instance
    only) so that, after Megatron-FSDP sets ``overwrite_main_grad = True``,
    the named weights whose gradient buffer is not sharded get it set back to
    ``False``. Calling it twice on one model does nothing more.

    Args:
        model: A ``megatron_fsdp.MegatronFSDP``; mutated (one instance
            attribute).
        names: Qualified names of groupgrad weights in ``model.module``.

    Returns:
        The parameters that will accumulate (empty when every gradient buffer
        is sharded).
    """
    if getattr(model, _FIXED, None) is not None:
        return list(getattr(model, _FIXED))
    accumulating = unsharded_grad_params(model, names)
    setattr(model, _FIXED, accumulating)
    if not accumulating:
        return []
    ids = {id(p) for p in accumulating}
    gather: Callable[..., Any] = model.all_gather_and_wait_parameters_ready

    def gather_then_keep_accumulating(
        params: Iterable[torch.Tensor], *args: Any, **kwargs: Any
    ) -> Any:
        params = list(params)
        result = gather(params, *args, **kwargs)
        for param in params:
            if id(param) in ids:
                set_overwrite_main_grad(param, False)
        return result

    model.all_gather_and_wait_parameters_ready = gather_then_keep_accumulating
    return accumulating
