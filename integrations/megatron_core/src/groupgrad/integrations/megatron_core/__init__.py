"""groupgrad.integrations.megatron_core: groupgrad experts inside Megatron-Core's MoE layer.

Two expert backends for Megatron-Core's ``MoELayer`` (the ``megatron-core``
package, releases 0.16.x and 0.19.x):

* :class:`GroupgradFusedExperts` — all local experts as one fused groupgrad
  ``GroupedMLP`` (fc1 → SwiGLU × router probability → fc2, one backward);
* Megatron's own grouped-experts layer ``TEGroupedMLP`` with
  :class:`GroupgradColumnParallelGroupedLinear` and
  :class:`GroupgradRowParallelGroupedLinear` in its fc1 / fc2 slots (no
  Transformer Engine needed).

Both honour Megatron's ``gradient_accumulation_fusion`` (each wgrad written by
the GEMM straight into Megatron DDP's fp32 ``main_grad``, with
``grad_added_to_main_grad`` and the zero dummy its DDP expects),
``delay_wgrad_compute`` (wgrads at ``backward_dw()``, then the hooks Megatron's
DDP registers), expert parallelism (``allreduce = False``, expert
data-parallel buffers), ``init_method`` per expert, and write distributed
checkpoints that interchange with ``SequentialMLP``'s and ``TEGroupedMLP``'s.
FP8: the fused experts run ``config.fp8="e4m3"`` with
``config.fp8_recipe="blockwise"`` as groupgrad's ``fp8_recipe="blockwise"``
(weights cached per optimizer step through Megatron's
``is_first_microbatch`` flag); any other FP8 setting, FP8 on the grouped
linears, FP4 and expert tensor parallelism are refused at construction.

Specs in Megatron's style: :func:`get_gpt_layer_groupgrad_spec` (a GPT layer),
:func:`get_moe_module_groupgrad_spec` (an MoE layer),
:func:`get_groupgrad_experts_spec` (the experts entry) and
:class:`GroupgradSpecProvider` (a backend for Megatron's spec builders).

``MEGATRON_CORE_VERSION`` is the installed release as ``(major, minor)``;
``SUPPORTED_RELEASES`` maps the supported ones, ``(0, 16)`` and ``(0, 19)``,
to the Python they need. Importing the package on another release raises
``ImportError``.
"""

__version__ = "0.1.0"

from groupgrad.integrations.megatron_core._compat import MEGATRON_CORE_VERSION, SUPPORTED_RELEASES
from groupgrad.integrations.megatron_core._experts import GroupgradFusedExperts
from groupgrad.integrations.megatron_core._linear import (
    GroupgradColumnParallelGroupedLinear,
    GroupgradGroupedLinear,
    GroupgradRowParallelGroupedLinear,
)
from groupgrad.integrations.megatron_core._specs import (
    GroupgradMoELayer,
    GroupgradSpecProvider,
    get_gpt_layer_groupgrad_spec,
    get_groupgrad_experts_spec,
    get_moe_module_groupgrad_spec,
)

__all__ = [
    "MEGATRON_CORE_VERSION",
    "SUPPORTED_RELEASES",
    "GroupgradColumnParallelGroupedLinear",
    "GroupgradFusedExperts",
    "GroupgradGroupedLinear",
    "GroupgradMoELayer",
    "GroupgradRowParallelGroupedLinear",
    "GroupgradSpecProvider",
    "get_gpt_layer_groupgrad_spec",
    "get_groupgrad_experts_spec",
    "get_moe_module_groupgrad_spec",
]
