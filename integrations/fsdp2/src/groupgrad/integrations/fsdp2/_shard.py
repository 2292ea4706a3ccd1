"""``fully_shard``: FSDP2's own, with weight gradients reaching its reduce-scatter in ``reduce_dtype``."""

from __future__ import annotations

from typing import Any, overload

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from groupgrad.integrations.fsdp2._route import (
    UnshardedGradDtype,
    managed_slots,
    plain_param_slots,
)
from groupgrad.integrations.fsdp2._validate import (
    UNIT_MARK,
    LayerFlags,
    check_grad_dtype_support,
    check_layers,
    check_modules,
    check_nested_units,
    check_plain_parameters,
    check_reduce_dtype,
    check_uniform_dtype,
    groupgrad_layers,
    mp_policy_of,
)

__all__ = ["fully_shard"]


@overload
def fully_shard(module: nn.Module, **fsdp_kwargs: Any) -> FSDPModule: ...


@overload
def fully_shard(module: list[nn.Module], **fsdp_kwargs: Any) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module], **fsdp_kwargs: Any
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module`` with FSDP2 so groupgrad wgrads reach the reduce-scatter in ``reduce_dtype``.

    Calls :func:`torch.distributed.fsdp.fully_shard` with exactly the given
    arguments (``mesh``, ``reshard_after_forward``, ``mp_policy``,
    ``offload_policy``, ``ignored_params``, ...) and returns what it returns:
    ``module`` itself, now an ``FSDPModule``. Apply it as FSDP2 is applied —
    per block (each transformer or MoE block), then on the root — to every
    unit of the model.

    On top of FSDP2, every unsharded parameter of the unit gets
    ``grad_dtype = mp_policy.reduce_dtype`` each time FSDP2 unshards the unit
    for forward. Then the grouped GEMMs of groupgrad layers (``GroupedLinear``,
    ``GroupedMLP``, and the functional ``grouped_linear`` / ``grouped_mlp``
    on the unit's own parameters, e.g. Hugging Face experts) write their
    weight and bias gradients in ``reduce_dtype`` straight from the epilogue
    (bf16 operands, fp32 output; never rounded to bf16), and autograd casts
    every other gradient of the unit (a router ``nn.Linear``, norms) to it, so
    the unit reduce-scatters one dtype as FSDP2 requires. Gradient
    accumulation with ``set_requires_gradient_sync(False)`` accumulates in
    ``reduce_dtype``; the reduced shard lands in the sharded parameter's
    ``.grad`` as FSDP2 does it (cast to the sharded parameter's dtype).
    Unsharded gradients take ``reduce_dtype``'s size (fp32: twice bf16's)
    until FSDP2 frees them after the reduce-scatter.

    Supported: per-expert and packed (``single_grouped_weight=True``) layers,
    biases, ``reshard_after_forward`` True/False/int, gradient accumulation
    without sync, HSDP meshes, DCP (``torch.distributed.checkpoint``) of the
    sharded state dict, FP8 layers (``fp8_recipe="blockwise"``: their FP8
    wgrads take the same route; the layers never cache their quantized
    weights under FSDP, whatever ``is_first_microbatch`` says: FSDP2
    gathers the weights at every forward). A unit with ``reduce_dtype=None``
    is passed through unchanged (its gradients are already in the compute
    dtype).

    Args:
        module: The module (or list of modules, FSDP2's grouped form) to make
            one FSDP2 unit.
        **fsdp_kwargs: FSDP2's keyword arguments, passed on unchanged.

    Returns:
        ``module``, now an ``FSDPModule`` (a list of them for a list).

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (or list of them), or
            ``mp_policy`` is not a ``MixedPrecisionPolicy``.
        ValueError: An unsupported setup, before FSDP2 touches the module: a
            groupgrad layer with ``accumulate_into_main_grad=True`` (FSDP2
            reduces ``.grad``, not ``main_grad``) or
            ``delay_wgrad_compute=True`` (FSDP2 reduce-scatters when backward
            ends, before ``backward_dw()``); a ``DistributedWeight`` parameter
            (two gradient owners) or a groupgrad parameter that is a
            ``DTensor`` already; a sub-unit holding groupgrad layers that was
            sharded by plain FSDP2; a ``param_dtype``/``reduce_dtype`` other
            than fp32, bf16 or fp16; parameters computed in bf16/fp16 with no
            ``reduce_dtype`` (FSDP2 would reduce in 16 bits; pass it
            explicitly, e.g. ``reduce_dtype=torch.float32``); a module that
            is an FSDP unit already; trainable parameters of more than one
            dtype in the unit (FSDP2 needs one); ``dp_mesh_dims`` (FSDP2 over ``DTensor``
            parameters; the grouped GEMMs take plain tensors).
        RuntimeError: PyTorch has no ``Tensor.grad_dtype`` (before 2.10).
    """
    check_grad_dtype_support()
    modules = check_modules(module)
    policy = mp_policy_of(fsdp_kwargs)
    check_plain_parameters(fsdp_kwargs)
    check_nested_units(modules)
    check_layers(modules)
    check_uniform_dtype(modules)
    reduce_dtype = check_reduce_dtype(modules, policy)

    before = plain_param_slots(modules)
    sharded = torch_fully_shard(module, **fsdp_kwargs)
    if reduce_dtype is not None:
        hook = UnshardedGradDtype(managed_slots(before), reduce_dtype)
        for sub in modules:
            sub.register_forward_pre_hook(hook)
    if layers := groupgrad_layers(modules):
        flags = LayerFlags(layers)
        for sub in modules:
            sub.register_forward_pre_hook(flags)
    for sub in modules:
        setattr(sub, UNIT_MARK, reduce_dtype)
    return sharded
