"""Pure-PyTorch grouped GEMMs: the reference path and the oracle for GPU tests.

These functions take validated arguments in op form (a group of matrices as
``_group`` describes it; ``splits_E`` an int32/int64 tensor) and write into
``out``; they run on any device. They are the default kernels of the custom
ops, the fallback of the CUDA kernels and the body of the ``*_ref`` twins;
each reads the token counts on the host (a sync for a device tensor; the
values are checked there) and takes the group apart into per-expert
matrices in one place, :func:`_per_expert_and_counts`.

Each expert's product is computed in fp32 (inputs are upcast, so a bf16/fp16
product is exact and the sum is accumulated in fp32) and rounded once into
the output dtype. For wgrad, accumulating adds the fp32 product to ``out``
in fp32 before that single rounding (``D = C + A·B``, as the CUTLASS epilogue
does); overwriting never reads ``out``. An fp32 ``out`` (e.g. a ``main_grad``)
is written in place by the matrix product itself, with no weight-sized
scratch. An ambient ``torch.autocast`` does not apply: the products run in
fp32 as stated, like the CUTLASS kernels, whatever the caller's context; an output
made under ``torch.inference_mode()`` is written as the CUTLASS kernels write it.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor

from groupgrad.kernels._group import host_values, per_expert

_P = ParamSpec("_P")
_R = TypeVar("_R")


def writing(out: Tensor | Sequence[Tensor]) -> contextlib.AbstractContextManager[object]:
    """Where ``out`` is written in place: inside ``torch.inference_mode()`` where it holds a
    tensor made in that mode and the caller is outside it (PyTorch refuses such in-place
    updates there; the CUDA kernels write through the address, and the reference writes it
    as they do), else in the caller's context."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    if any(map(Tensor.is_inference, [out] if isinstance(out, Tensor) else out)):
        return torch.inference_mode()
    return contextlib.nullcontext()


def _as_kernel(kernel: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``kernel`` as the CUDA kernels run, whatever the caller's context: autocast off on
    its first operand's device (fp32 stays fp32), and its output (the fourth argument)
    written even where it is an inference tensor (:func:`writing`)."""

    @functools.wraps(kernel)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with writing(args[3]):  # type: ignore[arg-type]
            return _autocast_off(kernel, *args, **kwargs)

    return run


def _autocast_off(kernel: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    device_type = args[0].device.type  # type: ignore[attr-defined]
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return kernel(*args, **kwargs)
    return kernel(*args, **kwargs)


def _per_expert_and_counts(
    group: Sequence[Tensor], splits_E: Tensor, rows_of: Tensor, rows_name: str
) -> tuple[list[Tensor], list[int]]:
    """The group's per-expert matrices and the token counts as host ints, checked against ``rows_of``."""
    return per_expert(group), host_values(splits_E, rows_of.shape[0], rows_name)


@_as_kernel
def fprop(x_TK: Tensor, w_group: Sequence[Tensor], splits_E: Tensor, y_TN: Tensor) -> None:
    """``y_e = x_e @ w_e.T`` for each expert ``e``; overwrites ``y_TN``."""
    _rows_times_weights(x_TK, "x", w_group, splits_E, y_TN, transpose_weights=True)


@_as_kernel
def dgrad(dy_TN: Tensor, w_group: Sequence[Tensor], splits_E: Tensor, dx_TK: Tensor) -> None:
    """``dx_e = dy_e @ w_e`` for each expert ``e``; overwrites ``dx_TK``."""
    _rows_times_weights(dy_TN, "dy", w_group, splits_E, dx_TK, transpose_weights=False)


def _rows_times_weights(
    a_TX: Tensor,
    a_name: str,
    w_group: Sequence[Tensor],
    splits_E: Tensor,
    out_TX: Tensor,
    transpose_weights: bool,
) -> None:
    """Each expert's rows of ``a_TX`` times its weight (``w_e.T`` or ``w_e``), in fp32, into ``out_TX``."""
    w_list, splits = _per_expert_and_counts(w_group, splits_E, a_TX, a_name)
    start = 0
    for w_NK, count in zip(w_list, splits, strict=True):
        if count:
            rows = slice(start, start + count)
            w = w_NK.float().T if transpose_weights else w_NK.float()
            out_TX[rows].copy_(a_TX[rows].float() @ w)
        start += count


@_as_kernel
def wgrad(
    dy_TN: Tensor,
    x_TK: Tensor,
    splits_E: Tensor,
    dw_group: Sequence[Tensor],
    accumulate: bool,
) -> None:
    """``dw_e = dy_e.T @ x_e`` into the group's matrix ``e``: added when ``accumulate``, else written.

    An expert with no tokens has a zero gradient: its ``dw`` is left as it is
    when accumulating and set to exactly zero when overwriting.
    """
    dw_list, splits = _per_expert_and_counts(dw_group, splits_E, x_TK, "x")
    start = 0
    for dw_NK, count in zip(dw_list, splits, strict=True):
        if count == 0:
            if not accumulate:
                dw_NK.zero_()
            continue
        rows = slice(start, start + count)
        dyT_NT, x_TK_e = dy_TN[rows].float().T, x_TK[rows].float()
        if dw_NK.dtype == torch.float32 and dw_NK.is_contiguous():
            # fp32 output (e.g. main_grad): the product lands in place, no scratch
            if accumulate:
                dw_NK.addmm_(dyT_NT, x_TK_e)
            else:
                torch.mm(dyT_NT, x_TK_e, out=dw_NK)
        elif accumulate:
            dw_NK.add_(dyT_NT @ x_TK_e)  # fp32 sum, one rounding into dw's dtype
        else:
            dw_NK.copy_(dyT_NT @ x_TK_e)
        start += count
