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
    autograd_dummies,
    deliver_to_main_grad,
    main_grad_or_none,
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
        names: Parameter names relative to the module given to
            ``shard_expert_weights``, leader first (for messages, the
            state-dict hooks and DDP's ignore list).
        main_grad_dtype: dtype of the wgrad buffers and of the reduce-scatter
            (the dtype ``shard_expert_weights`` gave the ``main_grad`` shards).
    """

    def __init__(
        self,
        full_shape: Sequence[int],
        process_group: dist.ProcessGroup | None,
        grad_reduction: GradReduction,
        names: Sequence[str],
        main_grad_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.members: list[Tensor] = []
        self.full_shape = tuple(int(s) for s in full_shape)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.grad_reduction: GradReduction = grad_reduction
        self.names = tuple(names)
        self.main_grad_dtype = main_grad_dtype
        self._blocks_differed: tuple[bool, ...] | None = None

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
            differed, self._blocks_differed = self._blocks_differed, None
            if differed is not None:  # once after sharding (or loading full weights)
                self._check_not_broadcast(gathered_WBS.view(W, len(self.members), -1), differed)
            full_BWS = gathered_WBS.view(W, B, S).transpose(0, 1).contiguous()
            del gathered_WBS
        return list(full_BWS.view(len(self.members), *self.full_shape).unbind(0))

    def arm_broadcast_check(self, full_weights: Sequence[Tensor]) -> None:
        """Arm the one-time check that no rank-0 broadcast overwrote the shards.

        ``DistributedDataParallel`` broadcasts rank 0's parameters to every
        rank when it is built, unless they are on its ignore list: a wrapper
        around a *parent* of the sharded module would copy rank 0's rows over
        every other rank's. After that, the ranks' row blocks of every member
        are identical, which a member whose row blocks differed when it was
        sharded never is. This records, from the full weights (no
        communication), which members' row blocks differ; the next
        :meth:`gather` compares the gathered blocks (once) and raises if a
        member that differed now has identical blocks on every rank.

        A ``DTensor`` or DCP load does not re-arm it (this rank sees its own
        rows only); the flags from sharding stay until the first gather. A
        checkpoint whose rows are the same on every rank (e.g. all-zero
        experts) loaded that way before the first forward would trip it:
        load such a checkpoint with ``load_full_state_dict``, which re-arms
        it from the loaded full weights.

        Args:
            full_weights: One full-shape weight per member, as every rank
                holds it (e.g. at sharding, or a loaded full checkpoint).
        """
        W = self.world_size
        differed = []
        with torch.no_grad():
            for weight in full_weights:
                *_, rows, cols = weight.shape
                blocks = weight.detach().reshape(-1, W, rows // W * cols)
                differed.append(
                    any(not torch.equal(blocks[:, r], blocks[:, 0]) for r in range(1, W))
                )
        self._blocks_differed = tuple(differed) if any(differed) else None

    def _check_not_broadcast(self, gathered_WMX: Tensor, differed: tuple[bool, ...]) -> None:
        """Raise if a member whose row blocks differed has identical blocks on every rank now."""
        W = self.world_size
        for index, name in enumerate(self.names):
            if not differed[index]:
                continue
            member_WX = gathered_WMX[:, index]
            if all(torch.equal(member_WX[r], member_WX[0]) for r in range(1, W)):
                raise RuntimeError(
                    f"the shards of sharded expert weight {name!r} are identical on all {W} "
                    "ranks, but its rows differed when shard_expert_weights split it: rank 0's "
                    "shard was broadcast over the others' (DistributedDataParallel does this when "
                    "it wraps a parent of the sharded module, for parameters not on its ignore "
                    "list). The weights are now wrong. Rebuild and re-shard the model (or reload a "
                    "checkpoint), then call ddp_ignore_sharded(model) before "
                    "DistributedDataParallel(model) so that DDP leaves sharded experts alone"
                )

    def reduce_scatter_grads(self, wgrads: Sequence[Tensor]) -> None:
        """Reduce the members' full wgrads across ranks into this rank's ``main_grad`` shards.

        Collective: one reduce-scatter (``ReduceOp.SUM`` or ``ReduceOp.AVG`` as
        :attr:`grad_reduction` says) of all members at once, in
        :attr:`main_grad_dtype` (fp32 in mixed precision: a bf16 wgrad is
        widened before the reduction, never rounded). Each member that
        requires grad receives its rows through
        :func:`groupgrad.protocol.deliver_to_main_grad`: added to ``main_grad``,
        or copied where ``overwrite_main_grad`` is truthy (old contents, even
        NaN, unread), then ``grad_added_to_main_grad`` is set ``True``. A
        member with ``requires_grad=False`` is never written (its
        ``main_grad`` and flag stay untouched; it needs no ``main_grad``).

        Args:
            wgrads: One full-shape (``full_shape``) gradient per member, leader
                first; not modified.

        Raises:
            ValueError: ``wgrads`` has the wrong number of entries or a wrong shape.
            RuntimeError: A member that requires grad has no ``main_grad``, or
                one of the wrong shape (checked before the collective).
        """
        if len(wgrads) != len(self.members):
            raise ValueError(
                f"wgrads has {len(wgrads)} entries, expected {len(self.members)} (one per member "
                f"of the group led by {self.names[0]!r})"
            )
        for index, member in enumerate(self.members):
            if member.requires_grad:
                self._check_main_grad(index)
        for name, wgrad in zip(self.names, wgrads, strict=True):
            if tuple(wgrad.shape) != self.full_shape:
                raise ValueError(
                    f"wgrad of {name!r} has shape {tuple(wgrad.shape)}, expected the full "
                    f"weight's shape {self.full_shape}"
                )
        W, B, S = self._layout()
        with torch.no_grad():
            send_WBS = torch.cat(
                [
                    wgrad.to(self.main_grad_dtype).reshape(-1, W, S).transpose(0, 1)
                    for wgrad in wgrads
                ],
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
            for member, name, shard_grad in zip(self.members, self.names, shard_grads, strict=True):
                deliver_to_main_grad(member, shard_grad, name)

    def _check_main_grad(self, index: int) -> None:
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

    def autograd_dummies(self) -> list[Tensor | None]:
        """What autograd receives for each member once its gradient is in ``main_grad``.

        The protocol's one dummy rule (:func:`groupgrad.protocol.autograd_dummies`):
        a zero tensor shaped like the shard, in its grad dtype, a ``.detach()``
        alias of one cached buffer shared by every parameter of that shape
        (frameworks that honour ``grad_added_to_main_grad`` ignore ``.grad``),
        zeroed again before this hand-out when anything wrote into it or
        where ``zero_out_wgrad`` is set. ``None`` for a member that does not
        require grad or carries no ``grad_added_to_main_grad``.
        """
        return autograd_dummies(self.members)
