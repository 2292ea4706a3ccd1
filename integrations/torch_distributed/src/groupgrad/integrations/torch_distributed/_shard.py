"""Shard a module's grouped expert weights over a process group, and gather them back.

Legend: ``W`` ranks, ``E`` experts, ``N`` out_features, ``K`` in_features,
``n = N / W``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import parametrize

from groupgrad.integrations.torch_distributed._checkpoint import attach_state_dict_hooks
from groupgrad.integrations.torch_distributed._ddp import register_ddp_ignore
from groupgrad.integrations.torch_distributed._find import grouped_layers, qualified, sharded_layers
from groupgrad.integrations.torch_distributed._shard_group import ExpertShardGroup, GradReduction
from groupgrad.integrations.torch_distributed._weight import ShardedExpertWeight
from groupgrad.modules import GroupedLinear
from groupgrad.protocol import MAIN_GRAD_DTYPES, is_distributed_weight, is_fsdp_param

__all__ = ["gather_full_weights", "shard_expert_weights"]

_GRAD_REDUCTIONS = ("sum", "mean")


def _check_shardable(
    layer: GroupedLinear, names: list[str], weights: list[Tensor], world_size: int
) -> None:
    for attr, name in zip(layer.weight_names, names, strict=True):
        if parametrize.is_parametrized(layer, attr):
            raise ValueError(
                f"{name!r} is parametrized (torch.nn.utils.parametrize); expected a plain "
                "parameter (sharding replaces the parameter itself)"
            )
    for name, weight in zip(names, weights, strict=True):
        if is_distributed_weight(weight):
            raise ValueError(
                f"{name!r} is already a DistributedWeight ({type(weight).__name__}); expected a "
                "plain parameter (shard each module once)"
            )
        if is_fsdp_param(weight):
            raise ValueError(
                f"{name!r} is a Megatron-FSDP parameter (__fsdp_param__); a parameter can have "
                "only one owner of its gradient reduction"
            )
    for name, weight in zip(names[1:], weights[1:], strict=True):
        if (weight.shape, weight.dtype, weight.device) != (
            weights[0].shape,
            weights[0].dtype,
            weights[0].device,
        ):
            raise ValueError(
                f"{name!r} is {tuple(weight.shape)} {weight.dtype} on {weight.device}, expected "
                f"{tuple(weights[0].shape)} {weights[0].dtype} on {weights[0].device} like "
                f"{names[0]!r} (one group, one layout)"
            )
    rows = weights[0].shape[-2]
    if rows % world_size:
        raise ValueError(
            f"{names[0]!r} has {rows} rows (out_features), not divisible by the process group's "
            f"world size {world_size}; each rank keeps out_features / world_size rows of every "
            "expert"
        )


def _refuse_shared(
    module: nn.Module, planned: list[tuple[GroupedLinear, list[str], list[Tensor]]]
) -> None:
    """Refuse a weight to shard that ``module`` also holds under another name.

    Tied to another module's parameter: sharding replaces it where its layer holds
    it, the other holder keeps its own, and each gets only its own use's gradient
    (the copies drift apart silently). Its layer registered under two names: the
    state-dict hooks know one name, so a checkpoint would carry this rank's rows
    under the other, unmarked, and load them on every rank.
    """
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for _, layer_names, weights in planned:
        for name, weight in zip(layer_names, weights, strict=True):
            others = [n for n in names.get(id(weight), ()) if n != name]
            if others:
                raise ValueError(
                    f"{name!r} is also {', '.join(repr(n) for n in others)}: a weight tied to "
                    "another module's, or a layer registered under two names, cannot be "
                    "sharded (the two names would get their own shards, or a checkpoint this "
                    "rank's rows unmarked); expected each expert weight held once in module "
                    "(untie them; register the layer once and call it twice)"
                )


def _shard_of(weight: Tensor, rank: int, world_size: int) -> Tensor:
    """This rank's rows ``rank*n … (rank+1)*n - 1`` of ``weight`` (along dim -2), a fresh copy."""
    rows = weight.shape[-2] // world_size
    return (
        weight.detach().narrow(-2, rank * rows, rows).clone(memory_format=torch.contiguous_format)
    )


def _plain_follower(shard: Tensor, requires_grad: bool, main_grad_dtype: torch.dtype) -> Tensor:
    follower = nn.Parameter(shard, requires_grad=requires_grad)
    follower.main_grad = torch.zeros(  # type: ignore[attr-defined]
        shard.shape, dtype=main_grad_dtype, device=shard.device
    )
    follower.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    return follower


