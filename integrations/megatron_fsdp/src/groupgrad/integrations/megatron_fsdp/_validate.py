"""Checks run by :func:`shard_model` before Megatron-FSDP touches the module.

Every check raises at the API boundary with a message that names the argument
or parameter, its value and what was expected.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from groupgrad.modules import GroupedLinear, GroupedMLP
from groupgrad.protocol import is_distributed_weight

__all__ = [
    "check_config_class",
    "check_cuda",
    "check_expert_mesh",
    "check_fsdp_units",
    "check_grad_precision",
    "check_no_delayed_wgrad",
    "check_no_distributed_weights",
    "check_wgrad_into_main_grad",
    "expert_parameter_names",
    "guard_no_delayed_wgrad",
]

GROUPGRAD_MODULES = (GroupedLinear, GroupedMLP)


def check_cuda() -> None:
    """Require what Megatron-FSDP needs from CUDA before it is called.

    Megatron-FSDP runs its collectives on CUDA streams and keeps its buffers on
    the current CUDA device; without CUDA it fails deep inside its setup
    (``Torch not compiled with CUDA enabled``). A process that stands in for
    those few calls (as groupgrad's CPU tests do with gloo) passes.

    Raises:
        RuntimeError: CUDA is unavailable and nothing stands in for it.
    """
    if torch.cuda.is_available():
        return
    try:
        torch.cuda.current_device()
        torch.cuda.Stream()
    except Exception:
        why = (
            "this PyTorch has no CUDA support"
            if torch.version.cuda is None
            else "PyTorch sees no CUDA device"
        )
        raise RuntimeError(
            f"shard_model needs CUDA: Megatron-FSDP runs its collectives on CUDA streams and "
            f"keeps its buffers on the current CUDA device, but {why} (torch "
            f"{torch.__version__}, torch.cuda.is_available() is False); run it on GPUs with "
            "NCCL, e.g. torchrun --nproc-per-node gpu train.py"
        ) from None


def check_config_class() -> None:
    """Require that the config class Megatron-FSDP will use knows every field it passes.

    ``megatron_fsdp`` takes ``megatron.core``'s ``DistributedDataParallelConfig``
    whenever ``megatron-core`` is importable; an older ``megatron-core`` (0.16.x,
    the newest for Python 3.11) lacks fields ``megatron-fsdp`` 0.6 sets, and
    ``fully_shard_model`` would fail with a ``TypeError`` deep in its setup.

    Raises:
        RuntimeError: The two installed packages do not fit; names both versions.
    """
    import dataclasses
    import importlib
    import importlib.metadata

    # the modules by their full names: the package re-exports a function named fully_shard
    own = importlib.import_module("megatron_fsdp.distributed_data_parallel_config")
    used = importlib.import_module("megatron_fsdp.fully_shard").DistributedDataParallelConfig
    if used is own.DistributedDataParallelConfig:
        return
    missing = sorted(
        {f.name for f in dataclasses.fields(own.DistributedDataParallelConfig)}
        - {f.name for f in dataclasses.fields(used)}
    )
    if missing:
        versions = {
            name: importlib.metadata.version(name) for name in ("megatron-fsdp", "megatron-core")
        }
        raise RuntimeError(
            f"megatron-fsdp {versions['megatron-fsdp']} uses megatron-core "
            f"{versions['megatron-core']}'s DistributedDataParallelConfig because megatron-core "
            f"is installed, and that class lacks fields megatron-fsdp passes ({', '.join(missing)}); "
            "shard_model would fail inside Megatron-FSDP. Use a megatron-core that matches "
            "megatron-fsdp (0.19 or newer on Python 3.12), or an environment without megatron-core"
        )


def check_no_distributed_weights(module: nn.Module) -> None:
    """Reject a module that holds a ``DistributedWeight``.

    Megatron-FSDP gathers and reduces every parameter itself; a parameter that
    also carries the ``DistributedWeight`` protocol would have two gradient
    owners (and be gathered and reduced twice).

    Raises:
        ValueError: Some parameter is a ``DistributedWeight``.
    """
    for name, param in module.named_parameters():
        if is_distributed_weight(param):
            raise ValueError(
                f"parameter {name!r} is a DistributedWeight ({type(param).__name__}); "
                "Megatron-FSDP shards, gathers and reduces every parameter itself, so a "
                "parameter must not also be a DistributedWeight (it would have two gradient "
                "owners); shard the module with Megatron-FSDP or with the DistributedWeight "
                "implementer, not both"
            )


def check_wgrad_into_main_grad(module: nn.Module) -> None:
    """Require ``accumulate_into_main_grad=True`` on every groupgrad layer in ``module``.

    Without it the wgrad goes to autograd in the parameter's dtype (a fresh
    weight-sized allocation every backward, bf16 for a bf16 model) and
    Megatron-FSDP copies it into its bucket afterwards.

    Raises:
        ValueError: A ``GroupedLinear`` or ``GroupedMLP`` has
            ``accumulate_into_main_grad=False``.
    """
    for name, sub in module.named_modules():
        if isinstance(sub, GROUPGRAD_MODULES) and not sub.accumulate_into_main_grad:
            label = name or "<root>"
            raise ValueError(
                f"{type(sub).__name__} {label!r} has accumulate_into_main_grad=False, expected "
                "True under Megatron-FSDP (the wgrad GEMM then writes straight into the fp32 "
                "bucket handed out by get_main_grad()); build it with "
                "accumulate_into_main_grad=True"
            )


def check_no_delayed_wgrad(module: nn.Module) -> None:
    """Reject ``delay_wgrad_compute=True`` on groupgrad layers (not supported under Megatron-FSDP).

    Megatron-FSDP reduces a parameter's gradient bucket from its
    post-accumulate-grad hook, which fires at backward, before
    ``backward_dw()`` would write the wgrad: the reduce-scatter would send an
    unwritten (uninitialised) bucket.

    Raises:
        ValueError: A ``GroupedLinear`` or ``GroupedMLP`` has
            ``delay_wgrad_compute=True``.
    """
    for name, sub in module.named_modules():
        if isinstance(sub, GROUPGRAD_MODULES):
            NoDelayedWgrad(name)(sub, ())


def guard_no_delayed_wgrad(module: nn.Module) -> None:
    """Register :class:`NoDelayedWgrad` as a forward pre-hook of each groupgrad layer of
    ``module``: ``delay_wgrad_compute`` switched on after ``shard_model`` is refused at the
    layer's next forward."""
    for name, sub in module.named_modules():
        if isinstance(sub, GROUPGRAD_MODULES):
            sub.register_forward_pre_hook(NoDelayedWgrad(name))


