"""The CUDA kernels of the custom ops: CUTLASS when it can run a call, else the reference.

The CUTLASS backend is the module ``groupgrad.kernels._cutlass``, imported on
the first CUDA call (never at package import). Its contract — arguments are
already validated; every tensor is contiguous, 16-byte aligned, bf16/fp16
input with ``K`` and ``N`` multiples of 8 (checked here first); ``splits`` is
an int64 tensor on the operands' device; a group of ``E`` ``(N, K)`` matrices
(weights, wgrad outputs) arrives in op form (``_grouped``): packed ``[w_ENK]``,
which the backend addresses by stride without per-expert host work, or listed:

* ``unsupported_reason(op, a, b, out) -> str | None`` with ``op`` one of
  ``"fprop"``, ``"dgrad"``, ``"wgrad"``; ``(a, b, out)`` are
  ``(x_TK, w_group, y_TN)``, ``(dy_TN, w_group, dx_TK)`` and
  ``(dy_TN, x_TK, dw_group)``. ``None`` means CUTLASS runs the call.
* ``fprop(x_TK, w_group, splits_E, y_TN) -> None``
* ``dgrad(dy_TN, w_group, splits_E, dx_TK) -> None``
* ``wgrad(dy_TN, x_TK, splits_E, dw_group, accumulate) -> None``; ``dw_group``
  holds ``E`` ``(N, K)`` matrices of one dtype (bf16, fp16 or fp32).

When the backend cannot be imported, or the call's layout does not suit it,
or ``unsupported_reason`` gives a reason, the call runs on the reference path
instead and the reason is logged once (per distinct reason) at WARNING level.
The reference path reads ``splits`` on the host, which synchronizes with the
device when ``splits`` is a device tensor; the CUTLASS path never does.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Literal, cast

import torch
from torch import Tensor

from groupgrad.kernels import _reference, _splits
from groupgrad.kernels._grouped import is_packed, per_expert

logger = logging.getLogger(__name__)

CUTLASS_MODULE = "groupgrad.kernels._cutlass"
CUTLASS_DTYPES = (torch.bfloat16, torch.float16)
_ALIGNMENT_BYTES = 16
_ALIGNMENT_ELEMENTS = 8

Op = Literal["fprop", "dgrad", "wgrad"]

_OPERAND_NAMES = {"fprop": ("x", "weights"), "dgrad": ("dy", "weights"), "wgrad": ("dy", "x")}

_reasons_said: set[str] = set()


def fprop_on_device(x: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """CUDA kernel of ``groupgrad::grouped_fprop``: ``y_e = x_e @ w_e.T`` into ``out``."""
    x_TK, y_TN = x, out
    if x_TK.shape[0] == 0:
        return
    cutlass = _cutlass_for("fprop", x_TK, weights, y_TN)
    if cutlass is None:
        host_splits = _splits.host_values(splits, x_TK.shape[0], "x")
        _reference.fprop(x_TK, per_expert(weights), host_splits, y_TN)
    else:
        cutlass.fprop(x_TK, weights, _splits.on_device(splits, x_TK.device), y_TN)


def dgrad_on_device(dy: Tensor, weights: list[Tensor], splits: Tensor, out: Tensor) -> None:
    """CUDA kernel of ``groupgrad::grouped_dgrad``: ``dx_e = dy_e @ w_e`` into ``out``."""
    dy_TN, dx_TK = dy, out
    if dy_TN.shape[0] == 0:
        return
    cutlass = _cutlass_for("dgrad", dy_TN, weights, dx_TK)
    if cutlass is None:
        host_splits = _splits.host_values(splits, dy_TN.shape[0], "dy")
        _reference.dgrad(dy_TN, per_expert(weights), host_splits, dx_TK)
    else:
        cutlass.dgrad(dy_TN, weights, _splits.on_device(splits, dy_TN.device), dx_TK)


def wgrad_on_device(
    dy: Tensor, x: Tensor, splits: Tensor, out: list[Tensor], accumulate: bool
) -> None:
    """CUDA kernel of ``groupgrad::grouped_wgrad``: ``dw_e = dy_e.T @ x_e`` into ``out``."""
    dy_TN, x_TK = dy, x
    if x_TK.shape[0] == 0:  # every expert has no tokens: a zero gradient
        if not accumulate:
            for dw in out:
                dw.zero_()
        return
    cutlass = _cutlass_for("wgrad", dy_TN, x_TK, out)
    if cutlass is None:
        host_splits = _splits.host_values(splits, x_TK.shape[0], "x")
        _reference.wgrad(dy_TN, x_TK, host_splits, per_expert(out), accumulate)
    else:
        cutlass.wgrad(dy_TN, x_TK, _splits.on_device(splits, x_TK.device), out, accumulate)


def _cutlass_for(
    op: Op, a: Tensor, b: Tensor | list[Tensor], out: Tensor | list[Tensor]
) -> ModuleType | None:
    """The CUTLASS backend when it can run this call, else ``None`` (reason logged once)."""
    reason = layout_reason(op, a, b, out)
    cutlass = None
    if reason is None:
        cutlass, reason = load_cutlass()
    if cutlass is not None and reason is None:
        reason = cutlass.unsupported_reason(op, a, b, out)
    if reason is not None:
        _say_once(f"grouped_{op} runs on the reference path: {reason}")
        return None
    return cutlass


def layout_reason(
    op: Op, a: Tensor, b: Tensor | list[Tensor], out: Tensor | list[Tensor]
) -> str | None:
    """Why CUTLASS cannot take these (valid) operands, or ``None`` when it may.

    A cheap check before the backend is loaded: bf16/fp16 inputs, ``K`` and
    ``N`` multiples of 8, contiguous and 16-byte aligned (TMA) dense operands
    and packed groups. The members of a listed group are left to the backend's
    ``unsupported_reason``, which checks each of them once.
    """
    if a.dtype not in CUTLASS_DTYPES:
        return f"{a.dtype} inputs (CUTLASS takes torch.bfloat16 and torch.float16)"
    a_name, b_name = _OPERAND_NAMES[op]
    if op == "wgrad":
        second, group_name, group = (b_name, cast(Tensor, b)), "out", cast(list[Tensor], out)
    else:
        second, group_name, group = ("out", cast(Tensor, out)), b_name, cast(list[Tensor], b)
    named = [(a_name, a), second]
    if is_packed(group):
        named.append((group_name, group[0]))
    sizes = {  # (K, N) of each op; their outputs are (T, N), (T, K) and E × (N, K)
        "fprop": (a.shape[1], second[1].shape[1]),
        "dgrad": (second[1].shape[1], a.shape[1]),
        "wgrad": (second[1].shape[1], a.shape[1]),
    }
    for name, t in named:
        if not t.is_contiguous():
            return f"{name} is not contiguous"
    for dim, size in zip(("K", "N"), sizes[op], strict=True):
        if size % _ALIGNMENT_ELEMENTS:
            return f"{dim} = {size} is not a multiple of {_ALIGNMENT_ELEMENTS}"
    for name, t in named:
        if t.numel() and t.data_ptr() % _ALIGNMENT_BYTES:
            return f"{name} is not {_ALIGNMENT_BYTES}-byte aligned"
    return None


@functools.cache
def load_cutlass() -> tuple[ModuleType | None, str | None]:
    """Import the CUTLASS backend once: ``(module, None)`` or ``(None, reason)``."""
    try:
        return importlib.import_module(CUTLASS_MODULE), None
    except ImportError as error:
        return None, f"the CUTLASS backend cannot be imported ({error})"


def _say_once(message: str) -> None:
    if message not in _reasons_said:
        _reasons_said.add(message)
        logger.warning(message)