def shard_expert_weights(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    *,
    grad_reduction: GradReduction = "mean",
    main_grad_dtype: torch.dtype = torch.float32,
    leader_only: bool = False,
) -> list[ExpertShardGroup]:
    """Replace every ``GroupedLinear``'s expert weights in ``module`` by row shards, in place.

    For each :class:`~groupgrad.modules.GroupedLinear` in ``module`` (itself,
    or e.g. a ``GroupedMLP``'s ``fc1`` and ``fc2``), each weight parameter —
    ``weight0 … weight{E-1}`` ``(N, K)`` or the packed ``weight`` ``(E, N, K)``
    — is replaced by this rank's rows (``(n, K)`` / ``(E, n, K)``, same
    dtype, device and ``requires_grad``) with a zeroed ``main_grad`` shard of
    ``main_grad_dtype`` and ``grad_added_to_main_grad = False``. The leader
    (``weight0`` / ``weight``) is a :class:`ShardedExpertWeight`: each forward
    and each backward all-gathers the layer's whole group once, and its
    backward reduce-scatters the group's wgrads (in ``main_grad_dtype``) into
    the ``main_grad`` shards. Biases are not sharded: they stay replicated
    plain parameters whose ``.grad`` the caller reduces.

    Every rank of ``process_group`` must call it on the same module
    structure, holding the same full weights (e.g. built from the same seed);
    each keeps its own rows (no communication happens here). Move the module
    to its device and dtype first: ``main_grad`` shards are allocated now;
    wrap it in ``DistributedDataParallel`` after (a DDP built before keeps
    tracking the replaced full weights).
    Every layer is checked before any is replaced: on an error, nothing is.

    On ``module`` itself it also sets up what the rest of a training loop
    needs, so that nothing loses or corrupts rows:

    * ``DistributedDataParallel(module)`` leaves the sharded weights alone:
      their names are merged into ``module._ddp_params_and_buffers_to_ignore``
      (DDP neither broadcasts rank 0's shards over the others nor
      all-reduces their ``.grad``). When DDP wraps a *parent* of ``module``,
      call :func:`ddp_ignore_sharded` on that parent before wrapping; if you
      do not, the first forward raises a ``RuntimeError`` (see
      :meth:`ExpertShardGroup.arm_broadcast_check`).
    * ``module.state_dict()`` presents each sharded weight as a ``DTensor``
      of its full shape, ``Shard(-2)`` over the process group, for
      ``torch.distributed.checkpoint``; ``module.load_state_dict`` accepts
      such ``DTensor`` entries (resharded as needed) or full plain tensors.
      :func:`full_state_dict` / :func:`load_full_state_dict` give and take
      full tensors.

    Args:
        module: A ``GroupedLinear``, or any module containing them.
        process_group: The ranks to shard over (``None``: the default group).
            Its backend must support all-gather and reduce-scatter of single
            tensors on the weights' device (gloo on CPU, NCCL on CUDA), and
            ``ReduceOp.AVG`` for ``grad_reduction="mean"``.
        grad_reduction: ``"mean"`` (default, ``ReduceOp.AVG``): ``main_grad``
            receives the ranks' average gradient, like data-parallel training
            of a mean loss; ``"sum"`` (``ReduceOp.SUM``): their sum.
        main_grad_dtype: dtype of ``main_grad``, of the wgrad buffers and of
            the reduce-scatter (fp32 by default, whatever the weights' dtype).
        leader_only: Only the leader is a ``ShardedExpertWeight``; the other
            experts' shards are plain ``nn.Parameter`` objects (with the same
            ``main_grad`` attributes), which the leader gathers and reduces.

    Returns:
        One :class:`ExpertShardGroup` per sharded layer, in ``module.named_modules()`` order.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``grad_reduction`` or ``main_grad_dtype`` is not supported;
            ``module`` contains no ``GroupedLinear``; a weight is already a
            ``DistributedWeight`` or a Megatron-FSDP parameter; a layer's
            weights differ in shape, dtype or device; a layer's out_features
            is not divisible by the world size; a weight is held under two
            names in ``module`` (tied, or its layer registered twice) or is
            parametrized; this process is not in ``process_group``.
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    if grad_reduction not in _GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction is {grad_reduction!r}, expected 'sum' or 'mean'")
    if main_grad_dtype not in MAIN_GRAD_DTYPES:
        raise ValueError(
            f"main_grad_dtype is {main_grad_dtype}, expected one of "
            + ", ".join(str(d) for d in MAIN_GRAD_DTYPES)
        )
    layers = grouped_layers(module)
    if not layers:
        raise ValueError(
            f"module ({type(module).__name__}) contains no GroupedLinear; nothing to shard"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group "
            "before shard_expert_weights"
        )
    world_size = dist.get_world_size(process_group)
    if dist.get_rank(process_group) < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of process_group; "
            "call shard_expert_weights on the group's ranks only"
        )
    planned = []
    for prefix, layer in layers:  # every layer checked before any is replaced
        names = [qualified(prefix, name) for name in layer.weight_names]
        weights = [getattr(layer, name) for name in layer.weight_names]
        _check_shardable(layer, names, weights, world_size)
        planned.append((layer, names, weights))
    _refuse_shared(module, planned)
    groups = []
    for layer, names, weights in planned:
        group = ExpertShardGroup(
            weights[0].shape, process_group, grad_reduction, names, main_grad_dtype
        )
        group.arm_broadcast_check(weights)
        for index, (name, weight) in enumerate(zip(layer.weight_names, weights, strict=True)):
            shard = _shard_of(weight, group.rank, world_size)
            member: Tensor
            if index == 0 or not leader_only:
                member = ShardedExpertWeight(shard, group, main_grad_dtype, weight.requires_grad)
            else:
                member = _plain_follower(shard, weight.requires_grad, main_grad_dtype)
            group.members.append(member)
            setattr(layer, name, member)
        groups.append(group)
    register_ddp_ignore(module, [name for group in groups for name in group.names])
    attach_state_dict_hooks(module, groups)
    return groups


def gather_full_weights(module: nn.Module) -> dict[str, Tensor]:
    """All-gather the full expert weights of every sharded ``GroupedLinear`` in ``module``.

    For checkpoints and tests. Collective: every rank of each layer's process
    group must call it (one all-gather per layer, in ``named_modules()`` order).

    Args:
        module: A module :func:`shard_expert_weights` has sharded.

    Returns:
        Qualified parameter name (``"weight0"``, ``"fc1.weight"``, ...) to its
        full weight, ``(N, K)`` or ``(E, N, K)`` in the weights' dtype, on
        their device; fresh memory (views of one buffer per layer), detached.
        Layers that were not sharded are left out.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    full: dict[str, Tensor] = {}
    for found in sharded_layers(module):
        full.update(zip(found.names, found.group.gather(), strict=True))
    return full
