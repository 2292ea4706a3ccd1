"""groupgrad.integrations.torch_distributed: FSDP-style sharded expert weights on torch.distributed.

A real :class:`~groupgrad.protocol.DistributedWeight` implementer.
:func:`shard_expert_weights` replaces the expert weights of every
:class:`~groupgrad.modules.GroupedLinear` in a module (``GroupedMLP``'s fc1 and
fc2 included) by this rank's rows plus an fp32 ``main_grad`` shard. Each
layer's group leader (a :class:`ShardedExpertWeight`) all-gathers the whole
group once for forward and once for backward, and reduce-scatters the group's
fp32 wgrads into the ``main_grad`` shards once per backward (or per
``backward_dw()``). :func:`gather_full_weights` returns the full weights.
"""

from groupgrad.integrations.torch_distributed._shard import (
    gather_full_weights,
    shard_expert_weights,
)
from groupgrad.integrations.torch_distributed._shard_group import ExpertShardGroup, GradReduction
from groupgrad.integrations.torch_distributed._weight import ShardedExpertWeight

__all__ = [
    "ExpertShardGroup",
    "GradReduction",
    "ShardedExpertWeight",
    "gather_full_weights",
    "shard_expert_weights",
]
