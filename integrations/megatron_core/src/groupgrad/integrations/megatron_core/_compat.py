"""The one place that knows which megatron-core release is installed.

Supported: 0.16.x (the newest for Python 3.11) and 0.19.x (Python 3.12). What
differs between them, and what this module answers for the rest of the
package:

===============================  ===============================  ==============================
question                         0.16                             0.19
===============================  ===============================  ==============================
the submodules dataclass of      ``MLPSubmodules`` (built with    ``GroupedMLPSubmodules``
``TEGroupedMLP``                 ``build_module``)                (builders called with ``name=``)
the experts entry of             ``ModuleSpec(module,             a builder:
``MoESubmodules``                submodules)``                    ``partial(module, submodules=)``
a ``BackendSpecProvider``'s      ``(module, submodules)``         the builder
``grouped_mlp_modules()``
``apply_swiglu_sharded_factory`` ``(sh_ten, offsets, singleton)`` also ``tp_group=, dp_group=``
===============================  ===============================  ==============================

Everything else this package uses (``TEGroupedMLP``, ``SequentialMLP``'s
checkpoint layout, ``get_moe_module_spec_for_backend(backend=,
num_experts=, moe_grouped_gemm=)``, Megatron's DDP wgrad hooks, the
affine-weight initializers) has the same signature in both. Constructors of
this package accept ``name=`` (passed by 0.19's builders, never by 0.16).

Importing this module on any other release raises ``ImportError`` naming the
installed and the supported versions.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import megatron.core.package_info as _package_info
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = [
    "MEGATRON_CORE_VERSION",
    "SUPPORTED_RELEASES",
    "TEGroupedMLP",
    "check_supported",
    "experts_entry",
    "grouped_mlp_submodules",
    "provider_experts_entry",
    "swiglu_sharded_factory",
    "with_moe_layer",
]

SUPPORTED_RELEASES: dict[tuple[int, int], str] = {
    (0, 16): "0.16.x (Python 3.11)",
    (0, 19): "0.19.x (Python 3.12)",
}
"""megatron-core releases (major, minor) this package supports, with the Python they need."""


def check_supported(major: int, minor: int, version: str) -> tuple[int, int]:
    """Return ``(major, minor)`` when that megatron-core release is supported.

    Raises:
        ImportError: The release is not one of :data:`SUPPORTED_RELEASES`.
    """
    release = (int(major), int(minor))
    if release not in SUPPORTED_RELEASES:
        supported = ", ".join(SUPPORTED_RELEASES.values())
        raise ImportError(
            f"groupgrad-megatron-core supports megatron-core {supported}; the installed "
            f"megatron-core is {version}. Install a supported release"
        )
    return release


MEGATRON_CORE_VERSION: tuple[int, int] = check_supported(
    _package_info.MAJOR, _package_info.MINOR, _package_info.__version__
)
"""The installed megatron-core release as ``(major, minor)``."""

_NEW_BUILDERS = MEGATRON_CORE_VERSION >= (0, 19)

if _NEW_BUILDERS:
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules as _Submodules
else:
    from megatron.core.transformer.mlp import MLPSubmodules as _Submodules


def grouped_mlp_submodules(linear_fc1: type, linear_fc2: type) -> Any:
    """The submodules dataclass of Megatron's ``TEGroupedMLP`` with these fc1 / fc2 classes."""
    return _Submodules(linear_fc1=linear_fc1, linear_fc2=linear_fc2)


def experts_entry(module: type, submodules: Any | None) -> Any:
    """What ``MoESubmodules.experts`` holds for this experts class (and its submodules).

    0.16: a ``ModuleSpec``; 0.19: a builder (the class, or a ``partial`` with
    ``submodules=``).
    """
    if _NEW_BUILDERS:
        return module if submodules is None else partial(module, submodules=submodules)
    return ModuleSpec(module=module, submodules=submodules)


def provider_experts_entry(module: type, submodules: Any | None) -> Any:
    """What a ``BackendSpecProvider.grouped_mlp_modules()`` returns for this experts class.

    0.16: the pair ``(module, submodules)``; 0.19: the builder.
    """
    if _NEW_BUILDERS:
        return experts_entry(module, submodules)
    return module, submodules


def swiglu_sharded_factory(
    sharded_tensor: Any,
    sharded_offsets: tuple[Any, ...],
    singleton_local_shards: bool,
    tp_group: Any,
    dp_group: Any,
) -> Any:
    """Megatron's ``apply_swiglu_sharded_factory``: fc1's gate and up halves as two shards."""
    if _NEW_BUILDERS:
        return apply_swiglu_sharded_factory(
            sharded_tensor,
            sharded_offsets,
            singleton_local_shards,
            tp_group=tp_group,
            dp_group=dp_group,
        )
    return apply_swiglu_sharded_factory(sharded_tensor, sharded_offsets, singleton_local_shards)


def with_moe_layer(moe_entry: Any, moe_layer: type) -> Any:
    """Megatron's MoE-layer spec entry with ``moe_layer`` (a subclass of its ``MoELayer``) as the module.

    0.16: a ``ModuleSpec`` (its ``module`` replaced); 0.19: a
    ``partial(MoELayer, submodules=...)`` (rebuilt on ``moe_layer``).
    """
    if _NEW_BUILDERS:
        return partial(moe_layer, *moe_entry.args, **moe_entry.keywords)
    moe_entry.module = moe_layer
    return moe_entry
