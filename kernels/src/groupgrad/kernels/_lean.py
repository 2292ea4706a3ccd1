"""One lean pass over the common grouped GEMM call: accept it, or leave it to the detailed checks.

``_validate.grouped_call`` and ``wgrad_call`` check every argument in turn
and raise naming the argument, its value and what was expected; on the host
that costs several µs per call even when nothing is wrong. Most calls are
the common one — plain contiguous tensors on one device, packed ``(E, N, K)``
weights or wgrad output, integer ``splits``, nothing tracing — and
:func:`packed_call` and :func:`packed_wgrad_call` accept those in one pass of
cheap tests. They never raise: when a test fails they return ``None`` and
the detailed checks run. Every test is a condition the detailed checks
impose, so the lean pass accepts nothing they reject and returns the call
they would (``kernels/tests/test_validation_lean.py`` runs every combination
of valid and hostile arguments through both).

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from torch import Tensor

from groupgrad.kernels import _overlap, _splits
from groupgrad.kernels._calls import INPUT_DTYPES, WGRAD_OUT_DTYPES, GroupedCall, WgradCall
from groupgrad.kernels._listed import PLAIN_TYPES


def packed_call(
    op: Literal["fprop", "dgrad"], a: object, weights: object, splits: object, out: object
) -> GroupedCall | None:
    """The common fprop/dgrad call, accepted in one pass of cheap tests, else ``None``.

    The common call: plain contiguous tensors (``torch.Tensor`` or
    ``nn.Parameter``) on one device, packed ``(E, N, K)`` weights, ``splits``
    an integer tensor (its values checked when it lives on the CPU), ``out``
    absent or apart from the inputs in memory, nothing tracing. Each test is a
    condition of ``_validate.grouped_call``'s detailed checks, so everything accepted
    here they accept too, with the same result. Nothing raises here: when a
    test fails, the detailed checks run and name what is wrong.
    """
    if not _plain_eager(a, weights, splits, optional=out):
        return None
    a_TX, w_ENK, splits_E = cast(Tensor, a), cast(Tensor, weights), cast(Tensor, splits)
    device, dtype = a_TX.device, a_TX.dtype
    if (
        dtype not in INPUT_DTYPES
        or a_TX.dim() != 2
        or w_ENK.dim() != 3
        or w_ENK.dtype != dtype
        or w_ENK.device != device
        or device.type not in ("cpu", "cuda")
        or not (a_TX.is_contiguous() and w_ENK.is_contiguous())
    ):
        return None
    E, N, K = w_ENK.shape
    T, inner = a_TX.shape
    out_shape = (T, N) if op == "fprop" else (T, K)
    if (
        E == 0
        or inner != (K if op == "fprop" else N)
        or not _lean_splits(splits_E, T, device)  # 1-D, so len() below is defined
        or len(splits_E) != E
    ):
        return None
    if out is None:
        return GroupedCall(a_TX, [w_ENK], splits_E, a_TX.new_empty(out_shape))
    out_TX = cast(Tensor, out)
    if (
        out_TX.dtype != dtype
        or out_TX.device != device
        or out_TX.shape != out_shape
        or not out_TX.is_contiguous()
        or (out_TX.requires_grad and torch.is_grad_enabled())
        or _overlap.contiguous_meets(out_TX, (a_TX, w_ENK))
    ):
        return None
    return GroupedCall(a_TX, [w_ENK], splits_E, out_TX)


def _plain_eager(*tensors: object, optional: object) -> bool:
    """Whether ``tensors`` (and ``optional`` unless ``None``) are exactly ``torch.Tensor`` or
    ``nn.Parameter`` and nothing traces: what the lean passes take."""
    if optional is not None and type(optional) not in PLAIN_TYPES:
        return False
    return all(type(t) in PLAIN_TYPES for t in tensors) and not torch.compiler.is_compiling()


def _lean_splits(splits: Tensor, rows: int, device: torch.device) -> bool:
    """Whether ``_validate``'s check of ``splits`` accepts the plain tensor ``splits`` (its length aside)."""
    if splits.dtype not in _splits.SPLITS_DTYPES or splits.dim() != 1:
        return False
    if splits.device.type != "cpu":
        return splits.device == device
    return _splits.counts_fit(splits.tolist(), rows)


def packed_wgrad_call(
    dy: object, x: object, splits: object, out: object, out_dtype: object, accumulate: object
) -> WgradCall | None:
    """The common wgrad call, accepted in one pass of cheap tests, else ``None``.

    As :func:`packed_call`: plain contiguous tensors on one device, ``out``
    absent or one packed ``(E, N, K)`` tensor apart from the inputs; each test
    a condition of ``_validate.wgrad_call``'s detailed checks, which run (and name
    what is wrong) when one fails.
    """
    if (
        not _plain_eager(dy, x, splits, optional=out)
        or type(accumulate) is not bool
        or not (out_dtype is None or out_dtype in WGRAD_OUT_DTYPES)
    ):
        return None
    dy_TN, x_TK, splits_E = cast(Tensor, dy), cast(Tensor, x), cast(Tensor, splits)
    device, dtype = dy_TN.device, dy_TN.dtype
    if (
        dtype not in INPUT_DTYPES
        or x_TK.dtype != dtype
        or x_TK.device != device
        or device.type not in ("cpu", "cuda")
        or dy_TN.dim() != 2
        or x_TK.dim() != 2
        or x_TK.shape[0] != dy_TN.shape[0]
        or not (dy_TN.is_contiguous() and x_TK.is_contiguous())
        or not _lean_splits(splits_E, dy_TN.shape[0], device)
        or not len(splits_E)
    ):
        return None
    shape = (len(splits_E), dy_TN.shape[1], x_TK.shape[1])
    if out is None:
        if accumulate:
            return None
        dw_ENK = torch.empty(shape, dtype=out_dtype or dtype, device=device)
        return WgradCall(dy_TN, x_TK, splits_E, [dw_ENK], accumulate, dw_ENK)
    out_ENK = cast(Tensor, out)
    if (
        out_ENK.shape != shape
        or out_ENK.dtype not in WGRAD_OUT_DTYPES
        or not (out_dtype is None or out_ENK.dtype == out_dtype)
        or out_ENK.device != device
        or not out_ENK.is_contiguous()
        or (out_ENK.requires_grad and torch.is_grad_enabled())
        or _overlap.contiguous_meets(out_ENK, (dy_TN, x_TK))
    ):
        return None
    return WgradCall(dy_TN, x_TK, splits_E, [out_ENK], accumulate, out_ENK)
