"""What the compiled CUTLASS kernels make of a validated call: whether they take it, and with which.

Two questions over tensor metadata and ``build``'s table of variants, both
asked on the CUDA path only (this module comes with the backend, on the
first CUDA call, never at import: ``build`` is not imported then):

* **The one support check**, :func:`unsupported_reason`. The kernels are
  compiled for bf16 and fp16 inputs with outputs in the input dtype (wgrad:
  also fp32; ``build.COMPILED_DTYPES``, the table the variants are compiled
  from), and read and write every matrix through TMA, which needs 16-byte
  aligned base addresses and row strides: ``K`` and ``N`` are multiples of 8
  (16 bytes of bf16/fp16). Dense operands and a packed group must be
  contiguous; the members of a listed group may have padded rows (a row
  stride of a multiple of 16 bytes), each at its own address. It reads tensor
  metadata only (never the values, never CUDA) and runs once per CUDA call,
  before the backend is loaded; that the backend can run on the operands'
  device (sm_90, a toolchain) is the backend's own question
  (``_cutlass.unavailable_reason``).
* **Which compiled kernel runs a call**: :class:`Plan` and :func:`plan_for`
  (public through ``groupgrad.kernels.tuning``; the heuristic and the
  measurements behind it are in ``kernels/NOTES.md``).

Operands per op, as the custom ops receive them (``a``, ``b``, ``out``):
fprop ``(x_TK, w_group, y_TN)``, dgrad ``(dy_TN, w_group, dx_TK)``, wgrad
``(dy_TN, x_TK, dw_group)``; a group of ``(N, K)`` matrices is in op form
(``_group``). Legend: ``T`` tokens, ``E`` experts (groups), ``K`` in_features,
``N`` out_features.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal, cast

import torch
from torch import Tensor

from groupgrad.kernels._group import ListedFacts, is_packed
from groupgrad.kernels.build import COMPILED_DTYPES, COOP_TILE, PONG_TILE, Variant

Op = Literal["fprop", "dgrad", "wgrad"]

CUTLASS_DTYPES = tuple(dict.fromkeys(din for pairs in COMPILED_DTYPES.values() for din, _ in pairs))
ALIGNMENT_BYTES = 16  # TMA: base addresses and row strides
SIZE_MULTIPLE = 8  # K and N, in elements: 16 bytes of bf16/fp16
MAX_DIMENSION = 2**31  # sizes are int32 on the device

_OPERAND_NAMES = {"fprop": ("x", "weights"), "dgrad": ("dy", "weights"), "wgrad": ("dy", "x")}


def unsupported_reason(
    op: Op,
    a: Tensor,
    b: Tensor | Sequence[Tensor],
    out: Tensor | Sequence[Tensor],
    *,
    listed: ListedFacts | None = None,
) -> str | None:
    """Why the CUTLASS kernels cannot take these (validated) operands, or ``None`` when they can.

    Args:
        op: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``.
        a: the row operand: ``x_TK`` (fprop) or ``dy_TN`` (dgrad, wgrad).
        b: the weights' group (fprop, dgrad) or ``x_TK`` (wgrad).
        out: ``y_TN`` (fprop), ``dx_TK`` (dgrad) or the outputs' group (wgrad).
        listed: what validation's pass over a listed group found
            (``_group``): when its members are alike (contiguous, one shape,
            dtype and device), only the first is checked in full and the
            others for their address alone.

    Returns:
        The reason, naming the operand and its value, or ``None``.
    """
    if a.dtype not in CUTLASS_DTYPES:
        return f"{a.dtype} inputs (CUTLASS takes torch.bfloat16 and torch.float16)"
    a_name, b_name = _OPERAND_NAMES[op]
    if op == "wgrad":
        second_name, second = b_name, cast(Tensor, b)
        group_name, group = "out", cast(Sequence[Tensor], out)
        K, N = second.shape[1], a.shape[1]
    else:
        second_name, second = "out", cast(Tensor, out)
        group_name, group = b_name, cast(Sequence[Tensor], b)
        K, N = (a.shape[1], second.shape[1]) if op == "fprop" else (second.shape[1], a.shape[1])
    if not group:
        return f"{group_name} holds no matrices"
    out_dtype = group[0].dtype if op == "wgrad" else second.dtype
    if (a.dtype, out_dtype) not in COMPILED_DTYPES[op]:
        return f"no compiled {op} kernel for {a.dtype} inputs with {out_dtype} output"
    packed = is_packed(group)
    whole = [(a_name, a), (second_name, second)]
    if packed:
        whole.append((group_name, group[0]))
    for name, t in whole:
        if not t.is_contiguous():
            return f"{name} is not contiguous"
    for dim, size in (("K", K), ("N", N)):
        if size % SIZE_MULTIPLE:
            return f"{dim} = {size} is not a multiple of {SIZE_MULTIPLE}"
    for name, t in whole:
        reason = _placement_reason(name, t, a.device)
        if reason is not None:
            return reason
    return None if packed else _listed_reason(group_name, group, a.device, listed)


def _placement_reason(name: str, t: Tensor, device: torch.device) -> str | None:
    """Why ``t`` is on the wrong device, misaligned or too large for int32 sizes, if it is."""
    if t.device != device:
        return f"{name} is on {t.device}, the inputs on {device}"
    if t.data_ptr() % ALIGNMENT_BYTES:
        return f"{name} is not {ALIGNMENT_BYTES}-byte aligned"
    if t.dim() and max(t.shape) >= MAX_DIMENSION:
        return f"{name} has a dimension of 2**31 or more"
    return None


def _member_reason(name: str, t: Tensor, device: torch.device) -> str | None:
    """Why CUTLASS cannot take the listed member ``t``: a row-major ``(N, K)`` matrix, if it cannot."""
    if t.dim() != 2:
        return f"{name} is {t.dim()}-D, expected a 2-D matrix"
    if t.size(1) % SIZE_MULTIPLE:
        return f"K = {t.size(1)} is not a multiple of {SIZE_MULTIPLE}"
    if t.stride(1) != 1:
        return f"{name} is not row-major (strides {tuple(t.stride())})"
    if (t.stride(0) * t.element_size()) % ALIGNMENT_BYTES and t.size(0) > 1:
        return f"{name} row stride {t.stride(0)} is not a multiple of {ALIGNMENT_BYTES} bytes"
    return _placement_reason(name, t, device)


def _listed_reason(
    name: str, group: Sequence[Tensor], device: torch.device, listed: ListedFacts | None
) -> str | None:
    """:func:`_member_reason` for every member of a listed group, in one lean pass.

    The first member is checked in full; each other one is compared with it
    (same shape and strides, same device, aligned address) and checked in
    full, naming it, only when the comparison fails. Members that ``listed``
    found alike (contiguous, one non-empty shape, one device) share the
    first's strides, so only their addresses (``listed.starts``) are read.
    """
    first = group[0]
    reason = _member_reason(f"{name}[0]", first, device)
    if reason is not None:
        return reason
    if (
        listed is not None
        and listed.alike
        and len(listed.starts) == len(group)
        and first.numel()
        and not any(map(ALIGNMENT_BYTES.__rmod__, listed.starts))
    ):
        return None
    shape, strides = first.shape, first.stride()
    for i, t in enumerate(group):
        if (
            t.stride() != strides
            or t.shape != shape
            or t.data_ptr() % ALIGNMENT_BYTES
            or t.device != device
        ):
            reason = _member_reason(f"{name}[{i}]", t, device)
            if reason is None and t.shape != shape:
                reason = f"{name}[{i}] has shape {tuple(t.shape)}, {name}[0] {tuple(shape)}"
            if reason is not None:
                return reason
    return None


def fp8_unsupported_reason(
    data: Sequence[tuple[str, Tensor]],
    scales: Sequence[tuple[str, Tensor]],
    out: Tensor | Sequence[Tensor],
    listed: ListedFacts | None = None,
    placed: bool = False,
) -> str | None:
    """Why the CUTLASS FP8 kernels cannot take these validated operands, or ``None``.

    Args:
        data: ``(name, tensor)`` of the operands' FP8 data, the first one's
            device deciding.
        scales: ``(name, tensor)`` of their scales. The validator put each
            operand's scales on its data's device, in the layout of its shape
            (never a larger dimension than the data's), so only their
            addresses are read here (the extension's entry checks them all).
        out: the fprop/dgrad output, or the wgrad's outputs' group.
        listed: as for :func:`unsupported_reason`.
        placed: the operands' forms were found placed (:func:`fp8_placed`, kept by their
            seals): only ``out`` is checked.

    Returns:
        The reason, naming the tensor, or ``None``.
    """
    device = data[0][1].device
    reason = None if placed else _operands_reason(data, scales, device)
    if reason is not None:
        return reason
    group = [out] if isinstance(out, Tensor) else list(out)
    if len(group) == 1 and group[0].dim() in (2, 3):  # a row output or a packed (E, N, K)
        if not group[0].is_contiguous():
            return "out is not contiguous"
        return _placement_reason("out", group[0], device)
    return _listed_reason("out", group, device, listed)


def _operands_reason(
    data: Sequence[tuple[str, Tensor]], scales: Sequence[tuple[str, Tensor]], device: torch.device
) -> str | None:
    """Why the FP8 kernels cannot read these operands' data or scales where they lie, if so."""
    for name, t in data:
        reason = _placement_reason(name, t, device)
        if reason is not None:
            return reason
    for name, t in scales:
        if t.data_ptr() % ALIGNMENT_BYTES:
            return f"{name} is not {ALIGNMENT_BYTES}-byte aligned"
    return None


def fp8_placed(data: Sequence[Tensor], scales: Tensor) -> bool:
    """Whether the FP8 kernels may read an operand's data (each orientation it has) and
    scales where they lie, as :func:`fp8_unsupported_reason` asks of an operand."""
    named = [("data", t) for t in data]
    return _operands_reason(named, [("scales", scales)], data[0].device) is None


# --------------------------------------------------------------------------- which kernel

_DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}

