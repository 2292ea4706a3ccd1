"""The one validator of the grouped GEMMs: their argument rules, each written once.

Every public entry point — kernel and reference twin alike — passes its
arguments through :func:`grouped_call` (fprop, dgrad) or :func:`wgrad_call`
before anything is written, so a rejected call leaves ``out`` untouched, and
gets back a :class:`GroupedCall` or :class:`WgradCall` in op form. Problems
raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (shape, device,
layout, token counts, overlap) naming the argument — as the caller named it,
through ``names`` — its value and what was expected.

Each rule has one form: one combined cheap test that accepts the common case
(plain contiguous tensors on one device, a packed group, integer ``splits``)
and, only when that test fails, the checks that name the misfit. So the
common call passes in one pass of cheap tests and a wrong one gets its
message from the same function.

What is checked for ``splits`` depends on where it lives:

* a Python sequence or a CPU tensor: length, dtype, and the values (each
  ``>= 0``, summing to the number of rows);
* a device tensor: length, dtype and device only — reading the values would
  synchronize the host. The reference path reads (and then checks) them
  anyway; the CUTLASS path never does.

Under ``torch.compile`` (fake and functional tensors: never the cheap test's
plain types) the checks that need real memory (the values of a CPU
``splits`` tensor, overlap between outputs and inputs) are skipped, a length
traced from data is checked when the graph runs, and the reference kernel
still checks the values of ``splits`` when it reads them.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from groupgrad.kernels import _group, _rules, _rules_fp8
from groupgrad.kernels._fp8 import ROWS, SEGMENTS, WEIGHTS, Fp8Blocks
from groupgrad.kernels._group import ListedFacts


@dataclass(frozen=True)
class GroupedCall:
    """A validated fprop (``y_e = x_e @ w_e.T``) or dgrad (``dx_e = dy_e @ w_e``) call.

    ``a`` is ``x_TK`` for fprop and ``dy_TN`` for dgrad; ``out`` is ``y_TN``
    or ``dx_TK``; ``weights`` is in op form (``_group``); ``splits`` is
    ``splits_E``, an int32/int64 tensor on the CPU or ``a``'s device;
    ``listed`` holds what one pass over listed weights found (``None`` for
    packed weights).
    """

    a: Tensor
    weights: list[Tensor]
    splits: Tensor
    out: Tensor
    listed: ListedFacts | None = None


@dataclass(frozen=True)
class WgradCall:
    """A validated wgrad call: ``dw_e = dy_e.T @ x_e`` written into ``out``.

    ``dy`` is ``dy_TN``, ``x`` is ``x_TK``, ``splits`` is ``splits_E``;
    ``out`` is in op form (``[dw_ENK]`` or ``E`` matrices); ``result`` is
    what the public function returns (the caller's ``out`` object, or the
    freshly allocated ``(E, N, K)`` tensor); ``listed`` holds what one pass
    over listed outputs found (``None`` otherwise).
    """

    dy: Tensor
    x: Tensor
    splits: Tensor
    out: list[Tensor]
    accumulate: bool
    result: Tensor | Sequence[Tensor]
    listed: ListedFacts | None = None


def grouped_call(
    op: Literal["fprop", "dgrad"],
    a: object,
    weights: object,
    splits: object,
    out: object,
    names: object = None,
) -> GroupedCall:
    """Check an fprop/dgrad call and put its arguments into op form.

    ``names``: how messages name the weights (``None``: ``weights`` /
    ``weights[e]``).
    """
    a_name = "x" if op == "fprop" else "dy"
    a_TX = _rules.input_matrix(a_name, a)
    label = _group.labeler("weights", names)
    w_group, (E, N, K), listed = _rules.weights_arg(weights, a_name, a_TX, label)
    T = a_TX.shape[0]
    inner, inner_name = (K, "K") if op == "fprop" else (N, "N")
    if a_TX.shape[1] != inner:
        raise ValueError(
            f"{a_name} has {a_TX.shape[1]} columns, expected {inner_name} = {inner} "
            f"like weights of shape (E, N, K) = ({E}, {N}, {K})"
        )
    splits_E = _rules.splits_arg(splits, a_name, T, a_TX.device, experts=E)
    out_shape = (T, N) if op == "fprop" else (T, K)
    out_TX = _rules.row_out(out, out_shape, a_TX.dtype, a_name, a_TX, w_group, listed, label)
    return GroupedCall(a_TX, w_group, splits_E, out_TX, listed)


def wgrad_call(
    dy: object,
    x: object,
    splits: object,
    out: object,
    out_dtype: object,
    accumulate: object,
    names: object = None,
) -> WgradCall:
    """Check a wgrad call and put its arguments into op form.

    ``names``: how messages name ``out`` (``None``: ``out`` / ``out[e]``).
    """
    dy_TN = _rules.input_matrix("dy", dy)
    x_TK = _rules.input_matrix("x", x)
    if x_TK.dtype != dy_TN.dtype:
        raise TypeError(f"x has dtype {x_TK.dtype}, expected {dy_TN.dtype} like dy")
    _rules.check_device("x", x_TK, "dy", dy_TN)
    splits_E, accumulate = _rules.wgrad_splits(
        splits, x_TK.shape[0], dy_TN.shape[0], x_TK.device, accumulate
    )
    E, N, K = splits_E.shape[0], dy_TN.shape[1], x_TK.shape[1]
    members, result, listed = _rules.wgrad_out(
        out, (E, N, K), out_dtype, accumulate, dy_TN.dtype, dy_TN, x_TK, names
    )
    return WgradCall(dy_TN, x_TK, splits_E, members, accumulate, result, listed)


# --- FP8 calls ----------------------------------------------------------------


def is_fp8(a: object, b: object) -> bool:
    """Whether a call names FP8 operands (it then takes the FP8 calls below, both operands FP8)."""
    return isinstance(a, Fp8Blocks) or isinstance(b, Fp8Blocks)


@dataclass(frozen=True)
class Fp8RowsCall:
    """A validated FP8 fprop or dgrad call: ``a`` ``(1, 128)`` rows, ``weights`` ``(128, 128)``.

    ``a`` is ``x`` for fprop and ``dy`` for dgrad; ``out`` (``y_TN`` or
    ``dx_TK``) is in the dtype ``a`` was quantized from, or the caller's.
    """

    a: Fp8Blocks
    weights: Fp8Blocks
    splits: Tensor
    out: Tensor


@dataclass(frozen=True)
class Fp8WgradCall:
    """A validated FP8 wgrad call: ``dy`` and ``x`` ``(128, 1)`` token segments.

    ``out``, ``result`` and ``listed`` as in :class:`WgradCall`.
    """

    dy: Fp8Blocks
    x: Fp8Blocks
    splits: Tensor
    out: list[Tensor]
    accumulate: bool
    result: Tensor | Sequence[Tensor]
    listed: ListedFacts | None = None


def fp8_rows_call(
    op: Literal["fprop", "dgrad"],
    a: object,
    weights: object,
    splits: object,
    out: object,
    names: object = None,
) -> Fp8RowsCall:
    """Check an FP8 fprop/dgrad call (``names`` as in :func:`grouped_call`)."""
    a_name = "x" if op == "fprop" else "dy"
    label = _group.labeler("weights", names)
    a8 = _rules_fp8.fp8_operand(a_name, a, ROWS)
    w8 = _rules_fp8.fp8_operand(label(None), weights, WEIGHTS)
    _rules.check_device(label(None), w8.data, a_name, a8.data)
    (T, cols), (E, N, K) = a8.shape, w8.shape
    inner, inner_name = (K, "K") if op == "fprop" else (N, "N")
    if cols != inner:
        raise ValueError(
            f"{a_name} has {cols} columns, expected {inner_name} = {inner} "
            f"like weights of shape (E, N, K) = ({E}, {N}, {K})"
        )
    splits_E = _rules.splits_arg(splits, a_name, T, a8.data.device, experts=E)
    out_shape = (T, N) if op == "fprop" else (T, K)
    dtype = a8.dtype
    if isinstance(out, Tensor) and out.dtype in _rules.WGRAD_OUT_DTYPES:
        dtype = out.dtype
    out_TX = _rules.row_out(out, out_shape, dtype, a_name, a8.data, [w8.data], None, label)
    return Fp8RowsCall(a8, w8, splits_E, out_TX)


def fp8_wgrad_call(
    dy: object,
    x: object,
    splits: object,
    out: object,
    out_dtype: object,
    accumulate: object,
    names: object = None,
) -> Fp8WgradCall:
    """Check an FP8 wgrad call (arguments as in :func:`wgrad_call`; fp32 by default)."""
    dy8 = _rules_fp8.fp8_operand("dy", dy, SEGMENTS)
    x8 = _rules_fp8.fp8_operand("x", x, SEGMENTS)
    _rules.check_device("x", x8.data, "dy", dy8.data)
    splits_E, accumulate = _rules.wgrad_splits(
        splits, x8.shape[0], dy8.shape[0], x8.data.device, accumulate
    )
    for name, operand in (("dy", dy8), ("x", x8)):
        _rules_fp8.fp8_splits_agree(name, operand, splits_E, splits)
    E, N, K = splits_E.shape[0], dy8.shape[1], x8.shape[1]
    members, result, listed = _rules.wgrad_out(
        out, (E, N, K), out_dtype, accumulate, torch.float32, dy8.data, x8.data, names
    )
    return Fp8WgradCall(dy8, x8, splits_E, members, accumulate, result, listed)
