"""groupgrad.integrations.fsdp2: groupgrad layers under PyTorch FSDP2, fp32 wgrads into its reduce-scatter.

:func:`fully_shard` is FSDP2's own ``torch.distributed.fsdp.fully_shard``,
with FSDP2's arguments, plus one thing: each time FSDP2 unshards a unit for
forward, its unsharded parameters get ``grad_dtype = mp_policy.reduce_dtype``.
groupgrad's grouped GEMMs then write their weight gradients in that dtype
straight from the epilogue (bf16 operands, fp32 output), so FSDP2
reduce-scatters gradients that were never rounded to bf16 — with plain FSDP2
every element of its fp32 reduce-scatter input is a bf16 value upcast.
Unsupported setups are rejected when the unit is sharded, with a message that
says what to change.
"""

__version__ = "0.1.0"

from groupgrad.integrations.fsdp2._shard import fully_shard

__all__ = ["fully_shard"]
