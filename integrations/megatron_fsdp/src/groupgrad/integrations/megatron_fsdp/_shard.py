"""``shard_model`` / ``shard_optimizer``: validated wrappers over Megatron-FSDP's ``fully_shard`` API."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from groupgrad.integrations.megatron_fsdp._overwrite import (
    groupgrad_weight_names,
    keep_unsharded_grads_accumulating,
)
from groupgrad.integrations.megatron_fsdp._validate import (
    check_config_class,
    check_cuda,
    check_expert_mesh,
    check_fsdp_units,
    check_grad_precision,
    check_no_delayed_wgrad,
    check_no_distributed_weights,
    check_wgrad_into_main_grad,
    guard_no_delayed_wgrad,
)

__all__ = ["fp32_grad_policy", "shard_model", "shard_optimizer"]

logger = logging.getLogger(__name__)


def fp32_grad_policy() -> Any:
    """Return the default ``megatron_fsdp.MixedPrecisionPolicy`` of :func:`shard_model`.

    fp32 main weights, fp32 main gradients and fp32 gradient communication
    (reduce-scatter / all-reduce); compute weights keep the module's dtype.
    """
    from megatron_fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        main_params_dtype=torch.float32,
        main_grads_dtype=torch.float32,
        grad_comm_dtype=torch.float32,
    )


def shard_model(
    module: nn.Module,
    *,
    device_mesh: Any = None,
    dp_shard_dim: str = "fsdp",
    tp_dim: str = "tp",
    expt_device_mesh: Any = None,
    zero_dp_strategy: str | int = "optim_grads_params",
    mixed_precision_policy: Any = None,
    fsdp_unit_modules: Sequence[type[nn.Module]] | Sequence[str] | None = None,
    device: torch.device | str | None = None,
    **fully_shard_kwargs: Any,
) -> Any:
    """Shard ``module`` with Megatron-FSDP so that groupgrad wgrads land in its fp32 buckets.

    A thin wrapper over ``megatron_fsdp.fully_shard_model``. Before it:
    validates the module and the precision policy. After it: makes the
    groupgrad weights whose gradient buffer is not sharded accumulate
    (see below). Megatron-FSDP then marks every parameter ``__fsdp_param__``,
    gives it ``get_main_grad()`` and ``grad_added_to_main_grad``, and sets
    ``overwrite_main_grad = True`` at every parameter gather; groupgrad's wgrad
    GEMM writes into the buffer ``get_main_grad()`` hands out (called once per
    weight per backward), in its dtype (fp32), sets
    ``grad_added_to_main_grad``, and gives autograd a cached zero dummy, so
    no weight-sized gradient is allocated by groupgrad per backward.

    Fix applied: where a groupgrad weight's gradient buffer is not sharded
    (``zero_dp_strategy`` ``"optim"``/``1`` (ZeRO-1), or a data-parallel group of
    one rank, e.g. an expert group of size 1), Megatron-FSDP's
    ``overwrite_main_grad = True`` would make each micro-batch overwrite the
    persistent buffer and drop the earlier ones; such weights get
    ``overwrite_main_grad = False`` after every gather, so they accumulate.
    ``"no_shard"`` never sets the flag and needs no fix. With unsharded
    buffers Megatron-FSDP reduces in place, so (its own rule) pass
    ``sync_model_each_microbatch=False`` and run every micro-batch but the
    last under ``model.no_sync()``.

    Expert parameters: Megatron-FSDP treats a parameter whose name contains
    ``".experts."`` as an expert parameter and shards it over
    ``expt_device_mesh[dp_shard_dim]``; ``expt_device_mesh`` is then required.
    groupgrad layers elsewhere are sharded over the dense data-parallel group,
    which is right when every rank holds every expert (no expert parallelism).

    Args:
        module: The model. Every ``GroupedLinear``/``GroupedMLP`` in it must
            have ``accumulate_into_main_grad=True`` (it is not switched on
            silently) and ``delay_wgrad_compute=False`` (Megatron-FSDP
            reduces at backward, before ``backward_dw()``). Moved to
            ``device`` when given.
        device_mesh: Megatron-FSDP's ``DeviceMesh`` with ``dp_shard_dim`` and
            ``tp_dim`` dimensions; ``None`` lets Megatron-FSDP build a CUDA
            mesh over all ranks.
        dp_shard_dim: Name of the data-parallel sharding dimension.
        tp_dim: Name of the tensor-parallel dimension (size 1 without TP).
        expt_device_mesh: ``DeviceMesh`` for expert parameters (see above).
        zero_dp_strategy: ``"no_shard"``, ``"optim"``, ``"optim_grads"``,
            ``"optim_grads_params"`` or ``0``-``3``.
        mixed_precision_policy: A ``megatron_fsdp.MixedPrecisionPolicy`` with
            ``main_grads_dtype=torch.float32`` and ``grad_comm_dtype`` ``None``
            or ``torch.float32``; default :func:`fp32_grad_policy`.
        fsdp_unit_modules: Module classes (or dotted paths) each sharded as
            one FSDP unit. Under ZeRO-3 at least one of the model's modules
            must be one (``None`` is refused there), and a model with
            ``GroupedMLP`` that lists ``GroupedLinear`` must list
            ``GroupedMLP`` too (its fused op does
            not call ``fc1``/``fc2``'s forward, so their gather hooks would
            not fire).
        device: Where Megatron-FSDP keeps parameters and buffers (default:
            the current CUDA device).
        **fully_shard_kwargs: Passed to ``megatron_fsdp.fully_shard_model``
            unchanged.

    Returns:
        The ``megatron_fsdp.MegatronFSDP`` wrapper; the original module is its
        ``.module``. Build the optimizer on its ``parameters()`` and pass it
        to :func:`shard_optimizer`.

    Raises:
        RuntimeError: CUDA is unavailable (Megatron-FSDP needs it), or the
            installed megatron-core does not fit megatron-fsdp; checked after
            the module, before Megatron-FSDP runs.
        ValueError: A parameter is a ``DistributedWeight``; a groupgrad layer
            has ``accumulate_into_main_grad=False`` or
            ``delay_wgrad_compute=True``; the policy's gradient
            dtypes are not fp32; expert parameters without a suitable
            ``expt_device_mesh``; under ZeRO-3, no FSDP unit in the model, or
            ``GroupedLinear`` listed as an FSDP unit without ``GroupedMLP``.
        TypeError: ``module`` is not an ``nn.Module``, or
            ``mixed_precision_policy`` is not a ``MixedPrecisionPolicy``.
    """
    import megatron_fsdp

    if not isinstance(module, nn.Module):
        raise TypeError(f"module is a {type(module).__name__}, expected a torch.nn.Module")
    check_no_distributed_weights(module)
    check_wgrad_into_main_grad(module)
    check_no_delayed_wgrad(module)
    policy = fp32_grad_policy() if mixed_precision_policy is None else mixed_precision_policy
    check_grad_precision(policy)
    check_expert_mesh(module, expt_device_mesh, dp_shard_dim)
    check_fsdp_units(module, fsdp_unit_modules, zero_dp_strategy)
    check_config_class()
    check_cuda()
    names = groupgrad_weight_names(module)
    model = megatron_fsdp.fully_shard_model(
        module,
        device_mesh=device_mesh,
        dp_shard_dim=dp_shard_dim,
        tp_dim=tp_dim,
        expt_device_mesh=expt_device_mesh,
        zero_dp_strategy=zero_dp_strategy,
        mixed_precision_policy=policy,
        fsdp_unit_modules=fsdp_unit_modules,
        device=None if device is None else torch.device(device),
        **fully_shard_kwargs,
    )
    guard_no_delayed_wgrad(module)
    accumulating = keep_unsharded_grads_accumulating(model, names)
    if accumulating:
        logger.info(
            "%d groupgrad weight(s) have an unsharded Megatron-FSDP gradient buffer; they "
            "accumulate across micro-batches (overwrite_main_grad kept False)",
            len(accumulating),
        )
    return model


def shard_optimizer(optimizer: torch.optim.Optimizer, **fully_shard_kwargs: Any) -> Any:
    """Hook ``optimizer`` into Megatron-FSDP (``megatron_fsdp.fully_shard_optimizer``).

    The optimizer must have been built on the ``parameters()`` of the model
    :func:`shard_model` returned (Megatron-FSDP's distributed parameters).
    Megatron-FSDP mutates it in place: ``step()`` waits for the gradient
    reduction, steps, and installs the new weights; ``zero_grad()`` also zeroes
    the gradient buffers. Like ``fully_shard_optimizer`` it runs one step on
    zero gradients to create the optimizer state.

    Args:
        optimizer: The optimizer; mutated.
        **fully_shard_kwargs: Passed to ``megatron_fsdp.fully_shard_optimizer``.

    Returns:
        ``optimizer``.

    Raises:
        ValueError: The optimizer has no parameters, or a parameter of it is
            not a distributed parameter of one Megatron-FSDP model (the
            message names the group and index).
    """
    import megatron_fsdp

    owner = None
    count = 0
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            count += 1
            model = getattr(param, "_megatron_fsdp_model", None)
            if model is None:
                raise ValueError(
                    f"optimizer.param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)}) is "
                    "not a Megatron-FSDP parameter; build the optimizer on "
                    "shard_model(...).parameters(), after shard_model"
                )
            if owner is not None and model is not owner:
                raise ValueError(
                    f"optimizer.param_groups[{g}]['params'][{i}] belongs to another "
                    "Megatron-FSDP model than the first parameter; expected one model"
                )
            owner = model
    if count == 0:
        raise ValueError("optimizer has no parameters; expected shard_model(...).parameters()")
    return megatron_fsdp.fully_shard_optimizer(optimizer, **fully_shard_kwargs)
