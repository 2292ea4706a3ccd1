"""groupgrad.integrations.megatron_fsdp: groupgrad layers under Megatron-FSDP.

Megatron-FSDP (the ``megatron-fsdp`` package) shards, gathers and reduces
parameters itself, so this adapter does not use ``DistributedWeight``: the
groupgrad layers honour the parameter-attribute contract Megatron-FSDP sets
(``__fsdp_param__`` + ``get_main_grad()``, ``overwrite_main_grad``,
``grad_added_to_main_grad``) and write each weight gradient straight into the
fp32 bucket ``get_main_grad()`` hands out, which Megatron-FSDP reduces in fp32.

:func:`shard_model` and :func:`shard_optimizer` wrap
``megatron_fsdp.fully_shard_model`` / ``fully_shard_optimizer`` with
validation and a fix for unsharded gradient buffers (ZeRO-1, groups of one
rank), where Megatron-FSDP's ``overwrite_main_grad=True`` would drop earlier
micro-batches. :func:`fp32_grad_policy` is the default precision policy.
:func:`gather_full_weights` and :func:`gather_full_grads` assemble full
tensors from the uneven shards (empty ones included), for inspection and
checkpoints. Megatron-FSDP needs CUDA; :func:`shard_model` says so up front.
"""

__version__ = "0.1.0"

from groupgrad.integrations.megatron_fsdp._gather import gather_full_grads, gather_full_weights
from groupgrad.integrations.megatron_fsdp._shard import (
    fp32_grad_policy,
    shard_model,
    shard_optimizer,
)

__all__ = [
    "fp32_grad_policy",
    "gather_full_grads",
    "gather_full_weights",
    "shard_model",
    "shard_optimizer",
]
