"""Which of a module's functions a block of code called: :func:`record_calls`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import pytest


def record_calls(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, names: Sequence[str]
) -> list[str]:
    """Replace each named function of ``module`` (e.g. a custom op the module calls) with one
    that appends its name to the returned list, then runs it.

    The kernels' tests use it to see which calls went through their custom ops
    and which ran the kernels directly.
    """
    calls: list[str] = []

    def recording(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls.append(name)
            return real(*args)

        return call

    for name in names:
        monkeypatch.setattr(module, name, recording(name, getattr(module, name)))
    return calls


def record_weight_quantizations(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record each ``(128, 128)`` weight quantization the modules' FP8 recipe runs (its source)."""
    from groupgrad.modules import _fp8_recipe

    calls: list[object] = []
    real = _fp8_recipe._quantized

    def recording(t: object, what: str, **how: Any) -> Any:
        if how.get("block") == (128, 128):
            calls.append(t)
        return real(t, what, **how)

    monkeypatch.setattr(_fp8_recipe, "_quantized", recording)
    return calls
