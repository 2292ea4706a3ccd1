"""The CUDA kernels of the custom ops: CUTLASS when it can run a call, else the reference.

A call runs on CUTLASS when the support check (``_support.unsupported_reason``:
dtypes, sizes, layout, alignment) accepts its operands, the backend module
``groupgrad.kernels._cutlass`` imports (on the first CUDA call, never at
package import), and the backend can run on the operands' device
(``unavailable_reason(device)``: sm_90, a toolchain to build it). Otherwise
the call runs on the reference path and the reason is logged once (per
distinct reason) at WARNING level through this module's logger. The
reference path reads ``splits`` on the host, which synchronizes with the
device when ``splits`` is a device tensor; the CUTLASS path never does.

The backend's contract: arguments validated and accepted by the support
check; ``splits`` an int64 tensor on the operands' device; a group of ``E``
``(N, K)`` matrices (weights, wgrad outputs) in op form (``_grouped``):

* ``unavailable_reason(device) -> str | None``
* ``fprop(x_TK, w_group, splits_E, y_TN) -> None``
* ``dgrad(dy_TN, w_group, splits_E, dx_TK) -> None``
* ``wgrad(dy_TN, x_TK, splits_E, dw_group, accumulate) -> None``; ``dw_group``
  holds ``E`` ``(N, K)`` matrices of one dtype (bf16, fp16 or fp32).

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

from torch import Tensor

from groupgrad.kernels import _reference, _splits, _support
from groupgrad.kernels._listed import ListedFacts

logger = logging.getLogger(__name__)

CUTLASS_MODULE = "groupgrad.kernels._cutlass"

_reasons_said: set[str] = set()
_REFERENCE_ROW_GEMMS = {"fprop": _reference.fprop, "dgrad": _reference.dgrad}


def fprop_on_device(
    x: Tensor,
    weights: list[Tensor],
    splits: Tensor,
    out: Tensor,
    *,
    listed: ListedFacts | None = None,
) -> None:
    """CUDA kernel of ``groupgrad::grouped_fprop``: ``y_e = x_e @ w_e.T`` into ``out``.

    ``listed``: what validation's pass over listed weights found (``_listed``),
    which spares the support check its own pass.
    """
    _row_grouped_on_device("fprop", x, weights, splits, out, listed)


def dgrad_on_device(
    dy: Tensor,
    weights: list[Tensor],
    splits: Tensor,
    out: Tensor,
    *,
    listed: ListedFacts | None = None,
) -> None:
    """CUDA kernel of ``groupgrad::grouped_dgrad``: ``dx_e = dy_e @ w_e`` into ``out``."""
    _row_grouped_on_device("dgrad", dy, weights, splits, out, listed)


def _row_grouped_on_device(
    op: Literal["fprop", "dgrad"],
    a: Tensor,
    weights: list[Tensor],
    splits: Tensor,
    out: Tensor,
    listed: ListedFacts | None,
) -> None:
    """fprop or dgrad: each expert's rows of ``a`` times its weight into ``out`` (CUTLASS or reference)."""
    if a.shape[0] == 0:
        return
    cutlass, reason = cutlass_or_reason(op, a, weights, out, listed)
    if cutlass is None:
        _say_once(op, reason)
        _REFERENCE_ROW_GEMMS[op](a, weights, splits, out)
    else:
        getattr(cutlass, op)(a, weights, _splits.on_device(splits, a.device), out)


def wgrad_on_device(
    dy: Tensor,
    x: Tensor,
    splits: Tensor,
    out: list[Tensor],
    accumulate: bool,
    *,
    listed: ListedFacts | None = None,
) -> None:
    """CUDA kernel of ``groupgrad::grouped_wgrad``: ``dw_e = dy_e.T @ x_e`` into ``out``."""
    dy_TN, x_TK = dy, x
    if x_TK.shape[0] == 0:  # every expert has no tokens: a zero gradient
        if not accumulate:
            for dw in out:
                dw.zero_()
        return
    cutlass, reason = cutlass_or_reason("wgrad", dy_TN, x_TK, out, listed)
    if cutlass is None:
        _say_once("wgrad", reason)
        _reference.wgrad(dy_TN, x_TK, splits, out, accumulate)
    else:
        cutlass.wgrad(dy_TN, x_TK, _splits.on_device(splits, x_TK.device), out, accumulate)


def cutlass_or_reason(
    op: _support.Op,
    a: Tensor,
    b: Tensor | Sequence[Tensor],
    out: Tensor | Sequence[Tensor],
    listed: ListedFacts | None = None,
) -> tuple[ModuleType | None, str | None]:
    """``(backend, None)`` when CUTLASS runs this validated call, else ``(None, reason)``."""
    reason = _support.unsupported_reason(op, a, b, out, listed=listed)
    if reason is not None:
        return None, reason
    cutlass, reason = load_cutlass()
    if cutlass is not None:
        reason = cutlass.unavailable_reason(a.device)
    return (cutlass, None) if reason is None else (None, reason)


@functools.cache
def load_cutlass() -> tuple[ModuleType | None, str | None]:
    """Import the CUTLASS backend once: ``(module, None)`` or ``(None, reason)``."""
    try:
        return importlib.import_module(CUTLASS_MODULE), None
    except ImportError as error:
        return None, f"the CUTLASS backend cannot be imported ({error})"


def _say_once(op: str, reason: str | None) -> None:
    """Log, once per distinct reason, that ``grouped_<op>`` runs on the reference path."""
    message = f"grouped_{op} runs on the reference path: {reason}"
    if message not in _reasons_said:
        _reasons_said.add(message)
        logger.warning(message)