class NoDelayedWgrad:
    """The rule of :func:`check_no_delayed_wgrad` for one layer (``name`` in the model), also
    as a forward pre-hook: a flag switched on after ``shard_model`` is refused at the next
    forward (the bucket reduced at backward would be unwritten: garbage weights)."""

    def __init__(self, name: str) -> None:
        self.name = name or "<root>"

    def __call__(self, layer: nn.Module, args: Any) -> None:
        if getattr(layer, "delay_wgrad_compute", False):
            raise ValueError(
                f"{type(layer).__name__} {self.name!r} has delay_wgrad_compute=True, "
                "expected False under Megatron-FSDP: it reduces the gradient bucket at backward, "
                "before backward_dw() would write the weight gradient"
            )


def check_grad_precision(policy: Any) -> None:
    """Require fp32 main gradients and fp32 gradient communication.

    Args:
        policy: A ``megatron_fsdp.MixedPrecisionPolicy``.

    Raises:
        TypeError: ``policy`` is not a ``MixedPrecisionPolicy``.
        ValueError: ``main_grads_dtype`` is not ``torch.float32``, or
            ``grad_comm_dtype`` is neither ``None`` (follows
            ``main_grads_dtype``) nor ``torch.float32``.
    """
    from megatron_fsdp import MixedPrecisionPolicy

    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mixed_precision_policy is a {type(policy).__name__}, expected a "
            "megatron_fsdp.MixedPrecisionPolicy"
        )
    if policy.main_grads_dtype != torch.float32:
        raise ValueError(
            f"mixed_precision_policy.main_grads_dtype is {policy.main_grads_dtype}, expected "
            "torch.float32 (groupgrad writes wgrads into fp32 main_grad buffers)"
        )
    if policy.grad_comm_dtype not in (None, torch.float32):
        raise ValueError(
            f"mixed_precision_policy.grad_comm_dtype is {policy.grad_comm_dtype}, expected "
            "torch.float32 or None (the gradient reduce-scatter runs in fp32)"
        )


def expert_parameter_names(module: nn.Module) -> list[str]:
    """Return the names of the parameters Megatron-FSDP treats as expert parameters.

    Megatron-FSDP 0.6 decides by name: a parameter whose qualified name
    contains ``".experts."`` is an expert parameter, sharded and reduced over
    the expert data-parallel group of ``expt_device_mesh`` (not the dense
    data-parallel group).
    """
    return [name for name, _ in module.named_parameters() if ".experts." in name]


