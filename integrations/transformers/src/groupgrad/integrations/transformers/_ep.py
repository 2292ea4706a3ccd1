"""Expert parallelism: transformers' ``Shard(0)`` experts, their local shards, and ``grad_dtype``.

Under transformers' expert parallelism (``DistributedConfig(ep_size=...)``)
each experts parameter is a ``DTensor`` sharded by expert, and the EP forward
swaps it for its local shard (``DTensor.to_local()``, a non-leaf) while the
experts run: the experts forward sees ``num_experts`` local experts, local
ids, and ``num_experts`` itself as the "no expert" sentinel.

The gradient of a non-leaf reaches autograd in the non-leaf's own dtype: a
bf16 shard's fp32 weight gradient would be rounded to bf16 on its way back to
a ``DTensor`` that asked for fp32 (``grad_dtype``). So when the ``DTensor``
asks for a dtype other than its own, the grouped GEMMs get a fresh leaf over
the same local storage, with that ``grad_dtype``: they write the gradient in
it straight from the epilogue, and when it lands it is added to the
``DTensor``'s ``.grad`` as autograd would (``accumulate_grads_like_autograd``:
in ``grad_dtype``, post-accumulate hooks run). Otherwise the shard is used as
it is and autograd carries the gradient back unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from groupgrad.protocol import accumulate_grads_like_autograd

__all__ = ["check_expert_parallel_layout", "local_expert_weight"]


def check_expert_parallel_layout(experts: nn.Module) -> None:
    """Refuse expert parallelism combined with FSDP sharding or replication.

    With ``fsdp_size`` or ``dp_replicate_size`` above 1 the expert gradients
    also go through FSDP's reduction, and no test shows them arriving there
    in fp32 yet; EP alone (``fsdp_size=1``: ``tp_size == ep_size``) is what
    groupgrad runs.

    Raises:
        RuntimeError: The model's ``DistributedConfig`` combines ``ep_size``
            with ``fsdp_size`` or ``dp_replicate_size`` above 1 (named).
    """
    distributed = getattr(getattr(experts, "config", None), "distributed_config", None)
    if distributed is None:
        return
    sizes = {name: int(getattr(distributed, name, 1) or 1) for name in _SHARDED_DATA}
    if any(size > 1 for size in sizes.values()):
        combination = ", ".join(f"{name}={size}" for name, size in sizes.items())
        raise RuntimeError(
            f"{type(experts).__name__} runs expert-parallel (ep_size="
            f"{getattr(distributed, 'ep_size', '?')}) with {combination}: groupgrad's experts "
            "support expert parallelism without FSDP (fsdp_size=1, tp_size=ep_size); use "
            'experts_implementation="grouped_mm" for EP with FSDP'
        )


_SHARDED_DATA = ("fsdp_size", "dp_replicate_size")


def _sharded_parameter(local: Tensor) -> DTensor | None:
    """The ``DTensor`` leaf whose ``to_local()`` gave ``local``, if that is where it came from."""
    node = local.grad_fn
    if node is None:
        return None
    for parent, _ in node.next_functions:
        owner = getattr(parent, "variable", None)  # an AccumulateGrad node holds its leaf
        if isinstance(owner, DTensor):
            return owner
    return None


def local_expert_weight(local: Tensor) -> Tensor:
    """The tensor the grouped GEMMs should take for an expert-parallel module's weight.

    Args:
        local: The module's weight attribute during transformers' EP forward
            (the ``DTensor`` parameter's local shard).

    Returns:
        ``local`` itself, unless its ``DTensor`` parameter asks for a gradient
        dtype other than its own: then a new leaf over the same storage with
        that ``grad_dtype``, whose gradient is handed to the ``DTensor``'s
        ``.grad`` when it lands.
    """
    if not torch.is_grad_enabled():
        return local
    param = _sharded_parameter(local)
    wanted = None if param is None else param.grad_dtype
    if param is None or wanted is None or wanted == param.dtype:
        return local
    leaf = local.detach().requires_grad_(True)
    leaf.grad_dtype = wanted

    def deliver(shard: Tensor) -> None:
        grad, shard.grad = shard.grad, None
        if grad is None:
            return
        sharded = DTensor.from_local(
            grad,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
        accumulate_grads_like_autograd([param], [sharded])

    leaf.register_post_accumulate_grad_hook(deliver)
    return leaf
