"""One grouped layer's expert weights, sharded by rows: one all-gather, one reduce-scatter.

Legend: ``W`` ranks in the process group, ``E`` experts, ``N`` out_features
(rows), ``K`` in_features, ``n = N / W`` rows each rank keeps.

A *member* is one parameter of the group: a per-expert ``(N, K)`` weight
(shard ``(n, K)``) or a packed ``(E, N, K)`` weight (shard ``(E, n, K)``).
Either way a member is ``R`` row blocks of ``(N, K)`` (``R`` = 1 or ``E``),
and rank ``r`` keeps rows ``r*n … (r+1)*n - 1`` of every block. ``M`` is the
number of members, ``B = M*R`` the group's blocks, ``S = n*K`` the elements of
one rank's slice of one block. Each collective sees one flat buffer:

* **all-gather** (the members' dtype): input ``(B*S,)``, every member's shard
  flattened and concatenated; output ``(W, B, S)``, rank-major, reordered by
  one copy into ``(B, W, S)``: every member's full weight, contiguous.
* **reduce-scatter** (``main_grad``'s dtype, fp32 in mixed precision):
  input ``(W, B, S)``, every member's full wgrad reordered rank-major by one
  copy; output ``(B*S,)``: this rank's rows of every member's reduced wgrad,
  then added to (or copied into) each member's ``main_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from groupgrad.protocol import (
    main_grad_or_none,
    mark_grad_added,
    overwrites_main_grad,
    rezeroes_dummy,
)

__all__ = ["ExpertShardGroup", "GradReduction"]

GradReduction = Literal["sum", "mean"]
"""How ranks' gradients combine: ``"sum"`` (``ReduceOp.SUM``) or ``"mean"`` (``ReduceOp.AVG``)."""

_REDUCE_OPS: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.AVG}


def _collective(new_name: str, old_name: str) -> Callable[..., Any]:
    """The single-tensor collective by its current name (PyTorch >= 2.13) or its older one.

    Looked up at every call, so a test can wrap ``torch.distributed.<name>``.
    """
    found = getattr(dist, new_name, None)
    return found if callable(found) else getattr(dist, old_name)


