"""Checkpoints of sharded expert weights that keep every row.

Legend: ``W`` ranks, ``E`` experts, ``N`` out_features, ``K`` in_features,
``n = N / W``.

Two formats, both lossless:

* **Sharded** (``module.state_dict()``): the hooks :func:`attach_state_dict_hooks`
  registers on the sharded module present each sharded weight as a
  :class:`~torch.distributed.tensor.DTensor` of the full shape, ``Shard(-2)``
  (rows) over a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` of the
  shard group's process group, whose local tensor *is* this rank's shard (no
  copy). ``torch.distributed.checkpoint`` (DCP) saves it and loads it back on
  any world size whose rank count divides ``N``. ``torch.save`` of it keeps
  this rank's rows only, marked as such (every rank saves its own file).
* **Full** (:func:`full_state_dict` / :func:`load_full_state_dict`): plain
  full tensors on every rank, e.g. one ``torch.save`` on rank 0.

Loading (the load pre-hook, so ``module.load_state_dict`` too) accepts for a
sharded weight a ``DTensor`` of its full shape over the group's ranks whose
local tensor is this rank's (another placement is gathered and re-split), or
a plain tensor of its full shape (this rank keeps its rows). Refused, with a
``RuntimeError`` before anything is copied: a plain tensor of the shard's
shape (it carries no record of whose rows it holds), a ``DTensor`` over other
ranks (DCP reshards those), and one holding another rank's local tensor
(rank 0's ``torch.save`` file loaded on rank 1). "Before anything is copied"
holds for the sharded module's own load: ``load_state_dict`` on a parent has
loaded the modules before it by then, so :func:`load_full_state_dict` checks
every entry first.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from groupgrad.integrations.torch_distributed._find import check_module, sharded_layers
from groupgrad.integrations.torch_distributed._shard_group import ExpertShardGroup

__all__ = ["attach_state_dict_hooks", "full_state_dict", "load_full_state_dict"]

_plain = threading.local()  # .depth > 0: state_dict() leaves shards as they are (plain tensors)


@contextlib.contextmanager
def _plain_shards() -> Iterator[None]:
    """Within: ``state_dict()`` gives the shards as plain tensors (no mesh, no DTensor)."""
    _plain.depth = getattr(_plain, "depth", 0) + 1
    try:
        yield
    finally:
        _plain.depth -= 1


def _process_group(group: ExpertShardGroup) -> dist.ProcessGroup:
    process_group = group.process_group or dist.group.WORLD
    if process_group is None:
        raise RuntimeError(
            "torch.distributed is not initialized (anymore); the sharded weights' process group "
            "is gone"
        )
    return process_group


def _mesh(group: ExpertShardGroup, device: torch.device) -> DeviceMesh:
    """A 1-D mesh of ``group``'s process group (no communication).

    Built per ``state_dict()`` call and not cached: only the ``DTensor``
    entries hold it (and through it the process group), so a script that
    drops its state dicts before ``destroy_process_group()`` leaves nothing
    that keeps the group's threads alive at exit.
    """
    return DeviceMesh.from_group(_process_group(group), device.type)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _as_dtensor(group: ExpertShardGroup, local: Tensor) -> DTensor:
    shape = group.full_shape
    return DTensor.from_local(
        local,
        _mesh(group, local.device),
        [Shard(len(shape) - 2)],
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_strides(shape),
    )


def _rows(group: ExpertShardGroup, full: Tensor) -> Tensor:
    rows = group.full_shape[-2] // group.world_size
    return full.narrow(-2, group.rank * rows, rows)


def _check_dtensor(group: ExpertShardGroup, key: str, value: DTensor) -> None:
    """Refuse a full-shape ``DTensor`` over other ranks or holding another rank's local
    tensor here (no communication)."""
    ranks = dist.get_process_group_ranks(_process_group(group))
    mesh = value.device_mesh
    mesh_ranks = mesh.mesh.flatten().tolist()
    if mesh_ranks != ranks:
        raise RuntimeError(
            f"state_dict[{key!r}] is a DTensor over ranks {mesh_ranks}, but the weight is sharded "
            f"over ranks {ranks}; load a checkpoint saved on another world size through "
            "torch.distributed.checkpoint (it reshards), or with load_full_state_dict"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None or list(coordinate) != [group.rank]:
        raise RuntimeError(
            f"state_dict[{key!r}] is a DTensor whose local tensor belongs to mesh coordinate "
            f"{coordinate}, but this is rank {group.rank}: it holds another rank's rows (e.g. "
            "rank 0's torch.save file loaded on every rank). Each rank must load the file it "
            "saved, or save with torch.distributed.checkpoint or full_state_dict(module)"
        )


def _local_rows(group: ExpertShardGroup, value: Tensor) -> Tensor:
    """This rank's rows of a checkpoint entry for a member of ``group`` that
    :func:`_check_entry` took: a full-shape ``DTensor`` over the group's ranks
    whose local tensor is this rank's (gathered and re-split when its placement
    differs from ours: a collective over its mesh), or a plain full-shape tensor.
    """
    if not isinstance(value, DTensor):
        return _rows(group, value)
    if value.placements == (Shard(len(group.full_shape) - 2),):
        return value.to_local()
    return _rows(group, value.full_tensor())  # another placement: collective over the mesh


def _check_entry(group: ExpertShardGroup, key: str, value: object) -> None:
    """Refuse, without communicating, a checkpoint entry :func:`_local_rows` cannot take
    (the load hook checks every entry before it converts any).

    Raises:
        RuntimeError: Not a tensor of the full shape (a plain shard-shaped tensor
            among them), or a ``DTensor`` over other ranks or holding another
            rank's local tensor; the message names ``key`` and the value.
    """
    full_shape = group.full_shape
    if not isinstance(value, Tensor):
        raise RuntimeError(
            f"state_dict[{key!r}] is a {type(value).__name__}, expected a tensor of the full "
            f"weight's shape {full_shape} (plain or a DTensor)"
        )
    if tuple(value.shape) != full_shape:
        shard_hint = (
            "; a plain tensor of the shard's shape carries no record of whose rows it holds "
            "(save with module.state_dict(), which gives DTensors, or full_state_dict(module))"
            if tuple(value.shape) == group.shard_shape
            else ""
        )
        kind = "a DTensor" if isinstance(value, DTensor) else "a tensor"
        raise RuntimeError(
            f"state_dict[{key!r}] is {kind} of shape {tuple(value.shape)}, expected the full "
            f"weight's shape {full_shape} (sharded into {group.shard_shape} per rank over "
            f"{group.world_size} ranks){shard_hint}"
        )
    if isinstance(value, DTensor):
        _check_dtensor(group, key, value)


def _member_entries(module: nn.Module, groups: list[ExpertShardGroup], prefix: str) -> list:
    """``(key, group, member)`` for every group member still registered under its name."""
    entries = []
    for group in groups:
        for name, member in zip(group.names, group.members, strict=True):
            try:
                current = module.get_parameter(name)
            except AttributeError:
                continue
            if current is member:
                entries.append((prefix + name, group, member))
    return entries


def attach_state_dict_hooks(module: nn.Module, groups: list[ExpertShardGroup]) -> None:
    """Register the state-dict hooks of the sharded checkpoint format on ``module``.

    ``groups`` are the groups :func:`shard_expert_weights` made for ``module``
    (their ``names`` are relative to it). ``module.state_dict()`` then gives
    each member as a ``DTensor`` (see the module docstring), and
    ``module.load_state_dict(...)`` turns each member's entry into this rank's
    rows before anything is copied.
    """

    def present(
        module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        if getattr(_plain, "depth", 0):
            return
        for key, group, _ in _member_entries(module, groups, prefix):
            if key in state_dict and not isinstance(state_dict[key], DTensor):
                state_dict[key] = _as_dtensor(group, state_dict[key].detach())

    def accept(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        entries = [e for e in _member_entries(module, groups, prefix) if e[0] in state_dict]
        for key, group, _ in entries:  # every entry checked before a collective or a write
            _check_entry(group, key, state_dict[key])
        state_dict.update((key, _local_rows(group, state_dict[key])) for key, group, _ in entries)

    module.register_state_dict_post_hook(present)
    module.register_load_state_dict_pre_hook(accept)


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` with every sharded expert weight gathered to its full tensor.

    Collective: one all-gather per sharded layer (every rank of each layer's
    process group must call it). Every rank receives the whole state dict;
    the other entries are what ``module.state_dict()`` gives. Save it with
    ``torch.save`` on one rank; load it with :func:`load_full_state_dict` on
    any world size whose rank count divides the sharded out_features, or
    into an unsharded model with ``load_state_dict``.

    Args:
        module: Any module holding sharded expert weights (a whole model, a
            ``DistributedDataParallel`` wrapper: keys are as its
            ``state_dict()`` names them).

    Returns:
        Qualified name to tensor; sharded weights as full ``(N, K)`` /
        ``(E, N, K)`` tensors in their dtype, on their device (fresh memory,
        detached).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    check_module(module)
    with _plain_shards():
        state = module.state_dict()
    for found in sharded_layers(module):
        for name, full in zip(found.names, found.group.gather(), strict=True):
            if name in state:
                state[name] = full
    return state


def load_full_state_dict(
    module: nn.Module, state: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Load full weights (e.g. from :func:`full_state_dict`) into a module with sharded experts.

    Every entry is checked before anything is written: a sharded weight must
    be a tensor of its full shape (each rank keeps its own rows; a ``DTensor``
    of the full shape is accepted too), every other entry must have the shape
    ``module.state_dict()`` gives it, and with ``strict`` the keys must match.
    No collective for plain tensors. Then arms the check that no rank-0
    broadcast (a DDP around a parent) overwrote the loaded shards, from the
    loaded full weights.

    Args:
        module: The module whose experts :func:`shard_expert_weights` sharded
            (over any world size dividing the out_features).
        state: Qualified name to tensor, as ``module.state_dict()`` names them.
        strict: Whether the keys must match ``module.state_dict()``'s exactly.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; ``state`` is not a
            mapping, or one of its entries is not a tensor.
        ValueError: An entry has the wrong shape (the message names the key,
            its shape and the expected one); with ``strict``, keys are missing
            or unexpected. Nothing is written then.
        RuntimeError: A sharded weight's ``DTensor`` is over other ranks or
            holds another rank's rows (``_check_entry``). Nothing is
            written then either.
    """
    check_module(module)
    if not isinstance(state, Mapping):
        raise TypeError(f"state is a {type(state).__name__}, expected a mapping of name to tensor")
    layers = sharded_layers(module)
    with _plain_shards():
        expected = {key: tuple(value.shape) for key, value in module.state_dict().items()}
    expected.update((name, f.group.full_shape) for f in layers for name in f.names)
    for key, value in state.items():
        if key in expected and not isinstance(value, Tensor):
            raise TypeError(f"state[{key!r}] is a {type(value).__name__}, expected a tensor")
        if key in expected and tuple(value.shape) != expected[key]:
            raise ValueError(
                f"state[{key!r}] has shape {tuple(value.shape)}, expected {expected[key]}"
                + (" (the full weight)" if any(key in f.names for f in layers) else "")
            )
    if strict:
        missing = [key for key in expected if key not in state]
        unexpected = [key for key in state if key not in expected]
        if missing or unexpected:
            raise ValueError(
                f"state does not match module's state_dict (strict=True): missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
    for found in layers:  # whose rows a DTensor holds: the load hook of a submodule sharded
        for name in found.names:  # below module would ask only after earlier modules loaded
            if name in state:
                _check_entry(found.group, name, state[name])
    module.load_state_dict(dict(state), strict=strict)
    for found in layers:
        values = [state.get(name) for name in found.names]
        fulls = [v for v in values if isinstance(v, Tensor) and not isinstance(v, DTensor)]
        if len(fulls) == len(values):  # every member loaded from a full tensor
            found.group.arm_broadcast_check(fulls)