def check_expert_mesh(module: nn.Module, expt_device_mesh: Any, dp_shard_dim: str) -> None:
    """Require an expert mesh with a ``dp_shard_dim`` dimension when there are expert parameters.

    Args:
        module: The module about to be sharded.
        expt_device_mesh: The ``DeviceMesh`` for expert parameters, or ``None``.
        dp_shard_dim: The name of the sharding dimension, in both meshes.

    Raises:
        ValueError: A parameter name contains ``".experts."`` but
            ``expt_device_mesh`` is ``None`` or has no ``dp_shard_dim``
            dimension.
    """
    names = expert_parameter_names(module)
    if not names:
        return
    shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
    if expt_device_mesh is None:
        raise ValueError(
            f"expt_device_mesh is None, but {len(names)} parameter(s) are expert parameters "
            f"for Megatron-FSDP (their names contain '.experts.': {shown}); it shards and "
            "reduces those over the expert data-parallel group, so pass expt_device_mesh with "
            f"a {dp_shard_dim!r} dimension; without expert parallelism, name the submodule "
            "something other than 'experts' and the experts are sharded like dense weights"
        )
    dim_names = tuple(expt_device_mesh.mesh_dim_names or ())
    if dp_shard_dim not in dim_names:
        raise ValueError(
            f"expt_device_mesh has dimensions {dim_names}, expected one named "
            f"dp_shard_dim={dp_shard_dim!r} (the expert data-parallel sharding dimension)"
        )


def _names_class(entry: type[nn.Module] | str, cls: type[nn.Module]) -> bool:
    if isinstance(entry, str):
        return entry == cls.__name__ or entry.endswith(f".{cls.__name__}")
    return isinstance(entry, type) and issubclass(cls, entry)


def _resolved(entry: type[nn.Module] | str) -> type | None:
    """The class a ``fsdp_unit_modules`` entry names (a dotted path imported, as Megatron-FSDP
    does), or ``None`` where it cannot be imported."""
    if isinstance(entry, type):
        return entry
    path, _, name = str(entry).rpartition(".")
    try:
        found = getattr(importlib.import_module(path), name) if path else None
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) else None


def _shown_units(units: Sequence[type[nn.Module] | str] | None) -> str:
    if units is None:
        return "None"
    return "[" + ", ".join(u.__name__ if isinstance(u, type) else repr(u) for u in units) + "]"


def check_fsdp_units(
    module: nn.Module,
    fsdp_unit_modules: Sequence[type[nn.Module] | str] | None,
    zero_dp_strategy: str | int,
) -> None:
    """Under ZeRO-3, require an FSDP unit in ``module``, and ``GroupedMLP`` to be a unit
    whenever ``GroupedLinear`` is one.

    ZeRO-3 gathers parameters per FSDP unit, and Megatron-FSDP divides by the
    number of units in the model (``ZeroDivisionError`` where there is none).
    ``GroupedMLP`` runs ``fc1`` and ``fc2`` in one fused op without calling
    their ``forward``, so Megatron-FSDP's per-unit gather hooks on a
    ``GroupedLinear`` unit inside it would never fire and the weights would
    stay sharded.

    Raises:
        ValueError: Under ``"optim_grads_params"`` (``3``): ``fsdp_unit_modules``
            is ``None``, or lists classes none of ``module``'s modules is; or it
            names ``GroupedLinear`` but not ``GroupedMLP`` while ``module`` holds
            a ``GroupedMLP``.
    """
    if zero_dp_strategy not in ("optim_grads_params", 3):
        return
    units = fsdp_unit_modules or ()
    classes = [_resolved(entry) for entry in units]
    if None not in classes and not any(  # an unresolved path: Megatron-FSDP's own error
        isinstance(sub, tuple(cast(list[type], classes))) for sub in module.modules()
    ):
        raise ValueError(
            f"fsdp_unit_modules is {_shown_units(fsdp_unit_modules)} under zero_dp_strategy="
            f"{zero_dp_strategy!r}, and no module of the model is one: ZeRO-3 gathers parameters "
            "per FSDP unit, and Megatron-FSDP needs at least one (it divides by their number: "
            "ZeroDivisionError); expected the classes of the model's blocks, e.g. "
            "[GroupedLinear, GroupedMLP]"
        )
    if not any(_names_class(entry, GroupedLinear) for entry in units):
        return
    if any(_names_class(entry, GroupedMLP) for entry in units):
        return
    for name, sub in module.named_modules():
        if isinstance(sub, GroupedMLP):
            raise ValueError(
                f"fsdp_unit_modules names GroupedLinear but not GroupedMLP, and GroupedMLP "
                f"{name or '<root>'!r} runs its fc1 and fc2 in one fused op without calling "
                "their forward, so Megatron-FSDP would never gather them; expected "
                "GroupedMLP in fsdp_unit_modules too"
            )