class ExpertShardGroup:
    """The members of one layer's weight group, each sharded by rows over a process group.

    Every member's :attr:`~ShardedExpertWeight.shard_group` (and the leader's,
    which answers the ``DistributedWeight`` calls) points here.

    Attributes:
        members: The group's parameters, leader first, each holding this
            rank's shard (``shard_shape``), all of one dtype and device.
        full_shape: One member's full shape: ``(N, K)``, or ``(E, N, K)`` packed.
        process_group: The group the rows are sharded over (``None``: the
            default group).
        world_size: ``W``.
        rank: This process's rank in ``process_group``.
        grad_reduction: ``"sum"`` adds the ranks' gradients; ``"mean"``
            averages them (data parallelism over ranks whose losses are means).
        names: Qualified parameter names, leader first, for messages.
    """

    def __init__(
        self,
        full_shape: Sequence[int],
        process_group: dist.ProcessGroup | None,
        grad_reduction: GradReduction,
        names: Sequence[str],
    ) -> None:
        self.members: list[Tensor] = []
        self.full_shape = tuple(int(s) for s in full_shape)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._dummies: list[Tensor] | None = None
        self.grad_reduction: GradReduction = grad_reduction
        self.names = tuple(names)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """One member's shard: ``(n, K)``, or ``(E, n, K)`` packed."""
        *blocks, rows, cols = self.full_shape
        return (*blocks, rows // self.world_size, cols)

    def _layout(self) -> tuple[int, int, int]:
        """``(W, B, S)``: ranks, row blocks of the whole group, elements per rank per block."""
        *blocks, rows, cols = self.full_shape
        per_member = 1
        for size in blocks:
            per_member *= size
        return self.world_size, len(self.members) * per_member, rows // self.world_size * cols

    def gather(self) -> list[Tensor]:
        """All-gather every member's full weight with one collective.

        Collective: every rank of :attr:`process_group` must call it.

        Returns:
            One full-shape tensor per member (``full_shape``, the members'
            dtype), views of one fresh contiguous buffer that nothing else
            keeps: it is freed when the caller drops the views.
        """
        W, B, S = self._layout()
        with torch.no_grad():
            local_BS = torch.cat([member.detach().reshape(-1) for member in self.members])
            gathered_WBS = local_BS.new_empty(W * B * S)
            all_gather = _collective("all_gather_single", "all_gather_into_tensor")
            all_gather(gathered_WBS, local_BS, group=self.process_group)
            full_BWS = gathered_WBS.view(W, B, S).transpose(0, 1).contiguous()
            del gathered_WBS
        return list(full_BWS.view(len(self.members), *self.full_shape).unbind(0))

    def reduce_scatter_grads(self, wgrads: Sequence[Tensor]) -> None:
        """Reduce the members' full wgrads across ranks into this rank's ``main_grad`` shards.

        Collective: one reduce-scatter (``ReduceOp.SUM`` or ``ReduceOp.AVG`` as
        :attr:`grad_reduction` says) of all members at once, in the leader's
        ``main_grad`` dtype (fp32 in mixed precision: a bf16 wgrad is widened
        before the reduction, never rounded). Each member's ``main_grad``
        receives its rows: added, or copied where the member's
        ``overwrite_main_grad`` is truthy (old contents, even NaN, unread);
        then ``grad_added_to_main_grad`` is set ``True``.

        Args:
            wgrads: One full-shape (``full_shape``) gradient per member, leader
                first; not modified.

        Raises:
            ValueError: ``wgrads`` has the wrong number of entries or a wrong shape.
            RuntimeError: A member has no ``main_grad``, or one of the wrong shape.
        """
        if len(wgrads) != len(self.members):
            raise ValueError(
                f"wgrads has {len(wgrads)} entries, expected {len(self.members)} (one per member "
                f"of the group led by {self.names[0]!r})"
            )
        main_grads = [self._main_grad(index) for index in range(len(self.members))]
        for name, wgrad in zip(self.names, wgrads, strict=True):
            if tuple(wgrad.shape) != self.full_shape:
                raise ValueError(
                    f"wgrad of {name!r} has shape {tuple(wgrad.shape)}, expected the full "
                    f"weight's shape {self.full_shape}"
                )
        W, B, S = self._layout()
        reduce_dtype = main_grads[0].dtype
        with torch.no_grad():
            send_WBS = torch.cat(
                [wgrad.to(reduce_dtype).reshape(-1, W, S).transpose(0, 1) for wgrad in wgrads],
                dim=1,
            )
            reduced_BS = send_WBS.new_empty(B * S)
            reduce_scatter = _collective("reduce_scatter_single", "reduce_scatter_tensor")
            reduce_scatter(
                reduced_BS,
                send_WBS.view(-1),
                op=_REDUCE_OPS[self.grad_reduction],
                group=self.process_group,
            )
            del send_WBS
            shard_grads = reduced_BS.view(len(self.members), *self.shard_shape).unbind(0)
            for member, main_grad, shard_grad in zip(
                self.members, main_grads, shard_grads, strict=True
            ):
                if overwrites_main_grad(member):
                    main_grad.copy_(shard_grad)
                else:
                    main_grad.add_(shard_grad)
                mark_grad_added(member)

    def _main_grad(self, index: int) -> Tensor:
        main_grad = main_grad_or_none(self.members[index])
        if main_grad is None:
            raise RuntimeError(
                f"sharded weight {self.names[index]!r} has no main_grad tensor; its reduced "
                "gradient has nowhere to go"
            )
        if tuple(main_grad.shape) != self.shard_shape:
            raise RuntimeError(
                f"main_grad of {self.names[index]!r} has shape {tuple(main_grad.shape)}, "
                f"expected the shard's shape {self.shard_shape}"
            )
        return main_grad

    def autograd_dummies(self) -> list[Tensor]:
        """Zero gradients shaped like each member's shard, for autograd to accumulate.

        ``.detach()`` aliases of buffers allocated zeroed once per group, one
        per member (so a framework that adds into one member's ``.grad`` does
        not touch another's); a buffer is zeroed again before this hand-out
        where the member's ``zero_out_wgrad`` is truthy.
        """
        if self._dummies is None:
            leader = self.members[0]
            zeros = torch.zeros(
                (len(self.members), *self.shard_shape), dtype=leader.dtype, device=leader.device
            )
            self._dummies = list(zeros.unbind(0))
        for member, dummy in zip(self.members, self._dummies, strict=True):
            if rezeroes_dummy(member):
                dummy.zero_()
        return [dummy.detach() for dummy in self._dummies]
