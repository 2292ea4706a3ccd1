"""The FP8 grouped GEMMs' kernels: the reference, the custom ops, and CUTLASS on CUDA.

``groupgrad::fp8_grouped_{fprop,dgrad,wgrad}`` take an :class:`Fp8Blocks`
apart into its tensors (``Fp8Blocks.tensors()``), so ``torch.compile`` and
CUDA graphs see them; each writes into its ``out`` and returns nothing, as
the bf16 ops do (``_ops``), and a call in plain eager code skips the op
machinery the same way (``_ops.direct_call_ok``).

**Reference semantics** (any device, and the CPU's kernel): dequantize each
operand to fp32 (``Fp8Blocks.dequantize``), then the bf16 path's reference
(``_reference``) on the fp32 operands: each expert's product in fp32, one
rounding into ``out``, ``accumulate`` as there.

**On CUDA** the CUTLASS sm_90a blockwise-scaled kernels run when the backend
loads, the device can run them, a variant for the output dtype is compiled
and the tensors are placed as the kernels need (``_ops.fp8_cutlass_or_reason``);
otherwise the reference runs and the reason is logged once (``_ops.say_once``).

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features,
``Tp``/``NB`` the padded token columns and scale rows of the ``(128, 1)`` form.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from groupgrad.kernels import _group, _ops, _reference
from groupgrad.kernels._fp8 import ROWS, SEGMENTS, WEIGHTS, Fp8Blocks, segment_offsets
from groupgrad.kernels._group import ListedFacts

# --------------------------------------------------------------------------- reference


def _rows(data: Tensor, scales: Tensor) -> Tensor:
    return _dequantized(Fp8Blocks(data, scales, block=ROWS, dtype=torch.float32, shape=data.shape))


def _weights(data: Tensor, scales: Tensor) -> Tensor:
    blocks = Fp8Blocks(data, scales, block=WEIGHTS, dtype=torch.float32, shape=data.shape)
    return _dequantized(blocks)


def _segments(data: Tensor, scales: Tensor, row_offsets: Tensor, tokens: int) -> Tensor:
    """A ``(128, 1)`` operand dequantized in the layout its token counts (``row_offsets``'
    steps) give, as the CUDA kernels' setup derives it: its other offsets are not read."""
    row, seg, block = segment_offsets(torch.diff(row_offsets), row_offsets.device)
    blocks = Fp8Blocks(
        data, scales, block=SEGMENTS, dtype=torch.float32, shape=(tokens, data.shape[0]),
        row_offsets=row, seg_offsets=seg, block_offsets=block,
    )  # fmt: skip
    return _dequantized(blocks)


def _dequantized(blocks: Fp8Blocks) -> Tensor:
    return cast(Tensor, blocks.dequantize())  # never listed: a tensor


def rows_ref(
    op: str,
    a_data: Tensor,
    a_scales: Tensor,
    w_data: Tensor,
    w_data_t: Tensor,
    w_scales: Tensor,
    splits: Tensor,
    out: Tensor,
) -> None:
    """FP8 fprop (``y_e = x_e @ w_e.T``) or dgrad (``dx_e = dy_e @ w_e``) on dequantized operands.

    Each reads the weight orientation its CUDA kernel reads: fprop ``w_data``, dgrad
    ``w_data_t`` (with the same scales, transposed), so a form whose two orientations
    disagree gives the same answer on either path.
    """
    if op == "fprop":
        w32 = _weights(w_data, w_scales)
    else:
        w32 = _weights(w_data_t, w_scales.transpose(-1, -2)).transpose(-1, -2)
    a32 = _rows(a_data, a_scales)
    gemm = _reference.fprop if op == "fprop" else _reference.dgrad
    gemm(a32, [w32], splits, out)


def wgrad_ref(
    dy_data: Tensor,
    dy_scales: Tensor,
    dy_row_offsets: Tensor,
    x_data: Tensor,
    x_scales: Tensor,
    x_row_offsets: Tensor,
    splits: Tensor,
    tokens: int,
    out: list[Tensor],
    accumulate: bool,
) -> None:
    """FP8 wgrad (``dw_e = dy_e.T @ x_e``) on dequantized operands, into ``out``.

    Operands cut by other counts than ``splits`` (their ``row_offsets``' steps)
    make every output NaN, as the CUDA kernels' setup does on the device
    (csrc/fp8_setup.cu): a device tensor is never compared on the host, and
    under ``torch.compile`` no host check runs at all.
    """
    dy32 = _segments(dy_data, dy_scales, dy_row_offsets, tokens)
    x32 = _segments(x_data, x_scales, x_row_offsets, tokens)
    _reference.wgrad(dy32, x32, splits, out, accumulate)
    counts = splits.to(device=dy_data.device, dtype=torch.int64)
    cut_otherwise = torch.zeros((), dtype=torch.bool, device=dy_data.device)
    for row in (dy_row_offsets, x_row_offsets):
        cut_otherwise |= (row[0] != 0) | (torch.diff(row) != counts).any()
    with _reference.writing(out):
        for dw in out:
            dw.masked_fill_(cut_otherwise.to(dw.device), float("nan"))


