"""``ShardedExpertWeight``: a parameter holding this rank's rows, a ``DistributedWeight``.

Legend: ``W`` ranks, ``E`` experts, ``N`` out_features, ``K`` in_features,
``n = N / W``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from groupgrad.integrations.torch_distributed._shard_group import ExpertShardGroup

__all__ = ["ShardedExpertWeight"]


class ShardedExpertWeight(nn.Parameter):
    """This rank's rows of an expert weight; implements ``groupgrad.protocol.DistributedWeight``.

    The data is the local shard: rows ``rank*n … (rank+1)*n - 1`` of each
    expert, shape ``(n, K)`` (per-expert) or ``(E, n, K)`` (packed). The group
    leader (``weight0``, or the packed ``weight``) answers the protocol's
    group calls for every member of :attr:`shard_group`.

    Attributes:
        shard_group: The layer's :class:`ExpertShardGroup`, shared by all members.
        main_grad: ``(n, K)`` / ``(E, n, K)`` gradient shard (fp32 by default),
            allocated zeroed; reduced gradients are added (or copied, with
            ``overwrite_main_grad``) into it. The optimizer reads it; zero it
            (or set ``overwrite_main_grad``) between steps.
        grad_added_to_main_grad: ``False`` until a reduced gradient lands in
            :attr:`main_grad`, then ``True``.
        overwrite_main_grad: Not set by default (accumulate); set it truthy to
            make the next reductions overwrite :attr:`main_grad`.
    """

    is_distributed_weight = True
    shard_group: ExpertShardGroup
    main_grad: Tensor | None
    grad_added_to_main_grad: bool

    def __new__(
        cls,
        shard: Tensor,
        shard_group: ExpertShardGroup,
        main_grad_dtype: torch.dtype = torch.float32,
        requires_grad: bool = True,
    ) -> ShardedExpertWeight:
        # built whole here: a Parameter subclass needs __new__, and one signature is enough
        weight = super().__new__(cls, shard, requires_grad)
        weight.shard_group = shard_group
        weight.main_grad = torch.zeros(shard.shape, dtype=main_grad_dtype, device=shard.device)
        weight.grad_added_to_main_grad = False
        return weight

    def __deepcopy__(self, memo: dict[int, object]) -> ShardedExpertWeight:
        raise RuntimeError(
            "a ShardedExpertWeight cannot be deep-copied: its shard_group ties it to the other "
            "shards and to a process group; deep-copy the module before shard_expert_weights, or "
            "copy gather_full_weights(module)"
        )

    def materialize_group_for_forward(self) -> list[Tensor]:
        """All-gather the whole group's full weights (one collective) for the forward GEMM.

        Returns:
            One ``(N, K)`` (or ``(E, N, K)``) tensor per member, in the
            members' dtype; fresh memory the caller drops after the GEMM.
        """
        return self.shard_group.gather()

    def materialize_group_for_backward(self) -> list[Tensor]:
        """All-gather the whole group's full weights again (one collective) for dgrad."""
        return self.shard_group.gather()

    def grad_buffer(self) -> Tensor:
        """Return a fresh full-size buffer for this member's wgrad, in the group's grad dtype.

        Allocated at every call (once per backward), uninitialised (the wgrad
        GEMM overwrites it) and not cached: it lives until
        :meth:`finalize_group_grads` has reduced it, so no full-size gradient
        memory stays between backwards.

        Returns:
            ``(N, K)`` (or ``(E, N, K)``) tensor of
            :attr:`ExpertShardGroup.main_grad_dtype` (fp32 by default, whatever
            the weights' dtype): one dtype across the group.
        """
        return torch.empty(
            self.shard_group.full_shape, dtype=self.shard_group.main_grad_dtype, device=self.device
        )

    def finalize_group_grads(
        self, wgrads: Tensor | list[Tensor]
    ) -> Tensor | list[Tensor | None] | None:
        """Reduce-scatter the group's full wgrads into the members' ``main_grad`` shards.

        One collective for the whole group, in ``main_grad``'s dtype, as
        :meth:`ExpertShardGroup.reduce_scatter_grads` describes; sets
        ``grad_added_to_main_grad`` on every member that requires grad (a
        frozen member is never written).

        Args:
            wgrads: A bare full-shape tensor for a one-member group, else one
                per member; not modified.

        Returns:
            What autograd receives (:meth:`ExpertShardGroup.autograd_dummies`):
            the protocol's shared zero dummy for each trainable member,
            ``None`` for a frozen one (a bare entry for a one-member group).
        """
        grads = [wgrads] if isinstance(wgrads, Tensor) else list(wgrads)
        self.shard_group.reduce_scatter_grads(grads)
        dummies = self.shard_group.autograd_dummies()
        return dummies[0] if len(dummies) == 1 else dummies
