"""The FP8 blockwise quantizers' math: the pure-PyTorch reference and the custom ops.

Legend: ``T`` tokens, ``C`` channels (a multiple of 128), ``E`` experts,
``N``/``K`` a weight's rows/columns, ``B = C / 128``, ``NB`` the 128-token
blocks of the ``(128, 1)`` form, ``Tp`` its padded token count (layouts:
``groupgrad.kernels._fp8.Fp8Blocks``).

One scale rule for every block: with ``amax = m * 2**e`` (``1 <= m < 2``) the
scale is the smallest power of two at or above ``amax / 448``, found from the
float's bits without a division (``2**(e-8)`` when ``m <= 1.75``, else
``2**(e-7)``), at least ``2**-126``; a zero block gets scale 1, a block with a
NaN or Inf gets scale NaN (canonical, bits ``0x7FC00000``) and zero data, so it
dequantizes to NaN. ``data = e4m3(clamp(x * (1 / scale), -448, 448))``,
rounded to nearest even, with the reciprocal (a power of two) built from bits
too: the reference here and the Triton kernels (``_fp8_triton``) agree bit for
bit. All math is fp32 from the input.

Malformed device ``splits`` (a negative count, or counts not summing to
``T``: a device tensor is never read on the host, so nothing can raise) make
every scale of the ``(128, 1)`` form NaN, so whatever consumes it (the wgrad,
``dequantize``) gives NaN rather than a plausible wrong value; its data is
then unspecified, the ``(1, 128)`` form from the same read stays exact (it
does not depend on ``splits``), and no kernel reads or writes outside its
tensors (:func:`malformed`).

Three custom ops — ``groupgrad::quantize_fp8_rows``, ``…_weights`` and
``…_segments`` (the last writes the ``(1, 128)`` form too from the same read)
— run the reference on every device but CUDA, where they run Triton (imported
on the first CUDA call; without it, or before sm_89, the reference runs and
says so once through ``logging``). On sm_90 the segments op of a bfloat16 or
float16 activation runs the CUTLASS extension's one-read CUDA kernel instead
(:func:`cuda_quantizer`; the same bits as Triton's two kernels, one read of
``x`` instead of two). Their fake kernels let
``torch.compile(fullgraph=True)`` and CUDA graphs see them. In plain eager
code :func:`rows`, :func:`weights` and :func:`segments` call the kernel of the
input's device directly instead (:func:`direct_or_op`, the rule of
``_ops.direct_call_ok``), as the GEMMs and the bf16 SwiGLU do: on the H200
(torch 2.11) the op machinery cost more host time per call than the kernel's
own launch (DEVICE_RUNS 84).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from groupgrad.kernels import _ops

__all__ = [
    "cuda_quantizer",
    "direct_or_op",
    "load_triton_kernels",
    "offsets",
    "offsets_ref",
    "rows",
    "rows_op",
    "say_once",
    "segment_offsets",
    "segments",
    "segments_op",
    "token_map",
    "triton_for",
    "weights",
    "weights_op",
]

logger = logging.getLogger(__name__)

TRITON_MODULE = "groupgrad.kernels._fp8_triton"
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
_R = TypeVar("_R")


# ---------------------------------------------------------------- reference


def scale_rule(amax_bits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(scale, inverse, finite)`` of blocks from the int32 bits of their ``max |x|``.

    ``amax_bits`` are those of non-negative floats (NaN bits rank above Inf's),
    so an integer max over ``|x|``'s bits finds them without NaN rules.
    """
    exponent = (amax_bits >> 23) - 8 + ((amax_bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    exponent = exponent.clamp(min=1)  # a normal scale, 2**-126 at least
    finite, zero = amax_bits < 0x7F800000, amax_bits == 0
    scale = torch.where(zero, 1.0, (exponent << 23).view(torch.float32))
    inverse = torch.where(zero, 1.0, ((254 - exponent) << 23).view(torch.float32))
    return torch.where(finite, scale, float("nan")), inverse, finite


def _abs_bits(x: Tensor) -> Tensor:
    return x.float().contiguous().view(torch.int32) & 0x7FFFFFFF


def _to_e4m3(x: Tensor, inverse: Tensor, finite: Tensor) -> Tensor:
    y = (x.float() * inverse).clamp(-E4M3_MAX, E4M3_MAX)
    return torch.where(finite, y, 0.0).to(E4M3)


def rows_ref(x_TC: Tensor) -> tuple[Tensor, Tensor]:
    """``(1, 128)`` blocks: ``data_TC`` e4m3 and ``scales_BT`` fp32 (``B = C / 128``)."""
    T, C = x_TC.shape
    x = x_TC.float().reshape(T, C // 128, 128)
    scale, inverse, finite = scale_rule(_abs_bits(x).amax(dim=2))
    data = _to_e4m3(x, inverse[..., None], finite[..., None]).reshape(T, C)
    return data, scale.t().contiguous()


def weights_ref(weights: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(128, 128)`` blocks of a group in op form (``[w_ENK]``, or ``E`` contiguous ``(N, K)``
    matrices), stacked: ``data``, ``data_t``, ``scales``."""
    N, K = weights[0].shape[-2:]
    x = torch.cat([(w if w.dim() == 3 else w[None]).float() for w in weights])
    E = x.shape[0]
    blocks = x.reshape(E, N // 128, 128, K // 128, 128)
    scale, inverse, finite = scale_rule(_abs_bits(blocks).amax(dim=(2, 4)))
    spread = (slice(None), slice(None), None, slice(None), None)
    data = _to_e4m3(blocks, inverse[spread], finite[spread]).reshape(E, N, K)
    return data, data.transpose(1, 2).contiguous(), scale


SEGMENT_ALIGN = 16  # tokens: each expert's data columns start 16-byte aligned


def segment_offsets(
    splits: Sequence[int] | Tensor, device: torch.device, fused: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """``(row, seg, block)`` offsets, ``(E + 1,)`` int64 on ``device``: each expert's first
    row of ``t``, data column (16-aligned) and scale row. Device splits: device math only,
    ``fused`` in one kernel where it can (``_fp8_ops.offsets``; the ``*_ref`` twins keep
    the reference's)."""
    if isinstance(splits, Tensor):
        sizes = splits.to(device=device)
        if fused:
            return offsets(sizes, SEGMENT_ALIGN)
        return offsets_ref(sizes, SEGMENT_ALIGN)
    counts = [int(n) for n in splits]
    steps = (lambda n: n, lambda n: -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN, lambda n: -(-n // 128))
    table = [list(itertools.accumulate(map(f, counts), initial=0)) for f in steps]
    row, seg, block = torch.tensor(table, dtype=torch.int64, device=device).unbind(0)
    return row, seg, block


def offsets_ref(sizes: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(row, seg, block)``: 0, then the running sums of the ``(E,)`` token counts, of the
    counts rounded up to ``align`` and of their 128-token blocks, ``(E + 1,)`` int64 each."""
    # Three cumsums and cats, not one cumsum of a stacked (3, E) table: torch 2.11's
    # Inductor fails to lower a searchsorted over a row of that table (DEVICE_RUNS 82).
    sizes = sizes.to(torch.int64)
    zero = sizes.new_zeros(1)
    seg = (sizes + align - 1) // align * align
    row, seg, block = (torch.cat([zero, s.cumsum(0)]) for s in (sizes, seg, (sizes + 127) // 128))
    return row, seg, block


class TokenMap(NamedTuple):
    column: Tensor  # (T,) each token's column in the (C, Tp) data
    block_row: Tensor  # (T,) its row in the (NB, C) scales
    malformed: Tensor  # () bool: the offsets' splits are malformed (see malformed())


def malformed(row_offsets: Tensor, T: int) -> Tensor:
    """``()`` bool, on the offsets' device (never read here): the ``(E + 1,)`` running sums
    of the token counts fall somewhere (a negative count) or do not end at ``T``."""
    falls = (row_offsets[1:] < row_offsets[:-1]).any()
    return falls | (row_offsets[-1] != T)


def token_map(row_offsets: Tensor, seg_offsets: Tensor, block_offsets: Tensor, T: int) -> TokenMap:
    """Each token's data column and scale row. For any offsets of ``E`` integer counts
    (malformed too) they stay in bounds: column in ``[t, t + 15 E)``, scale row below
    ``ceil(T / 128) + E``; the Triton kernels, which walk blocks rather than tokens, need
    a stand-in for malformed splits (``_fp8_triton._segment``)."""
    token = torch.arange(T, device=row_offsets.device)
    expert = torch.searchsorted(row_offsets[1:], token, right=True)  # in [0, E]
    local = token - row_offsets[expert]
    column, block_row = seg_offsets[expert] + local, block_offsets[expert] + local // 128
    return TokenMap(column, block_row, malformed(row_offsets, T))


def segments_ref(
    x_TC: Tensor,
    row_offsets: Tensor,
    seg_offsets: Tensor,
    block_offsets: Tensor,
    num_blocks: int,
    padded_tokens: int,
    with_rows: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(128, 1)`` blocks inside each expert's segment: ``data_CTp``, ``scales_NBC`` and,
    ``with_rows``, the ``(1, 128)`` form's ``rows_ref`` results (else two empty tensors)."""
    T, C = x_TC.shape
    where = token_map(row_offsets, seg_offsets, block_offsets, T)
    bits = _abs_bits(x_TC)
    amax_bits = bits.new_zeros(num_blocks, C)
    amax_bits.scatter_reduce_(0, where.block_row[:, None].expand(T, C), bits, "amax")
    scale, inverse, finite = scale_rule(amax_bits)
    used = torch.arange(num_blocks, device=x_TC.device) < block_offsets[-1]
    scales = torch.where(used[:, None], scale, 0.0).masked_fill_(where.malformed, float("nan"))
    q_TC = _to_e4m3(x_TC, inverse[where.block_row], finite[where.block_row])
    data = torch.zeros(C, padded_tokens, dtype=torch.uint8, device=x_TC.device)
    data.index_copy_(1, where.column, q_TC.view(torch.uint8).t())
    if with_rows:
        return data.view(E4M3), scales, *rows_ref(x_TC)
    empty = x_TC.new_empty(0, dtype=torch.float32)
    return data.view(E4M3), scales, empty.to(E4M3), empty


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("groupgrad::quantize_fp8_rows", mutates_args=())
def rows_op(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(1, 128)`` blocks of a contiguous ``(T, C)``: ``data_TC``, ``scales_BT``."""
    return rows_ref(x)


@torch.library.custom_op("groupgrad::quantize_fp8_weights", mutates_args=())
def weights_op(weights: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(128, 128)`` blocks of ``[w_ENK]`` or ``E`` ``(N, K)`` matrices, contiguous: ``data``,
    ``data_t``, ``scales``."""
    return weights_ref(weights)


@torch.library.custom_op("groupgrad::quantize_fp8_segments", mutates_args=())
def segments_op(
    x: Tensor,
    row_offsets: Tensor,
    seg_offsets: Tensor,
    block_offsets: Tensor,
    num_blocks: int,
    padded_tokens: int,
    with_rows: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(128, 1)`` blocks (and, ``with_rows``, ``(1, 128)`` blocks) of ``x``."""
    return segments_ref(
        x, row_offsets, seg_offsets, block_offsets, num_blocks, padded_tokens, with_rows
    )


@rows_op.register_fake
def _rows_fake(x: Tensor) -> tuple[Tensor, Tensor]:
    T, C = x.shape
    return x.new_empty(T, C, dtype=E4M3), x.new_empty(C // 128, T, dtype=torch.float32)


@weights_op.register_fake
def _weights_fake(weights: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    E, (N, K) = sum(w.shape[0] if w.dim() == 3 else 1 for w in weights), weights[0].shape[-2:]
    new = weights[0].new_empty
    return (
        new(E, N, K, dtype=E4M3),
        new(E, K, N, dtype=E4M3),
        new(E, N // 128, K // 128, dtype=torch.float32),
    )


@segments_op.register_fake
def _segments_fake(
    x: Tensor, row_offsets: Tensor, seg_offsets: Tensor, block_offsets: Tensor,
    num_blocks: int, padded_tokens: int, with_rows: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    C = x.shape[1]
    rows = (
        _rows_fake(x)
        if with_rows
        else (x.new_empty(0, dtype=E4M3), x.new_empty(0, dtype=torch.float32))
    )
    data = x.new_empty(C, padded_tokens, dtype=E4M3)
    return data, x.new_empty(num_blocks, C, dtype=torch.float32), *rows


@functools.cache
def load_triton_kernels(module: str = TRITON_MODULE) -> tuple[ModuleType | None, str | None]:
    """Import a module of FP8 Triton kernels once: ``(module, None)`` or ``(None, reason)``."""
    try:
        return importlib.import_module(module), None
    except ImportError as error:
        return None, f"triton cannot be imported ({error})"


@functools.cache
def say_once(message: str) -> None:
    logger.warning(message)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """``device``'s compute capability, asked once (about 5 µs of host time a question)."""
    return torch.cuda.get_device_capability(device)


def triton_for(
    x: Tensor, module: str = TRITON_MODULE, what: str = "FP8 quantization"
) -> ModuleType | None:
    """``module``'s Triton kernels for ``x``'s device, or ``None`` (said once) to run the reference."""
    kernels, reason = load_triton_kernels(module)
    if kernels is not None and _capability(x.device) < (8, 9):
        kernels, reason = None, f"{x.device} has no FP8 conversions (sm_89 or later needed)"
    if kernels is None:
        say_once(f"{what} runs on the PyTorch reference on CUDA: {reason}")
    return kernels


@rows_op.register_kernel("cuda")
def _rows_cuda(x: Tensor) -> tuple[Tensor, Tensor]:
    kernels = triton_for(x)
    return rows_ref(x) if kernels is None else kernels.rows_triton(x)


@weights_op.register_kernel("cuda")
def _weights_cuda(weights: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    kernels = triton_for(weights[0])
    if kernels is None:
        return weights_ref(weights)
    data, data_t, scales = kernels.weights_triton(weights)
    if weights[0].dtype == torch.float32:
        # Measured on the H200 (torch 2.11's Triton): the kernel's transposed store of an fp32
        # input's tile writes wrong bytes (its data and scales are right), so the transpose is
        # taken from the data instead — the same bits the reference gives.
        data_t = data.transpose(-1, -2).contiguous()
    return data, data_t, scales


@segments_op.register_kernel("cuda")
def _segments_cuda(
    x: Tensor, row_offsets: Tensor, seg_offsets: Tensor, block_offsets: Tensor,
    num_blocks: int, padded_tokens: int, with_rows: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    cutlass = cuda_quantizer(x, padded_tokens)
    if cutlass is not None:
        outputs = _segments_fake(
            x, row_offsets, seg_offsets, block_offsets, num_blocks, padded_tokens, with_rows
        )  # the outputs' shapes, allocated; the kernel writes every element
        cutlass.fp8_elementwise(
            "fp8_segments", x, row_offsets, seg_offsets, block_offsets, *outputs
        )
        return outputs
    kernels = triton_for(x)
    run = segments_ref if kernels is None else kernels.segments_triton
    return run(x, row_offsets, seg_offsets, block_offsets, num_blocks, padded_tokens, with_rows)


def cuda_quantizer(x: Tensor, padded_tokens: int) -> ModuleType | None:
    """The CUTLASS backend when its one-read quantizer takes ``x``, else ``None`` (Triton's two
    kernels then: the same bits; on the H200 the one read is 1.5x as fast, DEVICE_RUNS 141).
    The FP8 SwiGLU backward asks it too, for ``da`` (``_swiglu_fp8._backward_cuda``).

    It takes a contiguous, 16-byte aligned bfloat16 or float16 ``x`` on an sm_90
    device, and a ``padded_tokens`` multiple of 16, where the extension is loaded
    or can be built (it builds on first use, as for the GEMMs).
    """
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous():
        return None
    if x.data_ptr() % 16 or padded_tokens % 16:
        return None
    return cuda_extension(x.device)


def cuda_extension(device: torch.device) -> ModuleType | None:
    """The CUTLASS backend where it runs on ``device`` (sm_90; built on first use), else ``None``."""
    cutlass, _ = _ops.load_cutlass()
    if cutlass is None:
        return None
    try:
        return None if cutlass.unavailable_reason(device) else cutlass
    except RuntimeError:  # the [cuda] extra's build tools are missing: no build, Triton runs
        return None


# ---------------------------------------------------------------- calls


def direct_or_op(
    name: str,
    op: Callable[..., _R],
    kernels: tuple[Callable[..., _R], Callable[..., _R]],
    tensors: Sequence[Tensor | None],
    *args: Any,
) -> _R:
    """``op(*args)``, or in plain eager code (``_ops.direct_call_ok`` on ``tensors``, the
    first one's device deciding) its CUDA kernel ``kernels[0]`` or reference ``kernels[1]``
    called directly, in a profiler range named ``name`` (the op's)."""
    present = [t for t in tensors if t is not None]
    if not _ops.direct_call_ok(present):
        return op(*args)
    kernel = kernels[0] if present[0].is_cuda else kernels[1]
    return _ops.run_directly(name, kernel, *args)


def offsets(sizes: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`offsets_ref`; for CUDA ``sizes`` in plain eager code one launch instead of about
    a dozen small ones: the CUTLASS extension's kernel on sm_90 (a Triton launch costs the
    host about 3x as much), else Triton's (when Triton is there: else the reference, said once)."""
    if sizes.is_cuda and _ops.direct_call_ok([sizes]):
        cutlass = cuda_extension(sizes.device)
        if cutlass is not None:
            row, seg, block = cutlass.fp8_elementwise("fp8_offsets", sizes, align)
            return row, seg, block
        kernels = triton_for(sizes)
        found = None if kernels is None else kernels.offsets_triton(sizes, align)
        if found is not None:
            return found
    return offsets_ref(sizes, align)


def rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`rows_op`, directly in plain eager code."""
    return direct_or_op("groupgrad::quantize_fp8_rows", rows_op, (_rows_cuda, rows_ref), [x], x)


def weights(members: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`weights_op`, directly in plain eager code."""
    kernels = (_weights_cuda, weights_ref)
    return direct_or_op("groupgrad::quantize_fp8_weights", weights_op, kernels, members, members)


def segments(
    x: Tensor, row_offsets: Tensor, seg_offsets: Tensor, block_offsets: Tensor,
    num_blocks: int, padded_tokens: int, with_rows: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """:func:`segments_op`, directly in plain eager code."""
    offsets = [row_offsets, seg_offsets, block_offsets]
    return direct_or_op(
        "groupgrad::quantize_fp8_segments", segments_op, (_segments_cuda, segments_ref),
        [x, *offsets], x, *offsets, num_blocks, padded_tokens, with_rows,
    )  # fmt: skip
