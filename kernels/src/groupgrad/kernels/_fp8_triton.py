"""Triton kernels of the FP8 blockwise quantizers (the math and layouts: ``_fp8_ops``, ``_fp8``).

Imported only by the CUDA kernels of the ``groupgrad::quantize_fp8_*`` custom
ops (and by GPU tests): importing ``groupgrad.kernels`` never imports Triton.

Legend: ``T`` tokens, ``C`` channels, ``B = C / 128``, ``E`` experts,
``N``/``K`` a weight's rows/columns, ``NB`` scale rows and ``Tp`` padded tokens
of the ``(128, 1)`` form.

* ``(1, 128)``: a program quantizes ``BLOCK_T`` rows × 128 channels.
* ``(128, 128)``: a program quantizes one 128×128 tile of a weight and writes
  it twice, ``data`` ``(N, K)`` and ``data_t`` ``(K, N)``; one launch for all
  experts, listed ones apart in memory read through a table of their addresses.
* ``(128, 1)``: a program owns 128 tokens × 64 channels inside one expert's
  segment (block row ``b`` of ``NB``, found from ``block_offsets``; the grid
  is sized from the host bound ``NB = ceil(T/128) + E``, so device ``splits``
  are never read on the host). It writes the column scales, the transposed
  data (zeros past the expert's tokens up to its 16-token padding). Programs
  past the last expert zero their scale row and, between them, the data's
  tail columns. Both forms of one tensor come from two kernels, rows then
  segments: one kernel writing both held 251 registers (2 programs per SM)
  and ran up to 1.23x slower (DEVICE_RUNS 114); with the tile kept bf16 it
  still ran 0.60-0.93x as fast as the two (DEVICE_RUNS 126). On sm_90 a
  16-bit activation goes to the CUTLASS extension's one-read CUDA kernel
  instead (``_fp8_ops.cuda_quantizer``; 1.5x as fast, the same bits).
  Malformed device ``splits`` (``_fp8_ops.malformed``): every program takes
  an in-bounds stand-in (tokens ``[128 b, 128 b + 128)`` at the same columns,
  :func:`_segment`) and writes NaN scales.

Scales follow the reference's bit rule exactly: ``max |x|`` as integer bits
(no NaN rules), the power-of-two scale and its reciprocal built from bits, a
multiply, an explicit clamp to ±448, and ``.to(tl.float8e4nv,
fp_downcast_rounding="rtne")``, which Triton lowers on sm_90 to
``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even, saturating). Offsets
are int64; there are no atomics.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["offsets_triton", "on_device", "rows_triton", "segments_triton", "weights_triton"]

E4M3 = torch.float8_e4m3fn
ROWS_PER_PROGRAM = 64
STACK_BYTES = 64 << 20  # small experts' weights stacked per launch, up to this many bytes
# The segments kernel's tile: 128 tokens x 64 channels, 2 warps, a bf16 tile kept bf16 until it
# is quantized (144 registers); on the H200 (DEVICE_RUNS 122) 1.07-1.12x as fast as 128 channels
# widened to fp32 at 4 warps (168 registers), bitwise equal. 8 warps: slower (DEVICE_RUNS 114).
SEGMENT_CHANNELS = 64
SEGMENT_WARPS = 2
MAX_OFFSETS_EXPERTS = 8192  # experts one program of the offsets kernel sums
# listed weights' address tables kept (8 bytes an expert: 1024 tables of 128 experts are 1 MiB),
# enough for both layers of every MoE layer of a large model
MAX_TABLES = 1024
_TABLES: dict[tuple[int | None, int, tuple[int, ...]], Tensor] = {}


@triton.jit
def _abs_bits(x):
    """``|x|``'s fp32 bits as int32 (an integer max of them ranks NaN above Inf above finites).

    A bf16 ``x`` is widened by a shift of its own bits (exactly its fp32 bits), so a
    tile can stay bf16 in registers until it is quantized.
    """
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF) << 16
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _scale_rule(amax_bits):
    """``(scale, inverse, finite)`` from ``max |x|``'s bits: ``_fp8_ops.scale_rule``."""
    exponent = (amax_bits >> 23) - 8 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exponent = tl.maximum(exponent, 1)
    finite = amax_bits < 0x7F800000
    zero = amax_bits == 0
    scale = tl.where(zero, 1.0, (exponent << 23).to(tl.float32, bitcast=True))
    inverse = tl.where(zero, 1.0, ((254 - exponent) << 23).to(tl.float32, bitcast=True))
    return _poisoned(scale, ~finite), inverse, finite


