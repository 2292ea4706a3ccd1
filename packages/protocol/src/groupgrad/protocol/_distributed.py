"""The ``DistributedWeight`` protocol and the dispatchers that route a group through it.

A *group* is the list of weights one grouped GEMM uses (one per expert, or a
single packed ``(E, N, K)`` weight). Its first member, the **leader**, decides
whether the group is distributed: a leader that implements
:class:`DistributedWeight` materializes and finalizes the whole group at once;
its followers may be plain tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from groupgrad.protocol._attrs import main_grad_or_none

__all__ = [
    "DistributedWeight",
    "WeightGroup",
    "as_weight_list",
    "finalize_members",
    "finalize_weight_grads",
    "is_distributed_weight",
    "materialize_weight_for_backward",
    "materialize_weight_for_forward",
    "members_grad_dtype",
    "weight_grad_dtype",
]

WeightGroup = torch.Tensor | Sequence[torch.Tensor]
"""A bare weight (a one-member group) or a sequence of weights, leader first."""

_LEADER_METHODS = (
    "materialize_group_for_forward",
    "materialize_group_for_backward",
    "finalize_group_grads",
)


@runtime_checkable
class DistributedWeight(Protocol):
    """A weight whose storage and gradient reduction belong to someone else.

    Implementers must be :class:`torch.Tensor` subclasses (usually
    ``torch.nn.Parameter`` subclasses holding a shard). The leader of a group
    (its first weight) answers for the whole group:

    Attributes:
        is_distributed_weight: ``True``; the capability flag the dispatchers test.
    """

    is_distributed_weight: bool

    def materialize_group_for_forward(self) -> torch.Tensor | Sequence[torch.Tensor]:
        """Return the full weights of the whole group for the forward GEMM.

        Returns:
            One tensor per group member (a bare tensor is accepted for a
            one-member group), each of the full, unsharded shape.
        """
        ...

    def materialize_group_for_backward(self) -> torch.Tensor | Sequence[torch.Tensor]:
        """Return the full weights of the whole group again for the backward GEMMs."""
        ...

    def finalize_group_grads(
        self, wgrads: torch.Tensor | list[torch.Tensor]
    ) -> torch.Tensor | Sequence[torch.Tensor | None] | None:
        """Take the group's weight gradients once they exist, e.g. to reduce-scatter them.

        Args:
            wgrads: A bare tensor for a one-member group, else a list with one
                full-shape gradient per member.

        Returns:
            What autograd receives for the group: one entry per member
            (dummies or real reduced gradients), a bare tensor for a one-member
            group, or ``None`` when an asynchronous collective owns the result.
        """
        ...

    def grad_buffer(self) -> torch.Tensor:
        """Return the buffer the wgrad GEMM should overwrite for this member (optional)."""
        ...


def is_distributed_weight(obj: object) -> bool:
    """Tell whether ``obj`` claims the :class:`DistributedWeight` capability.

    Args:
        obj: Anything; usually a parameter.

    Returns:
        ``True`` when ``obj`` is a tensor whose ``is_distributed_weight``
        attribute is truthy, ``False`` otherwise.

    Raises:
        TypeError: ``obj`` claims the capability but is not a ``torch.Tensor``.
    """
    claims = bool(getattr(obj, "is_distributed_weight", False))
    if claims and not isinstance(obj, torch.Tensor):
        raise TypeError(
            f"{type(obj).__name__} object claims is_distributed_weight=True but is not a "
            "torch.Tensor; DistributedWeight implementers must be torch.Tensor subclasses"
        )
    return claims


def as_weight_list(weights: WeightGroup, name: str = "weights") -> list[torch.Tensor]:
    """Return ``weights`` as a list of the same tensor objects (a bare tensor becomes one entry).

    Raises:
        TypeError: ``weights`` is neither a tensor nor a sequence of tensors.
        ValueError: ``weights`` is empty.
    """
    if isinstance(weights, torch.Tensor):
        return [weights]
    if not isinstance(weights, Sequence) or isinstance(weights, str | bytes):
        raise TypeError(
            f"{name} must be a torch.Tensor or a sequence of tensors, got {type(weights).__name__}"
        )
    members = list(weights)
    if not members:
        raise ValueError(f"{name} is empty; expected at least one weight")
    if all(map(isinstance, members, itertools.repeat(torch.Tensor))):  # one pass, no Python loop
        return members
    index, member = next((i, m) for i, m in enumerate(members) if not isinstance(m, torch.Tensor))
    raise TypeError(f"{name}[{index}] is a {type(member).__name__}, expected a torch.Tensor")


def _leader_method(leader: torch.Tensor, method: str) -> Any:
    bound = getattr(leader, method, None)
    if not callable(bound):
        raise TypeError(
            f"weights[0] ({type(leader).__name__}) claims is_distributed_weight=True but has no "
            f"callable {method}(); a DistributedWeight leader must implement "
            + ", ".join(f"{m}()" for m in _LEADER_METHODS)
        )
    return bound


def _as_group_list(result: object, count: int, source: str) -> list[Any]:
    """Normalize what a leader returned for its group into exactly ``count`` entries."""
    if result is None:
        return [None] * count
    if isinstance(result, torch.Tensor):
        entries: list[Any] = [result]
    elif isinstance(result, Sequence) and not isinstance(result, str | bytes):
        entries = list(result)
    else:
        raise TypeError(
            f"{source} returned a {type(result).__name__}; expected a tensor, a sequence of "
            f"tensors or None"
        )
    if len(entries) != count:
        raise RuntimeError(
            f"{source} returned {len(entries)} entries for a group of {count} weights; "
            f"expected exactly {count}"
        )
    return entries


def _materialize(weights: WeightGroup, method: str) -> list[torch.Tensor]:
    members = as_weight_list(weights)
    leader = members[0]
    if not is_distributed_weight(leader):
        return members
    result = _leader_method(leader, method)()
    if result is None:
        raise RuntimeError(f"weights[0].{method}() returned None; expected the group's weights")
    materialized = _as_group_list(result, len(members), f"weights[0].{method}()")
    for index, tensor in enumerate(materialized):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"weights[0].{method}() returned a {type(tensor).__name__} for member {index}; "
                "expected a torch.Tensor"
            )
    return materialized


def materialize_weight_for_forward(weights: WeightGroup) -> list[torch.Tensor]:
    """Return the weights the forward GEMM should use, one per group member.

    A distributed leader materializes the whole group once (e.g. all-gathers
    its shards); plain weights pass through unchanged (the same objects).

    Args:
        weights: The group, leader first; a bare weight is a one-member group.

    Returns:
        A list of ``len(weights)`` tensors.

    Raises:
        RuntimeError: The leader returned a different number of weights.
        TypeError: The leader claims the capability without implementing it.
    """
    return _materialize(weights, "materialize_group_for_forward")


def materialize_weight_for_backward(weights: WeightGroup) -> list[torch.Tensor]:
    """Return the weights the backward GEMMs should use, one per group member.

    Same rules as :func:`materialize_weight_for_forward`, through the leader's
    ``materialize_group_for_backward()``.
    """
    return _materialize(weights, "materialize_group_for_backward")


def finalize_weight_grads(
    weights: WeightGroup, wgrads: torch.Tensor | Sequence[torch.Tensor]
) -> list[Any]:
    """Hand the group's weight gradients to a distributed leader and normalize its answer.

    Args:
        weights: The group, leader first.
        wgrads: One gradient per member (a bare tensor for a one-member group).

    Returns:
        Distributed group: the leader's ``finalize_group_grads`` result as
        exactly ``len(weights)`` entries (``None`` expands to that many
        ``None``). Plain group: ``wgrads`` unchanged.

    Raises:
        ValueError: ``wgrads`` does not have one entry per weight.
        RuntimeError: The leader returned a different number of entries.
    """
    return finalize_members(as_weight_list(weights), wgrads)


def finalize_members(
    members: list[torch.Tensor], wgrads: torch.Tensor | Sequence[torch.Tensor]
) -> list[Any]:
    """:func:`finalize_weight_grads` for a group already normalized by :func:`as_weight_list`."""
    leader = members[0]
    if not is_distributed_weight(leader):
        return wgrads  # type: ignore[return-value]
    grads = [wgrads] if isinstance(wgrads, torch.Tensor) else list(wgrads)
    if len(grads) != len(members):
        raise ValueError(
            f"wgrads has {len(grads)} entries but the group has {len(members)} weights"
        )
    argument: torch.Tensor | list[torch.Tensor] = grads[0] if len(members) == 1 else grads
    result = _leader_method(leader, "finalize_group_grads")(argument)
    return _as_group_list(result, len(members), "weights[0].finalize_group_grads()")


def weight_grad_dtype(weights: WeightGroup, compute_dtype: torch.dtype) -> torch.dtype:
    """Return the dtype the group's wgrad GEMM should produce.

    Args:
        weights: The group, leader first.
        compute_dtype: The GEMM's input dtype (e.g. ``torch.bfloat16``).

    Returns:
        Distributed group: the leader's ``main_grad.dtype`` when it has a
        non-``None`` ``main_grad`` (usually ``torch.float32``, so the
        reduce-scatter that follows does not round), else ``compute_dtype``.
        Plain group: ``compute_dtype``.
    """
    return members_grad_dtype(as_weight_list(weights), compute_dtype)


def members_grad_dtype(members: list[torch.Tensor], compute_dtype: torch.dtype) -> torch.dtype:
    """:func:`weight_grad_dtype` for a group already normalized by :func:`as_weight_list`."""
    leader = members[0]
    if is_distributed_weight(leader):
        main_grad = main_grad_or_none(leader)
        if main_grad is not None:
            return main_grad.dtype
    return compute_dtype
