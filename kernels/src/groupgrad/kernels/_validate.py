"""The one validator of the grouped GEMMs: their argument rules, each written once.

Every public entry point — kernel and reference twin alike — passes its arguments
through :func:`grouped_call` (fprop, dgrad) or :func:`wgrad_call` (with ``Fp8Blocks``
operands: :func:`fp8_rows_call`, :func:`fp8_wgrad_call`) before anything is written, so
a rejected call leaves ``out`` untouched, and gets back a :class:`GroupedCall` or
:class:`WgradCall` (or their FP8 forms) in op form. The rules every call shares are in
``_rules``; the FP8 operand rules (:func:`fp8_operand`, :func:`fp8_splits_agree`) are at
the end of this module, beside the FP8 calls, their only users. Problems raise
``TypeError`` (wrong type or dtype) or ``ValueError`` (shape, device, layout, token
counts, overlap) naming the argument — as the caller named it, through ``names`` — its
value and what was expected. Each rule has one form (see ``_rules``; a sealed
``Fp8Blocks`` passes the FP8 rules' cheap test).

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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import Tensor

from groupgrad.kernels import _group, _rules
from groupgrad.kernels._fp8 import (
    ROWS,
    SEGMENT_ALIGN,
    SEGMENTS,
    WEIGHTS,
    Block,
    Fp8Blocks,
    segment_offsets,
)
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
    _rules.check_unrecorded(f"grouped_{op}", [(a_name, a_TX), (label(None), w_group)], listed)
    T = a_TX.shape[0]
    _rules.check_inner(op, a_name, a_TX.shape[1], (E, N, K))
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
    _rules.check_unrecorded("grouped_wgrad", [("dy", dy_TN), ("x", x_TK)], None)
    splits_E, accumulate = _rules.wgrad_splits(
        splits, x_TK.shape[0], dy_TN.shape[0], x_TK.device, accumulate
    )
    E, N, K = splits_E.shape[0], dy_TN.shape[1], x_TK.shape[1]
    members, result, listed = _rules.wgrad_out(
        out, (E, N, K), out_dtype, accumulate, dy_TN.dtype, dy_TN, x_TK, names
    )
    return WgradCall(dy_TN, x_TK, splits_E, members, accumulate, result, listed)


# --- FP8 calls ----------------------------------------------------------------
#
# An FP8 call takes Fp8Blocks operands of the blocks its GEMM reads — (1, 128) rows and
# (128, 128) weights for fprop/dgrad, (128, 1) token segments for wgrad — never mixed with
# bf16/fp16/fp32 tensors (fp8_operand). Their other arguments (splits, out) follow the
# same rules as every call (_rules).


def is_fp8(a: object, b: object) -> bool:
    """Whether a call names FP8 operands (it then takes the FP8 calls below, both operands FP8)."""
    return isinstance(a, Fp8Blocks) or isinstance(b, Fp8Blocks)


@dataclass(frozen=True)
class Fp8RowsCall:
    """A validated FP8 fprop or dgrad call: ``a`` ``(1, 128)`` rows (``x`` or ``dy``),
    ``weights`` ``(128, 128)``; ``out`` (``y_TN`` or ``dx_TK``) in ``a``'s source dtype or
    the caller's."""

    a: Fp8Blocks
    weights: Fp8Blocks
    splits: Tensor
    out: Tensor


