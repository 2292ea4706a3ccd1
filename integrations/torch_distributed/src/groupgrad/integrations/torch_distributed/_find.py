"""Find the grouped layers of a module, and the sharded weight groups among them."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from groupgrad.integrations.torch_distributed._shard_group import ExpertShardGroup
from groupgrad.integrations.torch_distributed._weight import ShardedExpertWeight
from groupgrad.modules import GroupedLinear

__all__ = [
    "ShardedLayer",
    "check_module",
    "grouped_layers",
    "named_sharded_parameters",
    "qualified",
    "sharded_layers",
]


def check_module(module: object, argument: str = "module") -> nn.Module:
    """Return ``module`` if it is an ``nn.Module``; else raise a ``TypeError`` naming ``argument``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{argument} is a {type(module).__name__}, expected a torch.nn.Module")
    return module


def qualified(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the root."""
    return f"{prefix}.{name}" if prefix else name


def grouped_layers(module: nn.Module) -> list[tuple[str, GroupedLinear]]:
    """Every ``GroupedLinear`` in ``module`` (itself included), with its qualified name.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    check_module(module)
    return [(name, m) for name, m in module.named_modules() if isinstance(m, GroupedLinear)]


@dataclass(frozen=True)
class ShardedLayer:
    """A ``GroupedLinear`` whose weights ``shard_expert_weights`` sharded, seen from some module.

    Attributes:
        layer: The layer.
        group: Its :class:`ExpertShardGroup`.
        names: Its members' names qualified from the module it was found in
            (leader first; ``group.names`` are relative to the module that was
            sharded, which may be another one).
    """

    layer: GroupedLinear
    group: ExpertShardGroup
    names: tuple[str, ...]


def sharded_layers(module: nn.Module) -> list[ShardedLayer]:
    """Every sharded ``GroupedLinear`` in ``module``, in ``named_modules()`` order.

    A layer counts when its leader is a :class:`ShardedExpertWeight` and every
    member of the leader's group is still the layer's parameter of that name.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    found = []
    for prefix, layer in grouped_layers(module):
        leader = getattr(layer, layer.weight_names[0])
        if not isinstance(leader, ShardedExpertWeight):
            continue
        group = leader.shard_group
        members = [getattr(layer, name) for name in layer.weight_names]
        if len(members) != len(group.members) or any(
            a is not b for a, b in zip(members, group.members, strict=True)
        ):
            continue
        names = tuple(qualified(prefix, name) for name in layer.weight_names)
        found.append(ShardedLayer(layer, group, names))
    return found


def named_sharded_parameters(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Every parameter of ``module`` that :func:`shard_expert_weights` sharded, with its name.

    Leaders, followers and ``leader_only`` plain followers alike, named as
    ``module.named_parameters()`` names them, in ``named_modules()`` order.
    These parameters hold this rank's rows and receive their gradients in
    ``main_grad``; nothing else (DDP, an optimizer reading ``.grad``) should
    reduce or read their ``.grad``.

    Args:
        module: Any module (e.g. a whole model whose experts were sharded).

    Returns:
        ``[(qualified name, parameter), ...]``; empty when nothing in
        ``module`` is sharded.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    return [
        (name, member)
        for found in sharded_layers(module)
        for name, member in zip(found.names, found.group.members, strict=True)
    ]
