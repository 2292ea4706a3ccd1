"""Expert parameters the Megatron way: where they live, how they are initialized, what they carry.

What Megatron's own expert linears (``ColumnParallelLinear`` /
``RowParallelLinear`` with ``is_expert=True``, inside ``SequentialMLP``) do,
done here for every expert of a groupgrad layer:

* device: the CPU with ``use_cpu_initialization``, else
  ``torch.cuda.current_device()``; dtype ``params_dtype``;
* weights: each expert's ``(out, in)`` weight initialized by the layer's
  ``init_method`` on its own — through an fp32 master copy on the CPU
  (``_initialize_affine_weight_cpu``) or under the expert-parallel RNG
  tracker on the device (``_initialize_affine_weight_gpu``) — only when
  ``perform_initialization``; the tensor-parallel attributes are set either
  way; biases are zeroed;
* ``allreduce = not (expert_model_parallel_size > 1)`` on every parameter, so
  Megatron's DDP puts expert-parallel parameters in its expert data-parallel
  buffers;
* with ``delay_wgrad_compute``, ``skip_backward_post_hook = True`` on every
  weight, so Megatron's DDP (``ddp_config.delay_wgrad_compute=True``) hands
  its gradient hook to the layer's ``register_wgrad_accumulation_and_reduce_hooks``
  instead of autograd; the layer fires it after ``backward_dw()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from torch import Tensor

__all__ = ["expert_device", "setup_expert_parameters"]


def expert_device(config: Any) -> torch.device:
    """Where Megatron puts expert parameters: the CPU with ``use_cpu_initialization``, else the GPU.

    The GPU is ``torch.cuda.current_device()``, as for Megatron's own layers.
    """
    if config.use_cpu_initialization:
        return torch.device("cpu")
    return torch.device(torch.cuda.current_device())


def setup_expert_parameters(
    weights: Sequence[Tensor],
    biases: Sequence[Tensor],
    *,
    config: Any,
    init_method: Callable[[Tensor], Any],
    partition_dim: int,
) -> None:
    """Initialize one grouped layer's experts and set the attributes Megatron's DDP reads.

    Args:
        weights: The ``E`` per-expert ``(out, in)`` weight parameters.
        biases: Their ``(out,)`` biases (empty without bias).
        config: Megatron's ``TransformerConfig``.
        init_method: Called on each expert's weight (``config.init_method``
            for fc1, ``config.output_layer_init_method`` for fc2).
        partition_dim: The tensor-parallel partition dimension of a weight:
            0 for a column-parallel layer (fc1), 1 for a row-parallel one
            (fc2). Expert tensor parallelism is 1, so it only labels the
            parameters as Megatron's own layers do.

    Mutates ``weights`` and ``biases`` in place (values and attributes).
    """
    for weight in weights:
        out_features, in_features = weight.shape
        if not config.perform_initialization:
            set_tensor_model_parallel_attributes(weight, True, partition_dim, 1)
        elif config.use_cpu_initialization:
            per_partition = out_features if partition_dim == 0 else in_features
            _initialize_affine_weight_cpu(
                weight,
                out_features,
                in_features,
                per_partition,
                partition_dim,
                init_method,
                params_dtype=config.params_dtype,
                rank=0,
                world_size=1,
            )
        else:
            _initialize_affine_weight_gpu(weight, init_method, partition_dim, is_expert=True)
    with torch.no_grad():
        for bias in biases:
            bias.zero_()
    expert_parallel = config.expert_model_parallel_size > 1
    for param in (*weights, *biases):
        param.allreduce = not expert_parallel  # type: ignore[attr-defined]
    if config.delay_wgrad_compute:
        for weight in weights:
            weight.skip_backward_post_hook = True  # type: ignore[attr-defined]