@dataclass(frozen=True)
class Fp8WgradCall:
    """A validated FP8 wgrad call: ``dy``, ``x`` ``(128, 1)`` segments; the rest as :class:`WgradCall`."""

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
    a_name, label = ("x" if op == "fprop" else "dy"), _group.labeler("weights", names)
    w_name = label(None)
    a8 = fp8_operand(a_name, a, ROWS)
    w8 = fp8_operand(w_name, weights, WEIGHTS)
    _rules.check_device(w_name, w8.data, a_name, a8.data)
    read = [(a_name, a8.data), (a_name, a8.scales), (w_name, w8.data), (w_name, w8.scales)]
    _rules.check_unrecorded(f"grouped_{op}", read, None)
    (T, cols), (E, N, K) = a8.shape, w8.shape
    _rules.check_inner(op, a_name, cols, (E, N, K))
    splits_E = _rules.splits_arg(splits, a_name, T, a8.data.device, experts=E)
    out_shape = (T, N) if op == "fprop" else (T, K)
    dtype = _rules.fp8_row_out_dtype(out, op, a_name, a8.dtype)
    data_t = cast(Tensor, w8.data_t)  # a weights form holds both orientations
    w_read, w_other = (w8.data, data_t) if op == "fprop" else (data_t, w8.data)
    also = [(f"{a_name}.scales", a8.scales), (f"{w_name}.scales", w8.scales), (w_name, w_other)]
    out_TX = _rules.row_out(out, out_shape, dtype, a_name, a8.data, [w_read], None, label, also)
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
    dy8 = fp8_operand("dy", dy, SEGMENTS)
    x8 = fp8_operand("x", x, SEGMENTS)
    _rules.check_device("x", x8.data, "dy", dy8.data)
    read = [("dy", dy8.data), ("dy", dy8.scales), ("x", x8.data), ("x", x8.scales)]
    _rules.check_unrecorded("grouped_wgrad", read, None)
    splits_E, accumulate = _rules.wgrad_splits(
        splits, x8.shape[0], dy8.shape[0], x8.data.device, accumulate
    )
    fp8_splits_agree((("dy", dy8), ("x", x8)), splits_E, splits)
    E, N, K = splits_E.shape[0], dy8.shape[1], x8.shape[1]
    scales = [("dy.scales", dy8.scales), ("x.scales", x8.scales)]
    members, result, listed = _rules.wgrad_out(
        out, (E, N, K), out_dtype, accumulate, torch.float32, dy8.data, x8.data, names, scales
    )
    return Fp8WgradCall(dy8, x8, splits_E, members, accumulate, result, listed)


def _host_offsets_counts(name: str, value: Fp8Blocks, starts: list[int]) -> list[int]:
    """The token counts of a ``(128, 1)`` form's host ``row_offsets`` (``starts``), once its
    offsets are checked to be what ``quantize_fp8`` writes for them: a hand-built form's
    other offsets would make the reference read another layout than the CUDA kernels, which
    derive it from the counts, or index past its tensors."""
    counts = [b - a for a, b in itertools.pairwise(starts)]
    if starts[0] != 0 or min(counts) < 0 or starts[-1] != value.shape[0]:
        raise ValueError(
            f"{name}.row_offsets is {starts}, expected 0, then the running sums of its experts' "
            f"token counts up to T = {value.shape[0]}"
        )
    _, seg, block = segment_offsets(counts, torch.device("cpu"))
    for part, want in (("seg_offsets", seg), ("block_offsets", block)):
        got = getattr(value, part)
        if not (isinstance(got, Tensor) and got.device == want.device and torch.equal(got, want)):
            shown = got.tolist() if isinstance(got, Tensor) else f"a {type(got).__name__} ({got!r})"
            raise ValueError(
                f"{name}.{part} is {shown}, expected the tensor {want.tolist()} on cpu from its "
                "row_offsets (the layout quantize_fp8 writes)"
            )
    return counts


_FP8_ROLES = {
    ROWS: "x or dy of fprop/dgrad, h of the FP8 SwiGLU backward",
    WEIGHTS: "the weights of fprop/dgrad",
    SEGMENTS: "dy and x of wgrad, with splits",
}


