"""Full weights and full gradients of a Megatron-FSDP model, for inspection and checkpoints.

Megatron-FSDP keeps each parameter as a DTensor whose shards are uneven: a
rank's shard of a small parameter may be empty, and then its distributed
parameter's ``.grad`` is ``None`` even though the parameter has a gradient.
The helpers here gather every rank's piece (empty ones included) with
``all_gather_object`` (CPU copies; gloo refuses empty tensors in its
all-gather) over each sharded mesh dimension, and place the pieces at their
offsets in a full tensor on the CPU.

They are collectives: every rank of the model's mesh calls them, in the same
order, and every rank receives the full tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["gather_full_grads", "gather_full_weights"]

# One rank's piece of a parameter: its offsets in the full tensor and its values,
# or None where that rank holds values but no gradient.
_Piece = tuple[tuple[int, ...], Tensor | None]


def gather_full_weights(model: Any) -> dict[str, Tensor]:
    """Return the full value of every parameter of a Megatron-FSDP model, on every rank.

    The values are Megatron-FSDP's distributed parameters (the main weights
    the optimizer updates, fp32 under :func:`fp32_grad_policy`), assembled
    from every rank's shard. A collective: call it on every rank.

    Args:
        model: The ``megatron_fsdp.MegatronFSDP`` wrapper :func:`shard_model`
            returned.

    Returns:
        ``{name: tensor}`` with the names of ``model.module.named_parameters()``;
        CPU tensors of the full shape, in the distributed parameters' dtype.

    Raises:
        RuntimeError: A part of a parameter is held by no rank.
    """
    full = {}
    for name, param in _distributed_parameters(model):
        local = _local(param)
        full[name] = _assemble(name, param, local.detach().cpu(), what="weight")
    return {name: value for name, value in full.items() if value is not None}


def gather_full_grads(model: Any) -> dict[str, Tensor]:
    """Return the full reduced gradient (``main_grad``) of every parameter, on every rank.

    Megatron-FSDP reduces the gradient buffers (fp32 under
    :func:`fp32_grad_policy`, averaged over the data-parallel ranks) and
    attaches each rank's shard as ``.grad`` of its distributed parameter when
    the gradient synchronisation finishes: after each backward with
    Megatron-FSDP's default ``sync_model_each_microbatch=True``, else after
    ``model.finish_grad_sync()`` (which ``optimizer.step()`` runs). Call this
    after that and before ``optimizer.zero_grad()``. A rank whose shard of a
    parameter is empty has ``.grad = None`` there; its piece counts as empty,
    not missing. A collective: call it on every rank.

    Args:
        model: The ``megatron_fsdp.MegatronFSDP`` wrapper :func:`shard_model`
            returned.

    Returns:
        ``{name: gradient}`` for every parameter that has a gradient (those
        without one on every rank, e.g. frozen ones, are left out); CPU
        tensors of the full shape, in the gradient's dtype.

    Raises:
        RuntimeError: Some ranks hold a gradient of a parameter and others,
            with a non-empty shard, none (the gradients were gathered before
            the synchronisation finished); a gradient's shard does not match
            its parameter's; a part of a parameter is held by no rank.
    """
    full = {}
    for name, param in _distributed_parameters(model):
        local = _local(param)
        grad = getattr(param, "grad", None)
        piece: Tensor | None
        if local.numel() == 0:
            piece = local.detach().cpu()  # an empty shard: nothing to miss
        elif grad is None:
            piece = None
        else:
            piece = _local(grad).detach().cpu()
            if piece.shape != local.shape:
                raise RuntimeError(
                    f"parameter {name!r}: this rank's gradient shard has shape "
                    f"{tuple(piece.shape)}, its parameter shard {tuple(local.shape)}"
                )
        full[name] = _assemble(name, param, piece, what="gradient")
    return {name: value for name, value in full.items() if value is not None}


def _distributed_parameters(model: Any) -> list[tuple[str, Tensor]]:
    """Megatron-FSDP's distributed parameters by module parameter name, in a rank-independent order."""
    buffer = getattr(model, "param_and_grad_buffer", None)
    if buffer is None:
        raise TypeError(
            f"model is a {type(model).__name__}, expected the megatron_fsdp.MegatronFSDP "
            "wrapper that shard_model returns"
        )
    return list(buffer.optimizer_named_parameters)


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _offsets(param: Tensor) -> tuple[int, ...]:
    """Where this rank's shard of ``param`` starts in the full tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return (0,) * param.dim()
    from megatron_fsdp.uneven_dtensor import update_uneven_dtensor_chunk_metadata

    local: Any = param._local_tensor  # Megatron-FSDP attaches the chunk metadata here
    if not hasattr(local, "__create_chunk_list__"):
        update_uneven_dtensor_chunk_metadata(param)  # a collective, like this whole call
    (chunk,) = local.__create_chunk_list__()
    return tuple(int(o) for o in chunk.offsets)


def _assemble(name: str, param: Tensor, mine: Tensor | None, *, what: str) -> Tensor | None:
    """Gather every rank's piece of ``param`` and place the pieces in a full CPU tensor."""
    from torch.distributed.tensor import DTensor

    pieces: list[_Piece] = [(_offsets(param), mine)]
    if isinstance(param, DTensor):
        for mesh_dim, placement in enumerate(param.placements):
            if placement.is_shard():
                group = param.device_mesh.get_group(mesh_dim)
                gathered: list[Any] = [None] * dist.get_world_size(group)
                dist.all_gather_object(gathered, pieces, group=group)
                pieces = [piece for rank_pieces in gathered for piece in rank_pieces]
    held = [(offsets, t) for offsets, t in pieces if t is None or t.numel() > 0]
    if all(t is None for _, t in held):
        return None  # no rank holds a value (a parameter without gradient)
    if any(t is None for _, t in held):
        missing = sum(t is None for _, t in held)
        raise RuntimeError(
            f"parameter {name!r}: {missing} of {len(held)} non-empty shards have no {what}; "
            "gather gradients after Megatron-FSDP finished the gradient synchronisation "
            "(after backward, or model.finish_grad_sync()) and before optimizer.zero_grad()"
        )
    values = [(offsets, t) for offsets, t in held if t is not None]  # every one, as checked
    full = torch.full(tuple(param.shape), float("nan"), dtype=values[0][1].dtype)
    covered = torch.zeros(tuple(param.shape), dtype=torch.bool)
    for offsets, t in values:
        index = tuple(slice(o, o + s) for o, s in zip(offsets, t.shape, strict=True))
        full[index] = t
        covered[index] = True
    if not bool(covered.all()):
        raise RuntimeError(
            f"parameter {name!r}: {int((~covered).sum())} of {covered.numel()} elements of its "
            f"{what} are held by no rank"
        )
    return full
