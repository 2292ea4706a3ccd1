"""Inclusive host (CPU) time per step of chosen groupgrad functions, without a profiler.

``cProfile`` charges every Python call a fixed cost, so it inflates code made
of many small calls (a per-expert layer's 128 parameters): on the H200's host
it timed a per-expert FP8 step at E = 128 at 16.5 ms, where the step takes
8–10 ms, and the FP8 weight cache's checks at 1.3 ms against 0.4–0.7 ms
wrapped as here (DEVICE_RUNS 134–136). Here each listed function is wrapped
by a ``perf_counter`` pair instead (about a microsecond a call): :func:`timed`
installs the wrappers, the caller runs its steps, and the report gives each
function's calls and milliseconds per step, nested calls included (an outer
function's time holds its inner ones').

Used by ``profile_fp8_step.py`` (``host_functions`` of each variant).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

#: ``module:qualified name`` of each function timed (methods as ``Class.method``).
FUNCTIONS = (
    "groupgrad.modules._mlp:GroupedMLP.forward",
    "groupgrad.modules._mlp_fn:GroupedMLPFunction.forward",
    "groupgrad.modules._mlp_fn:GroupedMLPFunction.backward",
    "groupgrad.modules._linear:GroupedLinear.current_parameters",
    "groupgrad.modules._linear_fn:layer_fprop",
    "groupgrad.modules._linear_fn:layer_dgrad",
    "groupgrad.modules._fp8_recipe:Fp8Blockwise.weights",
    "groupgrad.modules._fp8_recipe:Fp8Blockwise.quantize_input",
    "groupgrad.modules._fp8_recipe:Fp8Blockwise.quantize_grad",
    "groupgrad.modules._fp8_cache:Fp8WeightCache.get",
    "groupgrad.modules._fp8_cache:Fp8WeightCache.put",
    "groupgrad.modules._mlp_forms:MLPForms.swiglu",
    "groupgrad.modules._mlp_forms:MLPForms.swiglu_backward",
    "groupgrad.modules._compiled:hand_over",
    "groupgrad.modules._wgrad:WgradTarget.plan",
    "groupgrad.protocol._plan:autograd_dummies",
    "groupgrad.kernels._fp8:quantize_fp8",
    "groupgrad.kernels._fp8:segment_offsets",
    "groupgrad.kernels._api:grouped_fprop",
    "groupgrad.kernels._api:grouped_dgrad",
    "groupgrad.kernels._api:prepare_wgrad",
    "groupgrad.kernels._api:PreparedWgrad.run",
    "groupgrad.kernels._group:listed_facts",
    "torch.autograd:backward",
)


def _wrapped(label: str, fn: Callable[..., Any], totals: dict[str, list[float]]) -> Any:
    @functools.wraps(fn)
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = totals.setdefault(label, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    return timed_call


def _install(spec: str, totals: dict[str, list[float]]) -> list[Callable[[], None]]:
    """Wrap one function where it is defined and where groupgrad or torch imported it;
    return what undoes that."""
    module_name, qualname = spec.split(":")
    module = importlib.import_module(module_name)
    undo: list[Callable[[], None]] = []
    if "." in qualname:
        owner_name, attr = qualname.split(".")
        owner = getattr(module, owner_name)
        original = owner.__dict__[attr]
        is_static = isinstance(original, staticmethod)
        fn = original.__func__ if is_static else original
        new = _wrapped(qualname, fn, totals)
        setattr(owner, attr, staticmethod(new) if is_static else new)
        undo.append(lambda: setattr(owner, attr, original))
        return undo
    original = getattr(module, qualname)
    new = _wrapped(qualname, original, totals)
    for name, holder in list(sys.modules.items()):
        if holder is None or not name.startswith(("groupgrad", "torch.autograd")):
            continue
        for key, value in list(vars(holder).items()):
            if value is original:
                setattr(holder, key, new)
                undo.append(functools.partial(setattr, holder, key, original))
    if not undo:
        raise LookupError(f"{spec}: no module holds it")
    return undo


@contextlib.contextmanager
def timed(functions: tuple[str, ...] = FUNCTIONS) -> Iterator[dict[str, list[float]]]:
    """Within the block, every function of ``functions`` adds its calls and seconds to
    the yielded ``{qualified name: [calls, seconds]}``; the originals are back after."""
    totals: dict[str, list[float]] = {}
    undo: list[Callable[[], None]] = []
    try:
        for spec in functions:
            undo += _install(spec, totals)
        yield totals
    finally:
        for restore in reversed(undo):
            restore()


def per_step(totals: dict[str, list[float]], steps: int) -> dict[str, dict[str, float]]:
    """``{name: {"calls": per step, "ms": per step}}``, the slowest first."""
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
    return {name: {"calls": n / steps, "ms": s / steps * 1e3} for name, (n, s) in rows}
