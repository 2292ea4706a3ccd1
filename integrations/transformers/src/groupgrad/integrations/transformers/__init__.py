"""groupgrad.integrations.transformers: a ``"groupgrad"`` experts implementation for transformers.

Importing this package registers ``"groupgrad"`` in transformers' experts
implementation registry (:func:`register`, idempotent), so::

    import groupgrad.integrations.transformers  # registers "groupgrad"

    model.set_experts_implementation("groupgrad")

runs the experts of Qwen3-MoE, Mixtral and the other ``@use_experts_implementation``
models on groupgrad's grouped GEMMs: the fused :func:`~groupgrad.modules.grouped_mlp`
for concatenated SwiGLU experts, two :func:`~groupgrad.modules.grouped_linear`
around the model's own gate otherwise (:func:`experts_route` says which).
Weight gradients reach autograd in each expert parameter's ``grad_dtype``
straight from the GEMM epilogue (fp32 for bf16 weights whose ``grad_dtype``
is fp32, e.g. under ``groupgrad.integrations.fsdp2.fully_shard``).

``"groupgrad_fp8"`` (:data:`FP8_IMPLEMENTATION`) runs the same experts with
their GEMMs in blockwise FP8 (:func:`groupgrad_fp8_experts_forward`).

Supported: transformers 5.17 through 5.24 (:data:`SUPPORTED_TRANSFORMERS`);
other releases fail at import with a message naming the installed version.
"""

__version__ = "0.1.0"

from groupgrad.integrations.transformers._forward import (
    groupgrad_experts_forward,
    groupgrad_fp8_experts_forward,
    tokens_per_expert,
)
from groupgrad.integrations.transformers._register import (
    FP8_IMPLEMENTATION,
    IMPLEMENTATION,
    register,
)
from groupgrad.integrations.transformers._route import ExpertsRoute, experts_route
from groupgrad.integrations.transformers._version import (
    SUPPORTED_TRANSFORMERS,
    check_transformers_version,
)

__all__ = [
    "FP8_IMPLEMENTATION",
    "IMPLEMENTATION",
    "SUPPORTED_TRANSFORMERS",
    "ExpertsRoute",
    "check_transformers_version",
    "experts_route",
    "groupgrad_experts_forward",
    "groupgrad_fp8_experts_forward",
    "register",
    "tokens_per_expert",
]

register()