#: Tokens per group (T / E) from which :func:`plan_for` takes the ping-pong tile.
LARGE_GROUP_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which compiled variant runs a call, and the persistent scheduler's raster order.

    Attributes:
        variant: name of a compiled :class:`~groupgrad.kernels.build.Variant`
            (``Variant.name``), e.g. ``"fprop_bf16_bf16_coop_128x256x64_c1x1"``.
        raster_along_n: walk output tiles along ``N`` first (default: along ``M``).
        max_swizzle: the tile scheduler's swizzle width: 1, 2, 4 or 8.
    """

    variant: str
    raster_along_n: bool = False
    max_swizzle: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.variant, str):
            raise TypeError(f"variant must be a str, got {type(self.variant).__name__}")
        if not isinstance(self.raster_along_n, bool):
            raise TypeError(
                f"raster_along_n must be a bool, got {type(self.raster_along_n).__name__}"
            )
        swizzle = self.max_swizzle
        if type(swizzle) is not int or swizzle not in (1, 2, 4, 8):
            raise ValueError(f"max_swizzle is {self.max_swizzle!r}, expected 1, 2, 4 or 8")


def plan_for(
    op: str,
    dtype_in: torch.dtype,
    dtype_out: torch.dtype,
    T: int,
    E: int,
    N: int,
    K: int,
) -> Plan:
    """Choose the kernel of one call (the heuristic of ``kernels/NOTES.md``).

    The GEMM of one group is ``M x N' x K'``: fprop ``(T/E) x N x K``, dgrad
    ``(T/E) x K x N``, wgrad ``N x K x (T/E)`` (ragged dimension on average).
    Groups of at least :data:`LARGE_GROUP_ROWS` tokens on average take the
    ping-pong 128x128 tile with a 1x2 cluster, smaller ones the cooperative
    128x256 tile; dgrad with ``N >= 4 K`` stays cooperative.

    Args:
        op: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``.
        dtype_in: dtype of the inputs, ``torch.bfloat16`` or ``torch.float16``.
        dtype_out: dtype of the output (wgrad: also ``torch.float32``).
        T: tokens (rows of ``x`` / ``dy``).
        E: groups (experts).
        N: out_features.
        K: in_features.

    Returns:
        The :class:`Plan` (default raster order and swizzle).
    """
    rows = T / max(E, 1)
    large = rows >= LARGE_GROUP_ROWS and not (op == "dgrad" and N >= 4 * K)
    return _plan(op, _DTYPE_TAGS[dtype_in], _DTYPE_TAGS[dtype_out], large)


@functools.cache
def _plan(op: str, dtype_in: str, dtype_out: str, large: bool) -> Plan:
    # Large groups: ping-pong 128x128 (one warp group's epilogue overlaps the other's
    # mainloop) with a 1x2 cluster, so no M tile is padded to a cluster pair. Many small
    # groups: cooperative 128x256 without a cluster. Exception, measured: dgrad with a
    # reduction (N) much longer than its output rows (K) runs better cooperative
    # (E=8, K=4096, N=28672, skewed splits).
    sched, tile, cluster = PONG_TILE if large else COOP_TILE
    return Plan(Variant(op, dtype_in, dtype_out, sched, tile, cluster).name)
