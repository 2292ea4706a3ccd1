"""Keep ``DistributedDataParallel`` away from sharded expert weights.

DDP broadcasts rank 0's parameters to every rank when it is built and
all-reduces every parameter's ``.grad`` after backward. For a sharded expert
weight both are wrong: each rank's shard holds other rows (the broadcast would
overwrite rank ``r``'s rows with rank 0's), and its gradient already went to
``main_grad`` through the shard group's reduce-scatter. DDP skips the
parameters named in ``module._ddp_params_and_buffers_to_ignore`` of the module
it wraps (fully qualified names); :func:`register_ddp_ignore` merges names into
that list, the way ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
sets it.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from groupgrad.integrations.torch_distributed._find import check_module, named_sharded_parameters

__all__ = ["ddp_ignore_sharded", "register_ddp_ignore"]

_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


def register_ddp_ignore(module: nn.Module, names: Iterable[str]) -> list[str]:
    """Add ``names`` (relative to ``module``) to the parameters DDP ignores when it wraps ``module``.

    Keeps the names already listed. A parameter of ``module`` itself (no dot
    in its name) is listed twice, as ``"w"`` and ``".w"``: DDP's broadcast
    matches the first spelling and its gradient reducer the second.

    Returns:
        The module's whole ignore list after the merge.
    """
    listed = list(getattr(module, _IGNORE_ATTR, None) or [])
    for name in names:
        for spelling in (name,) if "." in name else (name, f".{name}"):
            if spelling not in listed:
                listed.append(spelling)
    setattr(module, _IGNORE_ATTR, listed)
    parameters = dict(module.named_parameters())
    for name in listed:  # what DDP's own helper marks too (read by its comm hooks)
        if name in parameters:
            parameters[name]._ddp_ignored = True  # type: ignore[attr-defined]
    return listed


def ddp_ignore_sharded(module: nn.Module) -> list[str]:
    """Make ``DistributedDataParallel(module)`` leave every sharded expert weight inside alone.

    :func:`shard_expert_weights` already does this for the module it was
    given, which covers ``shard_expert_weights(model); DDP(model)``. Call this
    when DDP wraps a *parent* of the sharded module (e.g.
    ``shard_expert_weights(model.moe.experts)`` then ``DDP(model)``), before
    wrapping: DDP reads the list once, when it is built. The names are merged
    into ``module._ddp_params_and_buffers_to_ignore`` (names already there
    stay). Without it, DDP would overwrite every rank's expert shards with
    rank 0's; the first forward then raises a ``RuntimeError``.

    Args:
        module: The module DDP will wrap.

    Returns:
        The sharded parameters' fully qualified names (as
        ``module.named_parameters()`` names them) now on the ignore list.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or is already a
            ``DistributedDataParallel`` (too late: it broadcast at construction).
        ValueError: ``module`` holds no sharded expert weight (call
            :func:`shard_expert_weights` first).
    """
    check_module(module)
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "module is already a DistributedDataParallel: it broadcast rank 0's parameters when "
            "it was built; call ddp_ignore_sharded(model) on the unwrapped model, before "
            "DistributedDataParallel(model)"
        )
    names = [name for name, _ in named_sharded_parameters(module)]
    if not names:
        raise ValueError(
            f"module ({type(module).__name__}) holds no sharded expert weight; call "
            "shard_expert_weights on its expert layers first, then ddp_ignore_sharded"
        )
    register_ddp_ignore(module, names)
    return names