def fp8_operand(name: str, value: object, block: Block) -> Fp8Blocks:
    """An :class:`Fp8Blocks` of ``block`` whose tensors have the layout the FP8 GEMMs read.

    ``quantize_fp8`` builds them so and seals the form (``Fp8Blocks._sealed``); the detailed
    checks guard a hand-built one, whose wrong layout would make a kernel read past its
    tensors, and seal it once it passes. While the seal holds, its tensors are not checked
    again, nor the shape rules once they held for it; its block and source dtype always are.
    """
    if not isinstance(value, Fp8Blocks):
        raise TypeError(
            f"{name} is a {type(value).__name__}, expected an Fp8Blocks of block {block} "
            f"({_FP8_ROLES[block]}): FP8 operands do not mix with bf16, fp16 or fp32 tensors; "
            "quantize both with quantize_fp8"
        )
    if value.block != block:
        raise ValueError(
            f"{name} is an Fp8Blocks of block {value.block}, expected {block} ({_FP8_ROLES[block]})"
        )
    if value.dtype not in _rules.INPUT_DTYPES:  # fprop/dgrad return it
        raise TypeError(
            f"{name} says it was quantized from {value.dtype}, expected {_rules.DTYPE_CHOICES}"
        )
    seal = value._seal_holds(name)
    if seal and seal[1]:  # sealed, and this seal's shape passed the rules below before
        return value
    if not isinstance(value.shape, tuple):
        raise TypeError(f"{name}.shape is {value.shape!r}, expected a tuple (its source's shape)")
    layout = _layout(name, block, value.shape, _experts(name, value))
    if seal:
        seal[1] = True
        return value
    data, scales = value.data, value.scales
    kinds = [t.dtype if isinstance(t, Tensor) else type(t).__name__ for t in (data, scales)]
    if kinds != [torch.float8_e4m3fn, torch.float32]:
        raise TypeError(
            f"{name} holds {kinds[0]} data and {kinds[1]} scales, expected "
            "torch.float8_e4m3fn and torch.float32 tensors; build it with quantize_fp8"
        )
    device = data.device
    for part, shape, strides, dtype in layout:
        t = getattr(value, part)
        if not (  # one combined test per tensor; the message only for a misfit
            isinstance(t, Tensor)
            and t.shape == shape
            and (strides is None or t.stride() == strides or _same_memory(t, strides))
            and t.device == device
            and t.dtype == dtype
        ):
            got = f"{tuple(t.shape)} {t.stride()} {t.dtype} {t.device}" if t is not None else t
            want = f"{shape} with strides {strides}" if strides else f"{shape}"
            wrong_dtype = isinstance(t, Tensor) and t.dtype != dtype
            raise (TypeError if wrong_dtype else ValueError)(
                f"{name}.{part} is {got}, expected {want} {dtype} on {device} for an Fp8Blocks of "
                f"block {block} and shape {value.shape}; build it with quantize_fp8"
            )
    return value._sealed(checked=True)


def _same_memory(t: Tensor, strides: tuple[int, ...]) -> bool:
    """Whether ``t`` is laid out as ``strides`` say where it matters: a dimension of size 1
    has no stride to speak of (a ``(T, 1)`` scale tensor is column- and row-major at once),
    nor has an empty tensor."""
    pairs = zip(t.shape, t.stride(), strides, strict=True)
    return t.numel() == 0 or all(n == 1 or a == b for n, a, b in pairs)


def _experts(name: str, value: Fp8Blocks) -> int:
    """A ``(128, 1)`` form's expert count, from its ``row_offsets`` (0 for other blocks)."""
    if value.block != SEGMENTS:
        return 0
    offsets = value.row_offsets
    E = offsets.shape[0] - 1 if isinstance(offsets, Tensor) and offsets.dim() == 1 else -1
    if E == 0:
        raise ValueError(
            f"{name} was quantized for no expert (splits had no entries), expected at least one"
        )
    if E < 0:
        got = f"of shape {tuple(offsets.shape)}" if isinstance(offsets, Tensor) else repr(offsets)
        raise ValueError(f"{name}.row_offsets is {got}, expected an (E + 1,) tensor")
    return E


_Layout = tuple[tuple[str, tuple[int, ...], tuple[int, ...] | None, torch.dtype], ...]
_E4M3, _F32, _I64 = torch.float8_e4m3fn, torch.float32, torch.int64


_LAYOUTS: dict[tuple[Block, tuple[int, ...], int], _Layout] = {}


