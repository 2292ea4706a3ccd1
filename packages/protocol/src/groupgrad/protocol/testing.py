"""An in-process ``DistributedWeight`` implementer for tests.

:class:`FakeDistributedWeight` behaves like a real sharded weight without any
process group: its materializations scale the stored weight (so a test can see
which materialization a GEMM used), and its ``finalize_group_grads`` records
what it received and delivers it the way a real implementer would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

import torch

from groupgrad.protocol._attrs import deliver_to_main_grad, main_grad_or_none

__all__ = ["FakeDistributedWeight", "make_fake_group"]

FinalizeReturn = Literal["dummy", "grads", "none"]


class FakeDistributedWeight(torch.nn.Parameter):
    """A parameter that implements :class:`~groupgrad.protocol.DistributedWeight`.

    The leader of a group holds ``group`` (all members, itself first); a
    follower may be a plain parameter or another ``FakeDistributedWeight``.

    Attributes:
        group: The members the leader answers for (leader first).
        forward_scale: Materialization for forward returns ``scale * weight``.
        backward_scale: Materialization for backward returns ``scale * weight``.
        finalize_returns: What ``finalize_group_grads`` returns: ``"dummy"``
            (zeros shaped like each member), ``"grads"`` (the gradients
            themselves, cast to each member's dtype) or ``"none"``.
        add_to_main_grad: When ``True``, ``finalize_group_grads`` delivers each
            gradient into the member's ``main_grad`` (if it has one) with
            :func:`~groupgrad.protocol.deliver_to_main_grad` — added, or copied
            where ``overwrite_main_grad`` is set, then flagged — as a reducing
            implementer would; members that do not require grad are skipped.
        provides_grad_buffer: Whether :meth:`grad_buffer` hands out a buffer
            typed like ``main_grad``; ``False`` makes it return ``None`` (the
            member then gets scratch).
        calls: Counts of each protocol method call.
        finalized: Every ``wgrads`` argument ``finalize_group_grads`` received,
            as a list of (detached clones of) tensors.
    """

    is_distributed_weight = True

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> FakeDistributedWeight:
        return super().__new__(cls, data, requires_grad)

    def __init__(self, data: torch.Tensor, requires_grad: bool = True) -> None:
        self.group: list[torch.Tensor] = [self]
        self.forward_scale = 2.0
        self.backward_scale = 4.0
        self.finalize_returns: FinalizeReturn = "dummy"
        self.add_to_main_grad = True
        self.provides_grad_buffer = True
        self.calls: dict[str, int] = {
            "materialize_group_for_forward": 0,
            "materialize_group_for_backward": 0,
            "finalize_group_grads": 0,
            "grad_buffer": 0,
        }
        self.finalized: list[list[torch.Tensor]] = []

    def _scaled(self, scale: float) -> list[torch.Tensor]:
        return [member.detach() * scale for member in self.group]

    def materialize_group_for_forward(self) -> list[torch.Tensor]:
        """Return ``forward_scale * member`` for every member of the group."""
        self.calls["materialize_group_for_forward"] += 1
        return self._scaled(self.forward_scale)

    def materialize_group_for_backward(self) -> list[torch.Tensor]:
        """Return ``backward_scale * member`` for every member of the group."""
        self.calls["materialize_group_for_backward"] += 1
        return self._scaled(self.backward_scale)

    def grad_buffer(self) -> torch.Tensor | None:
        """Return a fresh buffer shaped like the weight, typed like ``main_grad`` (or ``None``)."""
        self.calls["grad_buffer"] += 1
        if not self.provides_grad_buffer:
            return None
        main_grad = main_grad_or_none(self)
        dtype = main_grad.dtype if main_grad is not None else self.dtype
        return torch.full(self.shape, float("nan"), dtype=dtype, device=self.device)

    def finalize_group_grads(
        self, wgrads: torch.Tensor | list[torch.Tensor]
    ) -> list[torch.Tensor | None] | torch.Tensor | None:
        """Record ``wgrads``, optionally add them into ``main_grad``, and answer as configured."""
        self.calls["finalize_group_grads"] += 1
        grads = [wgrads] if isinstance(wgrads, torch.Tensor) else list(wgrads)
        self.finalized.append([grad.detach().clone() for grad in grads])
        if self.add_to_main_grad:
            for index, (member, grad) in enumerate(zip(self.group, grads, strict=True)):
                if main_grad_or_none(member) is not None:
                    deliver_to_main_grad(member, grad, f"member {index}")
        if self.finalize_returns == "none":
            return None
        answers: list[torch.Tensor | None]
        if self.finalize_returns == "dummy":
            answers = [torch.zeros_like(member) for member in self.group]
        else:
            answers = [
                grad.to(member.dtype) for member, grad in zip(self.group, grads, strict=True)
            ]
        return answers[0] if len(answers) == 1 else answers


def make_fake_group(
    tensors: Sequence[torch.Tensor],
    *,
    leader_only: bool = False,
    main_grad_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Turn tensors into a distributed group led by a :class:`FakeDistributedWeight`.

    Args:
        tensors: The members' initial values.
        leader_only: When ``True`` only the leader implements the protocol and
            the followers are plain ``torch.nn.Parameter`` objects.
        main_grad_dtype: When given, every member gets a zeroed ``main_grad``
            of this dtype and ``grad_added_to_main_grad = False``.

    Returns:
        The members, leader first; the leader's ``group`` is this list.
    """
    members: list[torch.Tensor] = []
    for index, tensor in enumerate(tensors):
        if index == 0 or not leader_only:
            members.append(FakeDistributedWeight(tensor.detach().clone()))
        else:
            members.append(torch.nn.Parameter(tensor.detach().clone()))
    for member in members:
        if main_grad_dtype is not None:
            member.main_grad = torch.zeros(  # type: ignore[attr-defined]
                member.shape, dtype=main_grad_dtype, device=member.device
            )
            member.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    leader = cast(FakeDistributedWeight, members[0])
    leader.group = members
    return members