# --------------------------------------------------------------------------- CUDA


def _rows_on_device(
    op: str,
    a_data: Tensor,
    a_scales: Tensor,
    w_data: Tensor,
    w_data_t: Tensor,
    w_scales: Tensor,
    splits: Tensor,
    out: Tensor,
    *,
    placed: bool = False,
) -> None:
    if a_data.shape[0] == 0:
        return
    w_used = w_data if op == "fprop" else w_data_t
    data = [("a.data", a_data), ("weights.data", w_used)]
    scales = [("a.scales", a_scales), ("weights.scales", w_scales)]
    cutlass, reason = _ops.fp8_cutlass_or_reason(op, data, scales, out, placed=placed)
    if cutlass is None:
        _ops.say_once(f"FP8 grouped_{op} runs on the reference path: {reason}")
        rows_ref(op, a_data, a_scales, w_data, w_data_t, w_scales, splits, out)
        return
    launch = cutlass.fp8_fprop if op == "fprop" else cutlass.fp8_dgrad
    launch(a_data, a_scales, w_used, w_scales, _group.on_device(splits, a_data.device), out)


def fprop_on_device(
    x_data: Tensor,
    x_scales: Tensor,
    w_data: Tensor,
    w_data_t: Tensor,
    w_scales: Tensor,
    splits: Tensor,
    out: Tensor,
) -> None:
    """CUDA kernel of ``groupgrad::fp8_grouped_fprop``."""
    _rows_on_device("fprop", x_data, x_scales, w_data, w_data_t, w_scales, splits, out)


def dgrad_on_device(
    dy_data: Tensor,
    dy_scales: Tensor,
    w_data: Tensor,
    w_data_t: Tensor,
    w_scales: Tensor,
    splits: Tensor,
    out: Tensor,
) -> None:
    """CUDA kernel of ``groupgrad::fp8_grouped_dgrad``."""
    _rows_on_device("dgrad", dy_data, dy_scales, w_data, w_data_t, w_scales, splits, out)


def wgrad_on_device(
    dy_data: Tensor,
    dy_scales: Tensor,
    dy_row_offsets: Tensor,
    x_data: Tensor,
    x_scales: Tensor,
    x_row_offsets: Tensor,
    splits: Tensor,
    tokens: int,
    out: list[Tensor],
    accumulate: bool,
    *,
    listed: ListedFacts | None = None,
    placed: bool = False,
) -> None:
    """CUDA kernel of ``groupgrad::fp8_grouped_wgrad`` (``listed``: as ``_ops.wgrad``'s;
    ``placed``: the operands' seals found them placed, ``Fp8Blocks._placed``)."""
    if tokens == 0:
        _ops.zero_gradient(out, accumulate)
        return
    data = [("dy.data", dy_data), ("x.data", x_data)]
    scales = [("dy.scales", dy_scales), ("x.scales", x_scales)]
    cutlass, reason = _ops.fp8_cutlass_or_reason("wgrad", data, scales, out, listed, placed)
    if cutlass is None:
        _ops.say_once(f"FP8 grouped_wgrad runs on the reference path: {reason}")
        wgrad_ref(
            dy_data, dy_scales, dy_row_offsets, x_data, x_scales, x_row_offsets, splits, tokens,
            out, accumulate,
        )  # fmt: skip
        return
    on_device = _group.on_device(splits, dy_data.device)
    cutlass.fp8_wgrad(
        dy_data, dy_scales, dy_row_offsets, x_data, x_scales, x_row_offsets, on_device, tokens,
        out, accumulate,
    )  # fmt: skip


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("groupgrad::fp8_grouped_fprop", mutates_args=("out",))
def fp8_fprop_op(
    x_data: Tensor,
    x_scales: Tensor,
    w_data: Tensor,
    w_data_t: Tensor,
    w_scales: Tensor,
    splits: Tensor,
    out: Tensor,
) -> None:
    """Reference kernel: ``y_e = x_e @ w_e.T`` from ``(1, 128)`` x and ``(128, 128)`` weights."""
    rows_ref("fprop", x_data, x_scales, w_data, w_data_t, w_scales, splits, out)