def _layout(name: str, block: Block, shape: tuple[int, ...], E: int) -> _Layout:
    """:func:`_fp8_layout`, remembered for the last few hundred (block, shape, E) seen."""
    if torch.compiler.is_compiling():  # symbolic sizes: computed each time, never kept
        return _fp8_layout(name, block, shape, E)
    key = (block, shape, E)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _fp8_layout(name, *key)
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def _fp8_layout(name: str, block: Block, shape: tuple[int, ...], E: int) -> _Layout:
    """``(part, shape, strides or None, dtype)`` of each tensor of an ``Fp8Blocks`` of
    ``block`` and ``shape`` (see :class:`Fp8Blocks`; ``E``: a ``(128, 1)`` form's experts);
    the offsets are what the wgrad's setup kernel reads. Raises for a shape no FP8 GEMM
    takes (naming the argument ``name``)."""
    if block == WEIGHTS:
        if len(shape) != 3:
            raise ValueError(
                f"{name} is an Fp8Blocks of shape {shape}, expected (E, N, K): quantize an "
                "(E, N, K) tensor or a list of E (N, K) weights"
            )
        E, N, K = shape
        if E == 0:
            raise ValueError(
                f"{name} is an Fp8Blocks of shape {shape}, expected at least one expert"
            )
        _fp8_multiples(name, shape, (N, K))
        return (
            ("data", (E, N, K), (N * K, K, 1), _E4M3),
            ("data_t", (E, K, N), (N * K, N, 1), _E4M3),
            ("scales", (E, N // 128, K // 128), (N * K // 16384, K // 128, 1), _F32),
        )
    if len(shape) != 2:
        raise ValueError(f"{name} is a {block} Fp8Blocks of shape {shape}, expected (T, C)")
    T, C = shape
    _fp8_multiples(name, shape, (C,))
    if block == ROWS:
        return ("data", (T, C), (C, 1), _E4M3), ("scales", (T, C // 128), (1, T), _F32)
    padded = -(-(T + (SEGMENT_ALIGN - 1) * E) // SEGMENT_ALIGN) * SEGMENT_ALIGN
    blocks = -(-T // 128) + E
    counts = ((E + 1,), (1,), _I64)
    return (
        ("data", (C, padded), (padded, 1), _E4M3),
        ("scales", (blocks, C), (C, 1), _F32),
        ("row_offsets", *counts),
        ("seg_offsets", *counts),
        ("block_offsets", *counts),
    )


def _fp8_multiples(what: str, shape: tuple[int, ...], dims: tuple[int, ...]) -> None:
    if any(d % 128 for d in dims):
        raise ValueError(f"{what} has shape {shape}, expected K and N multiples of 128 for FP8")


def fp8_splits_agree(
    operands: tuple[tuple[str, Fp8Blocks], ...], splits_E: Tensor, given: object
) -> None:
    """Each ``(128, 1)`` operand (``(name, form)``, checked by :func:`fp8_operand`) was
    quantized for the experts of ``splits_E``: the same count, and the same token counts
    where both are on the host (a device tensor is never read; the wgrad's kernels compare
    the counts on the device, and a mismatch makes every output NaN). The host compares the
    counts an operand's blocks were cut by (its ``row_offsets``' steps), never the
    ``splits`` object it was quantized with, which the caller may have refilled since; with
    device offsets, the very object (``given``, the call's ``splits``) agrees unread."""
    E = splits_E.shape[0]
    for name, value in operands:
        if (experts := value.row_offsets.shape[0] - 1) != E:  # type: ignore[union-attr]
            raise ValueError(f"{name} was quantized for {experts} experts, splits has {E} entries")
    if splits_E.device.type != "cpu" or torch.compiler.is_compiling():
        return
    for name, value in operands:
        offsets = value.row_offsets
        if offsets is not None and offsets.device.type == "cpu":
            own_counts = _host_offsets_counts(name, value, offsets.tolist())
        elif value.splits is given:
            continue
        else:
            own = () if value.splits is None else value.splits
            if isinstance(own, Tensor) and own.device.type != "cpu":
                continue
            own_counts = own.tolist() if isinstance(own, Tensor) else [int(n) for n in own]
        if own_counts != splits_E.tolist():
            raise ValueError(
                f"{name} was quantized with splits {own_counts} but splits is "
                f"{splits_E.tolist()}: its 128-token blocks would straddle experts"
            )
