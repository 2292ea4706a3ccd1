"""Public grouped GEMMs and their pure-PyTorch twins.

Each public kernel validates its arguments (``_validate``), then runs the
matching ``groupgrad::`` custom op (``_ops``): CUTLASS on CUDA where it can,
the reference elsewhere. Each twin ``*_ref`` validates the same way and runs
the reference (``_reference``) directly, on any device.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, overload

import torch
from torch import Tensor

from groupgrad.kernels import _fp8_gemm, _ops, _reference, _validate
from groupgrad.kernels._fp8 import Fp8Blocks

Splits = Sequence[int] | Tensor
Weights = Tensor | Sequence[Tensor] | Fp8Blocks
Rows = Tensor | Fp8Blocks
OutList = TypeVar("OutList", bound=Sequence[Tensor])


def grouped_fprop(
    x: Rows,
    weights: Weights,
    splits: Splits,
    *,
    out: Tensor | None = None,
    names: Sequence[str] | None = None,
) -> Tensor:
    """Grouped forward GEMM: ``y_e = x_e @ w_e.T`` for every expert ``e``.

    Rows of ``x`` are grouped by expert in order: expert ``e`` owns the next
    ``splits[e]`` rows. On CUDA the CUTLASS kernel runs when it supports the
    call (bf16/fp16, contiguous, ``K`` and ``N`` multiples of 8, 16-byte
    aligned); otherwise, and on every other device, the reference runs (a
    fallback is logged once). Products accumulate in fp32. Not differentiable:
    autograd lives in ``groupgrad.modules``; with grad mode on, inputs that
    require grad are refused (their gradient would silently be lost).

    **FP8**: with ``x`` an :class:`Fp8Blocks` of block ``(1, 128)`` and
    ``weights`` one of block ``(128, 128)`` (both from :func:`quantize_fp8`),
    the sm_90a blockwise-scaled CUTLASS kernel runs (the reference, which
    dequantizes and multiplies in fp32, elsewhere); ``y`` is in the dtype
    ``x`` was quantized from, or ``out``'s (bf16, fp16 or fp32). FP8 and
    bf16/fp16/fp32 operands never mix.

    Args:
        x: ``(T, K)`` input, bf16, fp16 or fp32, row-major; or its ``(1, 128)``
            :class:`Fp8Blocks` (``K`` a multiple of 128).
        weights: ``(E, N, K)`` tensor or a sequence of ``E`` ``(N, K)``
            tensors (each row-major; not necessarily adjacent in memory), in
            ``x``'s dtype and on its device; or their ``(128, 128)``
            :class:`Fp8Blocks` when ``x`` is FP8.
        splits: ``E`` token counts, each ``>= 0``, summing to ``T``: a
            sequence of ints, a CPU tensor, or an int32/int64 tensor on
            ``x``'s device (its values are not checked, and the CUTLASS path
            never reads them on the host).
        out: optional ``(T, N)`` row-major tensor in ``x``'s dtype; it is
            overwritten (the only argument written).
        names: how error messages name the weights: one name for a packed
            tensor, one per matrix of a sequence (e.g. the parameters'
            names); default ``weights`` / ``weights[e]``.

    Returns:
        ``y`` of shape ``(T, N)`` in ``x``'s dtype: ``out`` itself when given.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: a shape, device, layout, ``splits`` or overlap mismatch.
            Nothing is written when a call is rejected.
    """
    if _validate.is_fp8(x, weights):
        fp8 = _validate.fp8_rows_call("fprop", x, weights, splits, out, names)
        _fp8_gemm.rows("fprop", fp8.a, fp8.weights, fp8.splits, fp8.out)
        return fp8.out
    call = _validate.grouped_call("fprop", x, weights, splits, out, names)
    _ops.fprop(call.a, call.weights, call.splits, call.out, call.listed)
    return call.out


def grouped_dgrad(
    dy: Rows,
    weights: Weights,
    splits: Splits,
    *,
    out: Tensor | None = None,
    names: Sequence[str] | None = None,
) -> Tensor:
    """Grouped input-gradient GEMM: ``dx_e = dy_e @ w_e`` for every expert ``e``.

    Rows of ``dy`` are grouped by expert in order. Backend choice, numerics,
    ``splits`` and FP8 operands as in :func:`grouped_fprop` (one quantized
    weight serves both: its ``data_t`` is dgrad's operand). Not differentiable.

    Args:
        dy: ``(T, N)`` output gradient, bf16, fp16 or fp32, row-major; or its
            ``(1, 128)`` :class:`Fp8Blocks`.
        weights: ``(E, N, K)`` tensor or a sequence of ``E`` ``(N, K)``
            tensors, in ``dy``'s dtype and on its device; or their
            ``(128, 128)`` :class:`Fp8Blocks` when ``dy`` is FP8.
        splits: ``E`` token counts summing to ``T`` (see
            :func:`grouped_fprop`).
        out: optional ``(T, K)`` row-major tensor in ``dy``'s dtype; it is
            overwritten (the only argument written).
        names: how error messages name the weights (see :func:`grouped_fprop`).

    Returns:
        ``dx`` of shape ``(T, K)`` in ``dy``'s dtype: ``out`` itself when given.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: a shape, device, layout, ``splits`` or overlap mismatch.
            Nothing is written when a call is rejected.
    """
    if _validate.is_fp8(dy, weights):
        fp8 = _validate.fp8_rows_call("dgrad", dy, weights, splits, out, names)
        _fp8_gemm.rows("dgrad", fp8.a, fp8.weights, fp8.splits, fp8.out)
        return fp8.out
    call = _validate.grouped_call("dgrad", dy, weights, splits, out, names)
    _ops.dgrad(call.a, call.weights, call.splits, call.out, call.listed)
    return call.out


@overload
def grouped_wgrad(
    dy: Rows,
    x: Rows,
    splits: Splits,
    *,
    out: None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    names: Sequence[str] | None = None,
) -> Tensor: ...
@overload
def grouped_wgrad(
    dy: Rows,
    x: Rows,
    splits: Splits,
    *,
    out: Tensor,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    names: Sequence[str] | None = None,
) -> Tensor: ...
@overload
def grouped_wgrad(
    dy: Rows,
    x: Rows,
    splits: Splits,
    *,
    out: OutList,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    names: Sequence[str] | None = None,
) -> OutList: ...
def grouped_wgrad(
    dy: Rows,
    x: Rows,
    splits: Splits,
    *,
    out: Tensor | Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    names: Sequence[str] | None = None,
) -> Tensor | Sequence[Tensor]:
    """Grouped weight-gradient GEMM: ``dw_e = dy_e.T @ x_e`` for every expert ``e``.

    The tokens are the reduction dimension: an expert with no tokens has a
    zero gradient (``out[e]`` exactly zero when overwriting, untouched when
    accumulating). ``dy`` is read transposed without a copy on the CUTLASS
    path. Backend choice, numerics and ``splits`` as in
    :func:`grouped_fprop`; the output dtype is independent of the input
    dtype, so a bf16 GEMM can write straight into fp32 ``main_grad`` buffers.
    Not differentiable.

    **FP8**: with ``dy`` and ``x`` :class:`Fp8Blocks` of block ``(128, 1)``
    (128-token blocks inside each expert's segment, from :func:`quantize_fp8`
    with ``splits``; their ``splits`` may be given in another form than this
    call's, but must hold the same counts), the sm_90a blockwise-scaled
    CUTLASS kernel writes straight into ``out`` from its epilogue — fp32 by
    default, ``accumulate`` as above, no token padding, no host sync with a
    device ``splits``.

    Args:
        dy: ``(T, N)`` output gradient, bf16, fp16 or fp32, row-major; or its
            ``(128, 1)`` :class:`Fp8Blocks` (``N`` a multiple of 128).
        x: ``(T, K)`` input in ``dy``'s dtype and on its device; or its
            ``(128, 1)`` :class:`Fp8Blocks` when ``dy`` is FP8.
        splits: ``E`` token counts summing to ``T`` (see
            :func:`grouped_fprop`); its length sets ``E``.
        out: optional ``(E, N, K)`` tensor, or a sequence of ``E`` ``(N, K)``
            tensors (for example each expert's own ``main_grad``), bf16, fp16
            or fp32 (one dtype), row-major, not overlapping each other or the
            inputs. It is written in place (the only argument written).
        out_dtype: dtype of a freshly allocated output (``out`` not given);
            with ``out`` it must equal ``out``'s dtype. Default: ``dy``'s
            (fp32 for FP8 operands).
        accumulate: ``True`` adds the gradient into ``out`` (``D = C + A·B``
            in fp32, rounded once); ``False`` overwrites ``out`` without
            reading it (old contents, even NaN, do not matter). ``True``
            requires ``out``.
        names: how error messages name ``out``: one name for a packed
            ``(E, N, K)`` tensor, or one per member (e.g. the parameters'
            ``weight3.main_grad``); default ``out`` / ``out[e]``.

    Returns:
        ``dw``: ``out`` itself (the same tensor or the same sequence object)
        when given, else a new ``(E, N, K)`` tensor.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: a shape, device, layout, ``splits`` or overlap mismatch.
            Nothing is written when a call is rejected.
    """
    return prepare_wgrad(
        dy, x, splits, out=out, out_dtype=out_dtype, accumulate=accumulate, names=names
    ).run()


class PreparedWgrad:
    """A :func:`grouped_wgrad` call whose arguments were checked; ``run()`` runs it.

    Made by :func:`prepare_wgrad`. Run it before changing any of its
    arguments: the checks held for the arguments as they were then. It runs
    once: a second ``run()`` raises instead of adding the gradient twice.

    Args:
        call: The validator's op form of the call (made by :func:`prepare_wgrad`).
    """

    def __init__(self, call: object) -> None:
        if not isinstance(call, _validate.WgradCall | _validate.Fp8WgradCall):
            raise TypeError(
                f"call is a {type(call).__name__}; a PreparedWgrad comes from prepare_wgrad()"
            )
        self._call: _validate.WgradCall | _validate.Fp8WgradCall | None = call

    def run(self) -> Tensor | Sequence[Tensor]:
        """Run the GEMM (CUTLASS or the reference, as :func:`grouped_wgrad`).

        Returns:
            What :func:`grouped_wgrad` returns: ``out`` itself, or the new
            ``(E, N, K)`` tensor.

        Raises:
            RuntimeError: It ran already (a wgrad lands exactly once).
        """
        call, self._call = self._call, None
        if call is None:
            raise RuntimeError(
                "this PreparedWgrad ran already; prepare the call again to run it again"
            )
        if isinstance(call, _validate.Fp8WgradCall):
            _fp8_gemm.wgrad(call.dy, call.x, call.splits, call.out, call.accumulate, call.listed)
        else:
            _ops.wgrad(call.dy, call.x, call.splits, call.out, call.accumulate, call.listed)
        return call.result


def prepare_wgrad(
    dy: Rows,
    x: Rows,
    splits: Splits,
    *,
    out: Tensor | Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    names: Sequence[str] | None = None,
) -> PreparedWgrad:
    """Check a :func:`grouped_wgrad` call now and run it later, writing nothing yet.

    An op with several wgrad GEMMs (a fused MLP's fc1 and fc2) prepares every
    one before the first runs, so a call rejected for any layer writes no
    layer's ``out``. ``grouped_wgrad(...)`` is ``prepare_wgrad(...).run()``:
    the arguments are checked once.

    Args:
        dy, x, splits, out, out_dtype, accumulate, names: as
            :func:`grouped_wgrad`.

    Returns:
        The checked call; its :meth:`PreparedWgrad.run` runs the GEMM.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: a shape, device, layout, ``splits`` or overlap mismatch.
    """
    if _validate.is_fp8(dy, x):
        fp8 = _validate.fp8_wgrad_call(dy, x, splits, out, out_dtype, accumulate, names)
        return PreparedWgrad(fp8)
    return PreparedWgrad(_validate.wgrad_call(dy, x, splits, out, out_dtype, accumulate, names))


def grouped_fprop_ref(
    x: Rows,
    weights: Weights,
    splits: Splits,
    *,
    out: Tensor | None = None,
    names: Sequence[str] | None = None,
) -> Tensor:
    """Pure-PyTorch twin of :func:`grouped_fprop`: same arguments, checks and result.

    Runs on any device, computing each expert's product in fp32. A device
    ``splits`` is read on the host (the values are then checked), which
    synchronizes with the device.

    Args:
        x: ``(T, K)`` input, bf16, fp16 or fp32.
        weights: ``(E, N, K)`` tensor or a sequence of ``E`` ``(N, K)`` tensors.
        splits: ``E`` token counts summing to ``T``.
        out: optional ``(T, N)`` tensor in ``x``'s dtype; overwritten.
        names: how error messages name the weights (see :func:`grouped_fprop`).

    Returns:
        ``y`` of shape ``(T, N)``: ``out`` itself when given.
    """
    if _validate.is_fp8(x, weights):
        fp8 = _validate.fp8_rows_call("fprop", x, weights, splits, out, names)
        _fp8_gemm.rows("fprop", fp8.a, fp8.weights, fp8.splits, fp8.out, reference=True)
        return fp8.out
    call = _validate.grouped_call("fprop", x, weights, splits, out, names)
    _reference.fprop(call.a, call.weights, call.splits, call.out)
    return call.out


def grouped_dgrad_ref(
    dy: Rows,
    weights: Weights,
    splits: Splits,
    *,
    out: Tensor | None = None,
    names: Sequence[str] | None = None,
) -> Tensor:
    """Pure-PyTorch twin of :func:`grouped_dgrad`: same arguments, checks and result.

    Runs on any device; a device ``splits`` is read on the host (a sync).

    Args:
        dy: ``(T, N)`` output gradient, bf16, fp16 or fp32.
        weights: ``(E, N, K)`` tensor or a sequence of ``E`` ``(N, K)`` tensors.
        splits: ``E`` token counts summing to ``T``.
        out: optional ``(T, K)`` tensor in ``dy``'s dtype; overwritten.
        names: how error messages name the weights (see :func:`grouped_fprop`).

    Returns:
        ``dx`` of shape ``(T, K)``: ``out`` itself when given.
    """
    if _validate.is_fp8(dy, weights):
        fp8 = _validate.fp8_rows_call("dgrad", dy, weights, splits, out, names)
        _fp8_gemm.rows("dgrad", fp8.a, fp8.weights, fp8.splits, fp8.out, reference=True)
        return fp8.out
    call = _validate.grouped_call("dgrad", dy, weights, splits, out, names)
    _reference.dgrad(call.a, call.weights, call.splits, call.out)
    return call.out


@overload
def grouped_wgrad_ref(
    dy: Rows,
    x: Rows,
    splits: Splits,
    *,
    out: None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    names: Sequence[str] | None = None,
) -> Tensor: ...
@overload
def grouped_wgrad_ref(
    dy: Rows,
    x: Rows,
    splits: Splits,
    *,
    out: Tensor,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    names: Sequence[str] | None = None,
) -> Tensor: ...
@overload
def grouped_wgrad_ref(
    dy: Rows,
    x: Rows,
    splits: Splits,
    *,
    out: OutList,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    names: Sequence[str] | None = None,
) -> OutList: ...
def grouped_wgrad_ref(
    dy: Rows,
    x: Rows,
    splits: Splits,
    *,
    out: Tensor | Sequence[Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    names: Sequence[str] | None = None,
) -> Tensor | Sequence[Tensor]:
    """Pure-PyTorch twin of :func:`grouped_wgrad`: same arguments, checks and result.

    Runs on any device; a device ``splits`` is read on the host (a sync).

    Args:
        dy: ``(T, N)`` output gradient, bf16, fp16 or fp32.
        x: ``(T, K)`` input in ``dy``'s dtype.
        splits: ``E`` token counts summing to ``T``.
        out: optional ``(E, N, K)`` tensor or sequence of ``E`` ``(N, K)``
            tensors, bf16, fp16 or fp32; written in place.
        out_dtype: dtype of a freshly allocated output.
        accumulate: add into ``out`` (``True``) or overwrite it (``False``).
        names: how error messages name ``out`` (see :func:`grouped_wgrad`).

    Returns:
        ``dw``: ``out`` itself when given, else a new ``(E, N, K)`` tensor.
    """
    if _validate.is_fp8(dy, x):
        fp8 = _validate.fp8_wgrad_call(dy, x, splits, out, out_dtype, accumulate, names)
        _fp8_gemm.wgrad(
            fp8.dy, fp8.x, fp8.splits, fp8.out, fp8.accumulate, fp8.listed, reference=True
        )
        return fp8.result
    call = _validate.wgrad_call(dy, x, splits, out, out_dtype, accumulate, names)
    _reference.wgrad(call.dy, call.x, call.splits, call.out, call.accumulate)
    return call.result