@torch.library.custom_op("groupgrad::fp8_grouped_dgrad", mutates_args=("out",))
def fp8_dgrad_op(
    dy_data: Tensor,
    dy_scales: Tensor,
    w_data: Tensor,
    w_data_t: Tensor,
    w_scales: Tensor,
    splits: Tensor,
    out: Tensor,
) -> None:
    """Reference kernel: ``dx_e = dy_e @ w_e`` from ``(1, 128)`` dy and ``(128, 128)`` weights."""
    rows_ref("dgrad", dy_data, dy_scales, w_data, w_data_t, w_scales, splits, out)


@torch.library.custom_op("groupgrad::fp8_grouped_wgrad", mutates_args=("out",))
def fp8_wgrad_op(
    dy_data: Tensor,
    dy_scales: Tensor,
    dy_row_offsets: Tensor,
    x_data: Tensor,
    x_scales: Tensor,
    x_row_offsets: Tensor,
    splits: Tensor,
    tokens: int,
    out: list[Tensor],
    accumulate: bool,
) -> None:
    """Reference kernel: ``dw_e = dy_e.T @ x_e`` from ``(128, 1)`` operands, into ``out``."""
    wgrad_ref(
        dy_data, dy_scales, dy_row_offsets, x_data, x_scales, x_row_offsets, splits, tokens, out,
        accumulate,
    )  # fmt: skip


fp8_fprop_op.register_kernel("cuda")(fprop_on_device)
fp8_dgrad_op.register_kernel("cuda")(dgrad_on_device)
fp8_wgrad_op.register_kernel("cuda")(wgrad_on_device)
_ops.recomputed_under_selective_checkpoint(fp8_fprop_op, fp8_dgrad_op, fp8_wgrad_op)


@fp8_fprop_op.register_fake
def _fp8_fprop_fake(*args: object) -> None:
    return None


@fp8_dgrad_op.register_fake
def _fp8_dgrad_fake(*args: object) -> None:
    return None


@fp8_wgrad_op.register_fake
def _fp8_wgrad_fake(*args: object) -> None:
    return None


# --------------------------------------------------------------------------- calls


def placed_for_kernels(form: Fp8Blocks) -> bool:
    """Whether the CUDA kernels may read ``form``'s data and scales where they lie (the
    support check's rule, ``_support.fp8_placed``); its seal keeps the answer."""
    data = [form.data] if form.data_t is None else [form.data, form.data_t]
    return _ops.support_check().fp8_placed(data, form.scales)


def rows(
    op: str,
    a: Fp8Blocks,
    w: Fp8Blocks,
    splits: Tensor,
    out: Tensor,
    *,
    reference: bool = False,
) -> None:
    """Run a validated FP8 fprop/dgrad (``reference``: the reference, on any device); on
    CUDA, the forms' seals (just renewed by the validator) say whether they are placed."""
    args = (a.data, a.scales, w.data, cast(Tensor, w.data_t), w.scales, splits, out)
    if reference:
        rows_ref(op, *args)
    elif not _ops.direct_call_ok([a.data, out, splits]):
        (fp8_fprop_op if op == "fprop" else fp8_dgrad_op)(*args)
    else:
        name = f"groupgrad::fp8_grouped_{op}"
        if out.is_cuda:
            placed = a._placed(placed_for_kernels) and w._placed(placed_for_kernels)
            _ops.run_directly(name, _rows_on_device, op, *args, placed=placed)
        else:
            _ops.run_directly(name, rows_ref, op, *args)
        torch.autograd.graph.increment_version(out)


def wgrad(
    dy: Fp8Blocks,
    x: Fp8Blocks,
    splits: Tensor,
    out: list[Tensor],
    accumulate: bool,
    listed: ListedFacts | None,
    *,
    reference: bool = False,
) -> None:
    """Run a validated FP8 wgrad (``reference``: the reference, on any device); on CUDA, the
    forms' seals say whether they are placed (a prepared call runs before its arguments
    change; the extension's entry checks their placement again)."""
    args = (
        dy.data, dy.scales, cast(Tensor, dy.row_offsets), x.data, x.scales,
        cast(Tensor, x.row_offsets), splits, dy.shape[0], out, accumulate,
    )  # fmt: skip  # validated: the offsets are tensors
    if reference:
        wgrad_ref(*args)
    elif not _ops.direct_call_ok([dy.data, x.data, splits], out, listed):
        fp8_wgrad_op(*args)
    else:
        name = "groupgrad::fp8_grouped_wgrad"
        if out[0].is_cuda:
            placed = dy._placed(placed_for_kernels) and x._placed(placed_for_kernels)
            _ops.run_directly(name, wgrad_on_device, *args, listed=listed, placed=placed)
        else:
            _ops.run_directly(name, wgrad_ref, *args)
        torch.autograd.graph.increment_version(out)
