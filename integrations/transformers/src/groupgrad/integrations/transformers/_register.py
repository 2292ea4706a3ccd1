"""Registration of ``"groupgrad"`` in transformers' experts-implementation registry."""

from __future__ import annotations

from groupgrad.integrations.transformers._forward import groupgrad_experts_forward
from groupgrad.integrations.transformers._version import check_transformers_version
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

__all__ = ["IMPLEMENTATION", "register"]

IMPLEMENTATION = "groupgrad"
"""The name to pass to ``set_experts_implementation`` / ``experts_implementation=``."""


def _is_ours(function: object) -> bool:
    """Whether ``function`` is this package's forward (also after a module reload)."""
    return (
        getattr(function, "__module__", None) == groupgrad_experts_forward.__module__
        and getattr(function, "__qualname__", None) == groupgrad_experts_forward.__qualname__
    )


def register() -> None:
    """Register :func:`groupgrad_experts_forward` as ``"groupgrad"`` (idempotent).

    Importing ``groupgrad.integrations.transformers`` calls this. It adds the
    entry to the class-wide mapping of transformers' ``ExpertsInterface``, so
    ``model.set_experts_implementation("groupgrad")``,
    ``from_pretrained(..., experts_implementation="groupgrad")`` and every
    ``@use_experts_implementation`` module find it. Calling it again changes
    nothing.

    Raises:
        RuntimeError: The installed transformers is not a supported release
            (5.17 through 5.24), or another function is registered as
            ``"groupgrad"`` already.
    """
    check_transformers_version()
    present = ALL_EXPERTS_FUNCTIONS.get(IMPLEMENTATION)
    if present is not None and not _is_ours(present):
        raise RuntimeError(
            f"experts implementation {IMPLEMENTATION!r} is registered already as "
            f"{getattr(present, '__module__', '?')}.{getattr(present, '__qualname__', present)!s}, "
            f"expected none or {groupgrad_experts_forward.__module__}."
            f"{groupgrad_experts_forward.__qualname__}"
        )
    ExpertsInterface.register(IMPLEMENTATION, groupgrad_experts_forward)
