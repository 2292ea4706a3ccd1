"""Which of a module's functions a block of code called: :func:`record_calls`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pytest only where the tests run: the support imports without it
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


def weight_quantizations(run: Callable[[], object]) -> int:
    """How many ``(128, 128)`` weight quantizations ``run()`` ran, as the profiler counts them
    (the quantizer runs in a range named after its op even when it skips the op)."""
    return _profiled_calls(run, "groupgrad::quantize_fp8_weights")


def token_quantizations(run: Callable[[], object]) -> int:
    """How many ``(128, 1)`` quantizations (alone, or beside the ``(1, 128)`` form in one pass)
    ``run()`` ran, counted as :func:`weight_quantizations` counts."""
    return _profiled_calls(run, "groupgrad::quantize_fp8_segments")


def _profiled_calls(run: Callable[[], object], name: str) -> int:
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        run()
    events = profile.key_averages()
    return sum(e.count for e in events if e.key == name)
