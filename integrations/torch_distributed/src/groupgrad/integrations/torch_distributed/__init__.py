"""groupgrad.integrations.torch_distributed: FSDP-style sharded expert weights on torch.distributed.

A real :class:`~groupgrad.protocol.DistributedWeight` implementer.
:func:`shard_expert_weights` replaces the expert weights of every
:class:`~groupgrad.modules.GroupedLinear` in a module (``GroupedMLP``'s fc1 and
fc2 included) by this rank's rows plus an fp32 ``main_grad`` shard. Each
layer's group leader (a :class:`ShardedExpertWeight`) all-gathers the whole
group once for forward and once for backward, and reduce-scatters the group's
fp32 wgrads into the ``main_grad`` shards once per backward (or per
``backward_dw()``). :func:`gather_full_weights` returns the full weights.

Around it, what a training loop needs without losing rows:
:func:`ddp_ignore_sharded` (``DistributedDataParallel`` for the dense part
leaves sharded experts alone), sharded ``DTensor`` state dicts for
``torch.distributed.checkpoint`` plus :func:`full_state_dict` /
:func:`load_full_state_dict`, and :class:`MasterWeights` (fp32 master copies
for a standard ``torch.optim`` optimizer stepping from ``main_grad``).
"""

__version__ = "0.1.0"

from groupgrad.integrations.torch_distributed._checkpoint import (
    full_state_dict,
    load_full_state_dict,
)
from groupgrad.integrations.torch_distributed._ddp import ddp_ignore_sharded
from groupgrad.integrations.torch_distributed._find import named_sharded_parameters
from groupgrad.integrations.torch_distributed._master import MasterWeights
from groupgrad.integrations.torch_distributed._shard import (
    gather_full_weights,
    shard_expert_weights,
)
from groupgrad.integrations.torch_distributed._shard_group import ExpertShardGroup, GradReduction
from groupgrad.integrations.torch_distributed._weight import ShardedExpertWeight

__all__ = [
    "ExpertShardGroup",
    "GradReduction",
    "MasterWeights",
    "ShardedExpertWeight",
    "ddp_ignore_sharded",
    "full_state_dict",
    "gather_full_weights",
    "load_full_state_dict",
    "named_sharded_parameters",
    "shard_expert_weights",
]