@triton.jit
def _e4m3(x, inverse, finite):
    y = tl.minimum(tl.maximum(x * inverse, -448.0), 448.0)
    y = tl.where(finite, y, 0.0)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _poisoned(scale, malformed):
    """``scale``, or NaN (bits ``0x7FC00000``, as ``torch.nan``) where the splits are malformed."""
    nan = (malformed.to(tl.int32) * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(malformed, nan, scale)


@triton.jit
def _segment(b, row_offsets_ptr, seg_offsets_ptr, block_offsets_ptr, T, E, num_blocks,  # type: ignore[no-untyped-def]
             BLOCK_E: tl.constexpr):  # fmt: skip
    """Where 128-token block row ``b`` lies: ``(active, malformed, row_start, rows, column_start,
    local)`` — ``active``: ``b`` holds tokens of an expert, or the splits are malformed;
    the expert's first row of ``x`` and its number of rows (``<= 0`` possible for a stand-in),
    its first data column, and the block's tokens' ``(128,)`` int64 positions in the expert's
    segment (row ``row_start + local``, column ``column_start + local``).

    Malformed splits (a running sum that falls, or does not end at ``T``; the
    offsets are ``(E + 1,)`` int64 on the device) could send a block past ``T``
    rows or ``Tp`` columns; they get a stand-in instead: block ``b`` holds tokens
    ``[128 b, 128 b + 128)`` at the same columns (``NB * 128 >= Tp``), so every
    access stays inside the tensors. The scales are NaN then, the data unspecified.
    """
    b = b.to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    listed = experts < E
    ends = tl.load(block_offsets_ptr + 1 + experts, mask=listed, other=num_blocks)
    e = tl.sum((ends <= b).to(tl.int32), axis=0)  # the expert whose blocks hold b (E: none)
    starts = tl.load(row_offsets_ptr + experts, mask=listed, other=0)
    nexts = tl.load(row_offsets_ptr + 1 + experts, mask=listed, other=0)
    falls = tl.max((nexts < starts).to(tl.int32), axis=0) > 0
    malformed = falls | (tl.load(row_offsets_ptr + E) != T)
    in_expert = e < E
    row_start = tl.load(row_offsets_ptr + e, mask=in_expert, other=0)
    rows = tl.load(row_offsets_ptr + e + 1, mask=in_expert, other=0) - row_start
    column_start = tl.load(seg_offsets_ptr + e, mask=in_expert, other=0)
    first_block = tl.load(block_offsets_ptr + e, mask=in_expert, other=0)
    row_start = tl.where(malformed, b * 128, row_start)
    rows = tl.where(malformed, T - b * 128, rows)
    column_start = tl.where(malformed, b * 128, column_start)
    first_block = tl.where(malformed, b, first_block)
    local = (b - first_block) * 128 + tl.arange(0, 128)
    active = in_expert | malformed
    return active, malformed, row_start, rows, tl.multiple_of(column_start, 16), local


@triton.jit
def _rows_kernel(x_ptr, data_ptr, scales_ptr, T, C, BLOCK_T: tl.constexpr):  # type: ignore[no-untyped-def]
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    block = tl.program_id(1)
    row_ok = rows < T
    offsets = rows[:, None] * C + (block * 128 + tl.arange(0, 128))[None, :]
    x = tl.load(x_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
    scale, inverse, finite = _scale_rule(tl.max(_abs_bits(x), axis=1))
    tl.store(data_ptr + offsets, _e4m3(x, inverse[:, None], finite[:, None]), mask=row_ok[:, None])
    tl.store(scales_ptr + block.to(tl.int64) * T + rows, scale, mask=row_ok)


@triton.jit
def _weights_kernel(w_ptr, data_ptr, data_t_ptr, scales_ptr, N, K, expert_stride,  # type: ignore[no-untyped-def]
                    TABLE: tl.constexpr, SOURCE: tl.constexpr):  # fmt: skip
    """``TABLE``: ``w_ptr`` holds each expert's address (int64), ``SOURCE`` their dtype; else
    expert ``e``'s weight starts ``expert_stride * e`` elements after ``w_ptr``'s (negative:
    before it)."""
    k_block, n_block, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = (n_block * 128 + tl.arange(0, 128)).to(tl.int64)
    k = (k_block * 128 + tl.arange(0, 128)).to(tl.int64)
    base = e.to(tl.int64) * N * K
    tile = n[:, None] * K + k[None, :]
    nk = base + tile
    if TABLE:
        source = tl.multiple_of(tl.load(w_ptr + e).to(tl.pointer_type(SOURCE)), 16)
    else:
        source = w_ptr + e.to(tl.int64) * expert_stride
    x = tl.load(source + tile).to(tl.float32)
    amax_bits = tl.max(tl.max(_abs_bits(x), axis=1), axis=0)
    scale, inverse, finite = _scale_rule(amax_bits)
    q = _e4m3(x, inverse, finite)
    tl.store(data_ptr + nk, q)
    tl.store(data_t_ptr + base + k[None, :] * N + n[:, None], q)  # (K, N): n contiguous
    blocks_k = K // 128
    tl.store(scales_ptr + (e.to(tl.int64) * (N // 128) + n_block) * blocks_k + k_block, scale)


@triton.jit
def _segments_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    row_offsets_ptr,
    seg_offsets_ptr,
    block_offsets_ptr,
    data_ptr,
    scales_ptr,
    T,
    C,
    E,
    padded_tokens,
    num_blocks,
    BLOCK_E: tl.constexpr,
    CH: tl.constexpr,
):
    b = tl.program_id(0)
    channel_block = tl.program_id(1)
    channels = (channel_block * CH + tl.arange(0, CH)).to(tl.int64)
    active, malformed, row_start, rows_e, column_start, local = _segment(
        b, row_offsets_ptr, seg_offsets_ptr, block_offsets_ptr, T, E, num_blocks, BLOCK_E
    )
    if active:
        ok = local < rows_e
        rows = row_start + local
        x_offsets = rows[:, None] * C + channels[None, :]
        x = tl.load(x_ptr + x_offsets, mask=ok[:, None], other=0.0)  # widened only to quantize
        scale, inverse, finite = _scale_rule(tl.max(_abs_bits(x), axis=0))
        q = _e4m3(x.to(tl.float32), inverse[None, :], finite[None, :])  # zero past the tokens
        padded_e = (rows_e + 15) // 16 * 16
        columns = column_start + local
        keep = (local < padded_e) & (columns < padded_tokens)  # the bound: malformed splits
        tl.store(
            data_ptr + channels[None, :] * padded_tokens + columns[:, None],
            q,
            mask=keep[:, None],
        )
        tl.store(scales_ptr + b.to(tl.int64) * C + channels, _poisoned(scale, malformed))
    else:
        tl.store(scales_ptr + b.to(tl.int64) * C + channels, tl.zeros([CH], tl.float32))
        used_blocks = tl.load(block_offsets_ptr + E)
        tail_start = tl.load(seg_offsets_ptr + E)
        zeros = tl.zeros([CH, 128], tl.float32).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        # the unused programs (at least one: NB >= used blocks + 1) share the tail columns
        step = (num_blocks - used_blocks) * 128
        stop = tail_start * 0 + padded_tokens
        for start in range(tail_start + (b - used_blocks) * 128, stop, step):
            columns = start + tl.arange(0, 128)
            tl.store(
                data_ptr + channels[:, None] * padded_tokens + columns[None, :],
                zeros,
                mask=(columns < padded_tokens)[None, :],
            )


@triton.jit
def _offsets_kernel(  # type: ignore[no-untyped-def]
    sizes_ptr, row_ptr, seg_ptr, block_ptr, E, ALIGN: tl.constexpr, BLOCK_E: tl.constexpr
):
    """0, then the running sums of the experts' token counts (``row``), of the counts
    rounded up to ``ALIGN`` (``seg``) and of their 128-token blocks (``block``)."""
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    n = tl.load(sizes_ptr + e, mask=ok, other=0).to(tl.int64)
    zeros, first = tl.zeros([BLOCK_E], tl.int64), e < 1
    tl.store(row_ptr + e, zeros, mask=first)
    tl.store(row_ptr + 1 + e, tl.cumsum(n, axis=0), mask=ok)
    up, blocks = n + ALIGN - 1, n + 127  # floored as Python's (Triton's // and % truncate)
    up, blocks = up - (up % ALIGN + ALIGN) % ALIGN, (blocks - (blocks % 128 + 128) % 128) // 128
    tl.store(seg_ptr + e, zeros, mask=first)
    tl.store(seg_ptr + 1 + e, tl.cumsum(up, axis=0), mask=ok)
    tl.store(block_ptr + e, zeros, mask=first)
    tl.store(block_ptr + 1 + e, tl.cumsum(blocks, axis=0), mask=ok)


def on_device(t: Tensor) -> contextlib.AbstractContextManager[object]:
    """A context in which ``t``'s GPU is current (Triton launches on the current device).

    Entered only when another device is current: ``torch.cuda.device`` costs
    about 5 µs of host time per launch (DEVICE_RUNS 119). With the device's
    capability asked once (``_fp8_ops``), a quantizer or SwiGLU call costs the
    host 6-15 µs less (DEVICE_RUNS 122).
    """
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def offsets_triton(sizes: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """Triton twin of ``_fp8_ops.offsets_ref`` in one launch (``None``: too many experts).

    ``sizes``: ``(E,)`` int32/int64 token counts (malformed, negative ones too) on a CUDA device.
    """
    E = sizes.shape[0]
    if E > MAX_OFFSETS_EXPERTS:
        return None
    # three tensors, not rows of one table: torch 2.11's Inductor fails to lower a
    # searchsorted over a row of such a table (DEVICE_RUNS 82), should compiled code get them
    row, seg, block = (torch.empty(E + 1, dtype=torch.int64, device=sizes.device) for _ in range(3))
    with on_device(sizes):
        _offsets_kernel[(1,)](
            sizes.contiguous(), row, seg, block, E,
            ALIGN=align, BLOCK_E=triton.next_power_of_2(max(E, 1)),
        )  # fmt: skip
    return row, seg, block


def rows_triton(x_TC: Tensor) -> tuple[Tensor, Tensor]:
    """Triton twin of ``_fp8_ops.rows_ref``: ``(data_TC, scales_BT)`` of a contiguous ``(T, C)``."""
    T, C = x_TC.shape
    data = torch.empty(T, C, dtype=E4M3, device=x_TC.device)
    scales = torch.empty(C // 128, T, dtype=torch.float32, device=x_TC.device)
    if T and C:
        grid = (triton.cdiv(T, ROWS_PER_PROGRAM), C // 128)
        with on_device(x_TC):
            _rows_kernel[grid](x_TC, data, scales, T, C, BLOCK_T=ROWS_PER_PROGRAM, num_warps=4)
    return data, scales


def weights_triton(weights: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Triton twin of ``_fp8_ops.weights_ref`` on a group in op form (``[w_ENK]`` or ``E``
    ``(N, K)`` matrices, contiguous), in one launch:

    * an ``(E, N, K)`` weight, or matrices evenly spaced in memory (the views of
      one allocation, such as a framework's flat parameter buffer, in either
      order): expert ``e`` read at ``e`` × the spacing;
    * other matrices (each in an allocation of its own): each expert's address
      from a table copied to the device once and kept (:func:`_address_table`).

    Under CUDA-graph capture (or for an address not 16-byte aligned) the
    table is not used: one launch per run of small matrices stacked together
    (:func:`_small_runs`) or per larger one.
    """
    E = sum(w.shape[0] if w.dim() == 3 else 1 for w in weights)
    N, K = weights[0].shape[-2:]
    device = weights[0].device
    data = torch.empty(E, N, K, dtype=E4M3, device=device)
    data_t = torch.empty(E, K, N, dtype=E4M3, device=device)
    scales = torch.empty(E, N // 128, K // 128, dtype=torch.float32, device=device)
    if not (E and N and K):
        return data, data_t, scales
    outputs = (data, data_t, scales)
    with on_device(weights[0]):
        # a list of (N, K) matrices: their addresses, read once for the spacing and the table
        starts = [w.data_ptr() for w in weights] if 1 < len(weights) == E else []
        spacing = N * K if len(weights) == 1 else _even_spacing(starts, weights[0].element_size())
        table = _address_table(starts, device) if spacing is None and starts else None
        if spacing is not None:
            _launch_weights(weights[0], outputs, 0, E, spacing)
        elif table is not None:
            _launch_weights(table, outputs, 0, E, 0, weights[0].dtype)
        else:
            first = 0
            for run in _small_runs(weights):
                w = run[0] if len(run) == 1 else torch.stack(run)
                count = w.shape[0] if w.dim() == 3 else 1
                _launch_weights(w, outputs, first, count, N * K)
                first += count
    return data, data_t, scales


SOURCE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _launch_weights(
    w: Tensor, outputs: tuple[Tensor, Tensor, Tensor], first: int, count: int, stride: int,
    table_of: torch.dtype | None = None,
) -> None:  # fmt: skip
    """Quantize ``count`` experts into ``outputs``' slice from ``first``: ``w`` and the
    spacing of its experts, or with ``table_of`` (their dtype) ``w`` their address table."""
    data, data_t, scales = (t[first : first + count] for t in outputs)
    N, K = data.shape[1:]
    source = SOURCE_TYPES[table_of] if table_of is not None else tl.bfloat16
    _weights_kernel[(K // 128, N // 128, count)](
        w, data, data_t, scales, N, K, stride,
        TABLE=table_of is not None, SOURCE=source, num_warps=8,
    )  # fmt: skip


def _address_table(starts: list[int], device: torch.device) -> Tensor | None:
    """The matrices' addresses ``starts`` as an int64 tensor on ``device``, or ``None``:
    under CUDA-graph capture (a captured copy would read the host buffer again at every
    replay, after it was freed) or when an address is not 16-byte aligned (the kernel's
    loads assume it).

    A layer's weights keep their addresses from step to step, so the tables are kept
    (:data:`_TABLES`, by device, stream and addresses; the least recently used goes
    first): the first call makes one small copy from pinned memory, later ones none. A
    table holds addresses only, so it stays right whatever is written at them; it is
    used on the stream that copied it, behind that copy.
    """
    if torch.cuda.is_current_stream_capturing():
        return None
    key = (device.index, torch.cuda.current_stream(device).cuda_stream, tuple(starts))
    table = _TABLES.pop(key, None)
    if table is None:
        if any(a % 16 for a in starts):  # a kept table's addresses were checked when it was made
            return None
        if len(_TABLES) >= MAX_TABLES:
            del _TABLES[next(iter(_TABLES))]
        host = torch.tensor(starts, dtype=torch.int64, pin_memory=True)
        table = host.to(device, non_blocking=True)
    _TABLES[key] = table  # last: the most recently used
    return table


def _small_runs(weights: list[Tensor]) -> list[list[Tensor]]:
    """Consecutive ``(N, K)`` matrices grouped up to ``STACK_BYTES`` (an ``(E, N, K)`` stays alone).

    A launch costs the host more than copying a small expert's weight costs
    the GPU (profiled on the H200 at E = 128 experts of 1536 × 2048: about
    5.5 ms of host time per call, one launch per expert); each group of
    several is stacked into one tensor (one copy) and quantized in one launch.
    """
    runs: list[list[Tensor]] = []
    size = 0
    for w in weights:
        nbytes = w.numel() * w.element_size()
        if runs and w.dim() == 2 and size + nbytes <= STACK_BYTES and runs[-1][0].dim() == 2:
            runs[-1].append(w)
            size += nbytes
        else:
            runs.append([w])
            size = nbytes
    return runs


def _even_spacing(starts: list[int], element_size: int) -> int | None:
    """Elements from one matrix's first element to the next's, if the same for all (at least
    two ``starts``, their addresses), else ``None``."""
    if len(starts) < 2:
        return None
    step = starts[1] - starts[0]
    if step % element_size or any(b - a != step for a, b in itertools.pairwise(starts)):
        return None
    return step // element_size


def segments_triton(
    x_TC: Tensor,
    row_offsets: Tensor,
    seg_offsets: Tensor,
    block_offsets: Tensor,
    num_blocks: int,
    padded_tokens: int,
    with_rows: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton twin of ``_fp8_ops.segments_ref``, every output written: the segments kernel,
    and with ``with_rows`` the rows kernel before it (two reads of ``x``; on the H200 the two
    run 1.0-1.23x as fast as one kernel writing both forms, DEVICE_RUNS 114).

    The offsets are ``(E + 1,)`` int64 on ``x``'s device; they are only read
    by the kernel (no host sync).
    """
    T, C = x_TC.shape
    E = row_offsets.shape[0] - 1
    device = x_TC.device
    data = torch.empty(C, padded_tokens, dtype=E4M3, device=device)
    scales = torch.empty(num_blocks, C, dtype=torch.float32, device=device)
    if with_rows:
        row_data, row_scales = rows_triton(x_TC)
    else:
        row_data = torch.empty(0, dtype=E4M3, device=device)
        row_scales = torch.empty(0, dtype=torch.float32, device=device)
    if num_blocks and C:
        with on_device(x_TC):
            _segments_kernel[(num_blocks, C // SEGMENT_CHANNELS)](
                x_TC, row_offsets, seg_offsets, block_offsets, data, scales, T, C, E,
                padded_tokens, num_blocks, BLOCK_E=triton.next_power_of_2(max(E, 1)),
                CH=SEGMENT_CHANNELS, num_warps=SEGMENT_WARPS,
            )  # fmt: skip
    return data, scales, row_data, row_scales
