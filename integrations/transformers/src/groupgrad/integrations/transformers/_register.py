"""Registration of ``"groupgrad"`` in transformers' experts-implementation registry."""

from __future__ import annotations

import functools
import warnings
from typing import Any

from groupgrad.integrations.transformers._forward import (
    groupgrad_experts_forward,
    groupgrad_fp8_experts_forward,
)
from groupgrad.integrations.transformers._version import check_transformers_version
from transformers import PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

__all__ = ["FP8_IMPLEMENTATION", "IMPLEMENTATION", "register"]

IMPLEMENTATION = "groupgrad"
"""The name to pass to ``set_experts_implementation`` / ``experts_implementation=``."""

FP8_IMPLEMENTATION = "groupgrad_fp8"
"""The same experts with the GEMMs in blockwise FP8 (:func:`groupgrad_fp8_experts_forward`)."""

_FORWARDS = {
    IMPLEMENTATION: groupgrad_experts_forward,
    FP8_IMPLEMENTATION: groupgrad_fp8_experts_forward,
}


def _is_ours(function: object, ours: object) -> bool:
    """Whether ``function`` is this package's forward ``ours`` (also after a module reload)."""
    return getattr(function, "__module__", None) == getattr(ours, "__module__", None) and getattr(
        function, "__qualname__", None
    ) == getattr(ours, "__qualname__", None)


def register() -> None:
    """Register ``"groupgrad"`` and ``"groupgrad_fp8"`` (idempotent).

    Importing ``groupgrad.integrations.transformers`` calls this. It adds
    :func:`groupgrad_experts_forward` as ``"groupgrad"`` and
    :func:`groupgrad_fp8_experts_forward` as ``"groupgrad_fp8"`` to the
    class-wide mapping of transformers' ``ExpertsInterface``, so
    ``model.set_experts_implementation("groupgrad")``,
    ``from_pretrained(..., experts_implementation="groupgrad")`` and every
    ``@use_experts_implementation`` module find them. Calling it again changes
    nothing. It also makes ``set_experts_implementation`` with either name
    warn, once per model class, on a model transformers will not dispatch.

    Raises:
        RuntimeError: The installed transformers is not a supported release
            (5.17 through 5.24), or another function is registered under one
            of the two names already (nothing is registered then).
    """
    check_transformers_version()
    for name, ours in _FORWARDS.items():
        present = ALL_EXPERTS_FUNCTIONS.get(name)
        if present is not None and not _is_ours(present, ours):
            raise RuntimeError(
                f"experts implementation {name!r} is registered already as "
                f"{getattr(present, '__module__', '?')}."
                f"{getattr(present, '__qualname__', present)!s}, expected none or "
                f"{ours.__module__}.{ours.__qualname__}"
            )
    for name, ours in _FORWARDS.items():
        ExpertsInterface.register(name, ours)
    _watch_set_experts_implementation()


_WARNED: set[str] = set()


def _watch_set_experts_implementation() -> None:
    """Make ``set_experts_implementation("groupgrad")`` warn (once per class) where it does nothing.

    transformers leaves a model whose experts lack ``@use_experts_implementation``
    (JetMoE, Llama-4) on its own code without a word; ``experts_route`` says
    ``dispatched=False`` for such experts.
    """
    original = PreTrainedModel.set_experts_implementation
    if getattr(original, "_groupgrad_watched", False):
        return

    @functools.wraps(original)
    def set_experts_implementation(self: PreTrainedModel, experts_implementation: Any) -> Any:
        result = original(self, experts_implementation)
        asked = (
            experts_implementation.values()
            if isinstance(experts_implementation, dict)
            else [experts_implementation]
        )
        name = type(self).__name__
        chosen = [impl for impl in _FORWARDS if impl in asked]
        undispatched = chosen and not self._can_set_experts_implementation()
        if undispatched and name not in _WARNED:
            _WARNED.add(name)
            warnings.warn(
                f"set_experts_implementation({chosen[0]!r}) changes nothing on {name}: its "
                "experts are not decorated with transformers' @use_experts_implementation, so "
                "they keep running transformers' own code",
                stacklevel=2,
            )
        return result

    set_experts_implementation._groupgrad_watched = True  # type: ignore[attr-defined]
    PreTrainedModel.set_experts_implementation = set_experts_implementation  # type: ignore[method-assign,unused-ignore]
