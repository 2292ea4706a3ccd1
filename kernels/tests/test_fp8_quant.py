"""FP8 blockwise quantizers on the reference path: layouts, the scale rule, rounding, errors, ops.

The Triton kernels run against this reference on a GPU in
``test_gpu_fp8_quant.py``. Expected scales and e4m3 values come from fp64
loops here (``_expected_scale``, ``_nearest_e4m3``), not from the code under test.

Legend: ``T`` tokens, ``C`` channels, ``E`` experts, ``N``/``K`` weight rows/columns.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pytest
import torch

from groupgrad.kernels import Fp8Blocks, _fp8_ops, quantize_fp8, quantize_fp8_ref
from groupgrad_testsupport.allocations import AllocationRecorder
from groupgrad_testsupport.calls import record_calls

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
E4M3 = torch.float8_e4m3fn
NAN_BITS = 0x7FC00000


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _expected_scale(amax: float) -> float:
    """The smallest power of two >= amax / 448, at least 2**-126; 1 for 0, NaN for NaN/Inf."""
    if not math.isfinite(amax):
        return math.nan
    if amax == 0:
        return 1.0
    return max(2.0 ** math.ceil(math.log2(amax / 448)), 2.0**-126)


_GRID = torch.arange(256, dtype=torch.uint8).view(E4M3).double()  # every e4m3 code
_CODES = torch.arange(256)[_GRID.isfinite()]
_ORDER = _GRID[_CODES].argsort()
_VALUES, _SORTED_CODES = _GRID[_CODES][_ORDER], _CODES[_ORDER]


def _nearest_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round fp64 ``y`` (|y| <= 448) to the nearest e4m3 value, ties to the even code."""
    y = y.double().flatten()
    hi = torch.searchsorted(_VALUES, y).clamp(1, len(_VALUES) - 1)
    lo = hi - 1
    d_lo, d_hi = y - _VALUES[lo], _VALUES[hi] - y
    even_hi = _SORTED_CODES[hi] % 2 == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even_hi)
    out = torch.where(pick_hi, _VALUES[hi], _VALUES[lo])
    return torch.where(y == 0, y, out)  # keeps -0.0


def _check_block(x: torch.Tensor, q: torch.Tensor, scale: float) -> None:
    """One block: its scale is the expected one and its data is x / scale rounded RNE."""
    want = _expected_scale(x.double().abs().max().item())
    assert scale == want, f"scale {scale}, expected {want}"
    expected = _nearest_e4m3(x.double() / scale)
    assert torch.equal(q.double().flatten(), expected), "data is not x / scale rounded to e4m3"


def _error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|deq - x| for e4m3 RNE of x / scale: half an ulp, 2**-4 relative above 2**-6, 2**-10 below."""
    return 2.0**-4 * x.double().abs() + scale.double() * 2.0**-10


# ---------------------------------------------------------------- layouts and rounding


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_form_layout_scales_and_rounding(dtype: torch.dtype) -> None:
    T, C = 131, 384
    x = _randn(T, C, seed=1) * 10.0 ** torch.randint(-3, 4, (T, C // 128)).repeat_interleave(128, 1)
    x = x.to(dtype)
    q = quantize_fp8(x, block=(1, 128))
    assert isinstance(q, Fp8Blocks)
    assert (q.block, q.dtype, q.shape, q.splits, q.data_t) == ((1, 128), dtype, (T, C), None, None)
    assert q.data.dtype == E4M3
    assert q.data.shape == (T, C)
    assert q.data.is_contiguous()
    assert q.scales.dtype == torch.float32
    assert q.scales.shape == (T, C // 128)
    assert q.scales.stride() == (1, T)
    for t in (0, 57, T - 1):
        for b in range(C // 128):
            cols = slice(128 * b, 128 * b + 128)
            _check_block(x[t, cols], q.data[t, cols].float(), q.scales[t, b].item())
    deq = q.dequantize()
    assert deq.dtype == torch.float32
    assert deq.shape == (T, C)
    bound = _error_bound(x, q.scales.repeat_interleave(128, 1))
    assert ((deq.double() - x.double()).abs() <= bound).all()
    assert not torch.equal(deq, x.float()), "a lossless round trip: the test data is too tame"


@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_form_layout_both_orientations(as_list: bool, dtype: torch.dtype) -> None:
    E, N, K = 3, 256, 384
    per_block = torch.logspace(-4, 0, (N // 128) * (K // 128)).reshape(N // 128, K // 128)
    per_block = per_block.repeat_interleave(128, 0).repeat_interleave(128, 1)  # tiles 1e4 apart
    w = (_randn(E, N, K, seed=2) * torch.logspace(-3, 4, E)[:, None, None] * per_block).to(dtype)
    source = [w[e].t().contiguous().t() for e in range(E)] if as_list else w  # odd strides too
    q = quantize_fp8(source, block=(128, 128))
    assert (q.shape, q.listed, q.dtype) == ((E, N, K), as_list, dtype)
    assert q.data.shape == (E, N, K)
    assert q.data.is_contiguous()
    assert q.data.dtype == E4M3
    assert q.data_t.shape == (E, K, N)
    assert q.data_t.is_contiguous()
    assert q.scales.shape == (E, N // 128, K // 128)
    assert q.scales.is_contiguous()
    u8 = torch.uint8
    assert torch.equal(q.data_t.view(u8), q.data.view(u8).transpose(1, 2))
    for e, n, k in [(0, 0, 0), (1, 1, 2), (2, 0, 1)]:
        tile = (e, slice(128 * n, 128 * n + 128), slice(128 * k, 128 * k + 128))
        _check_block(w[tile], q.data[tile].float(), q.scales[e, n, k].item())
    deq = q.dequantize()
    deq = torch.stack(deq) if as_list else deq
    assert isinstance(q.dequantize(), list) == as_list
    spread = q.scales.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert ((deq.double() - w.double()).abs() <= _error_bound(w, spread)).all()


def test_a_2d_weight_keeps_its_shape() -> None:
    w = _randn(128, 256, seed=3)
    q = quantize_fp8_ref(w, block=(128, 128))
    assert q.data.shape == (128, 256)
    assert q.data_t.shape == (256, 128)
    assert q.scales.shape == (1, 2)
    assert q.dequantize().shape == (128, 256)
    full = quantize_fp8_ref(w[None], block=(128, 128))
    assert torch.equal(q.data.view(torch.uint8), full.data[0].view(torch.uint8))


def _segment_layout(splits: list[int]) -> tuple[list[int], list[int], int, int]:
    seg = [0]
    blocks = [0]
    for n in splits:
        seg.append(seg[-1] + -(-n // 16) * 16)
        blocks.append(blocks[-1] + -(-n // 128))
    T, E = sum(splits), len(splits)
    return seg, blocks, -(-(T + 15 * E) // 16) * 16, -(-T // 128) + E


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "splits", [[130, 0, 5, 256, 1], [0, 0], [128], [7, 300, 0, 0, 129]], ids=str
)
def test_segments_form_layout_padding_and_scales(dtype: torch.dtype, splits: list[int]) -> None:
    T, C = sum(splits), 256
    x = (_randn(T, C, seed=4) * torch.logspace(-4, 4, C)).to(dtype)
    q = quantize_fp8(x, block=(128, 1), splits=torch.tensor(splits))
    seg, blocks, Tp, NB = _segment_layout(splits)
    assert q.data.shape == (C, Tp)
    assert q.data.is_contiguous()
    assert q.data.dtype == E4M3
    assert q.scales.shape == (NB, C)
    assert q.scales.is_contiguous()
    assert q.seg_offsets.tolist() == seg
    assert q.block_offsets.tolist() == blocks
    assert q.row_offsets.tolist() == [sum(splits[:e]) for e in range(len(splits) + 1)]
    assert q.seg_offsets.dtype == q.block_offsets.dtype == torch.int64
    written = torch.zeros(C, Tp, dtype=torch.bool)
    first = 0
    for e, n in enumerate(splits):
        written[:, seg[e] : seg[e] + n] = True
        for b in range(-(-n // 128)):
            rows = slice(first + 128 * b, first + min(n, 128 * b + 128))
            columns = slice(seg[e] + 128 * b, seg[e] + min(n, 128 * b + 128))
            for c in (0, 77, C - 1):
                scale = q.scales[blocks[e] + b, c].item()
                _check_block(x[rows, c], q.data[c, columns].float(), scale)
        first += n
    assert not q.data.view(torch.uint8)[~written].any(), "padding columns are not zero"
    assert not q.scales[blocks[-1] :].any(), "unused scale rows are not zero"
    deq = q.dequantize()
    assert deq.shape == (T, C)
    assert deq.dtype == torch.float32
    want = torch.cat([x[sum(splits[:e]) : sum(splits[: e + 1])] for e in range(len(splits))])
    assert torch.equal(want, x)
    ref = torch.zeros_like(deq, dtype=torch.float64)
    first = 0
    for e, n in enumerate(splits):
        for b in range(-(-n // 128)):
            rows = slice(first + 128 * b, first + min(n, 128 * b + 128))
            ref[rows] = q.scales[blocks[e] + b].double()
        first += n
    assert ((deq.double() - x.double()).abs() <= _error_bound(x, ref)).all()


#: Device splits that a host check would reject, as token counts for T = 300: summing past T,
#: short of it, a negative count with the right sum, no tokens at all, and a count past T.
MALFORMED = [[400, 0, 200], [100, 0, 100], [350, -50, 0], [0, 0, 0], [300, 300, -300]]


@pytest.mark.parametrize("sizes", MALFORMED, ids=str)
def test_malformed_device_splits_give_nan_scales_not_wrong_values(sizes: list[int]) -> None:
    """A device ``splits`` is never read on the host, so a malformed one cannot raise: every
    scale of the ``(128, 1)`` form is NaN (it dequantizes to NaN, and so does a wgrad of it),
    the ``(1, 128)`` form of the same read stays exact. The reference's kernel is called
    with the offsets such splits give (a CPU ``splits`` is checked, and raises)."""
    T, C = 300, 256
    x = _randn(T, C, dtype=torch.bfloat16, seed=21)
    offsets = _fp8_ops.offsets_ref(torch.tensor(sizes), 16)
    E = len(sizes)
    NB, Tp = -(-T // 128) + E, T + 15 * E
    data, scales, row_data, row_scales = _fp8_ops.segments_ref(x, *offsets, NB, Tp, True)
    assert data.shape == (C, Tp)
    assert scales.shape == (NB, C)
    assert torch.equal(
        scales.view(torch.int32), torch.full_like(scales, math.nan).view(torch.int32)
    )
    want_data, want_scales = _fp8_ops.rows_ref(x)
    assert torch.equal(row_data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(row_scales, want_scales)
    tokens = Fp8Blocks(
        data, scales.nan_to_num(), block=(128, 1), dtype=torch.bfloat16, shape=(T, C),
        splits=torch.tensor(sizes), row_offsets=offsets[0], seg_offsets=offsets[1],
        block_offsets=offsets[2],
    )  # fmt: skip
    assert tokens.dequantize().isnan().all(), "finite scales, malformed offsets: still NaN"
    with pytest.raises(ValueError, match="splits"):
        quantize_fp8_ref(x, block=(128, 1), splits=sizes)


# ---------------------------------------------------------------- blocks are local


def _per_tensor(x: torch.Tensor) -> torch.Tensor:
    """A wrong quantizer: one scale for the whole tensor (same rule), dequantized."""
    scale = _expected_scale(x.double().abs().max().item())
    return (x.float() / scale).clamp(-448, 448).to(E4M3).float() * scale


def _bound_holds(x: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> bool:
    return bool(((deq.double() - x.double()).abs() <= _error_bound(x, scale)).all())


def test_each_block_has_its_own_scale_where_one_scale_would_fail() -> None:
    """Blocks 1e8 apart: the blockwise error bound holds, a per-tensor or an
    expert-straddling quantizer breaks it (the small block rounds to zero)."""
    x = _randn(64, 256, seed=5)
    x[:, 128:] *= 1e-8  # second row block / second channel block tiny
    rows = quantize_fp8_ref(x, block=(1, 128))
    spread = rows.scales.repeat_interleave(128, 1)
    assert _bound_holds(x, rows.dequantize(), spread)
    assert not _bound_holds(x, _per_tensor(x), spread)

    w = torch.cat([_randn(128, 256, seed=6), 1e-8 * _randn(128, 256, seed=7)])
    weights = quantize_fp8_ref(w, block=(128, 128))
    spread = weights.scales.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert _bound_holds(w, weights.dequantize(), spread)
    assert not _bound_holds(w, _per_tensor(w), spread)

    t = torch.cat([_randn(64, 128, seed=8), 1e-8 * _randn(64, 128, seed=9)])  # 2 experts
    segments = quantize_fp8_ref(t, block=(128, 1), splits=[64, 64])
    spread = segments.scales[[0] * 64 + [1] * 64]
    assert segments.scales.shape == (3, 128)
    assert _bound_holds(t, segments.dequantize(), spread)
    straddling = quantize_fp8_ref(t, block=(128, 1), splits=[128])  # one block over both
    assert not _bound_holds(t, straddling.dequantize(), spread)


# ---------------------------------------------------------------- the scale rule


def test_scale_rule_is_the_power_of_two_at_or_above_amax_over_448() -> None:
    tiny = [2.0**-149, 1e-45, 2.0**-130, 2.0**-126, 1e-38]
    edges = [448.0, 448.0 * (1 + 2**-23), 448.0 * (1 - 2**-24), 1.75, 1.75 * (1 + 2**-23)]
    large = [3.4028234663852886e38, 2.0**127, 1e30]
    rand = (torch.rand(200, generator=torch.Generator().manual_seed(10)) * 80 - 40).exp2()
    amaxes = torch.tensor(tiny + edges + large + [0.0] + rand.tolist(), dtype=torch.float32)
    x = torch.zeros(len(amaxes), 128)
    x[:, 5] = -amaxes  # the sign must not matter
    q = quantize_fp8_ref(x, block=(1, 128))
    scales = q.scales[:, 0].double()
    for amax, scale in zip(amaxes.tolist(), scales.tolist(), strict=True):
        assert scale == _expected_scale(amax), (amax, scale)
        mantissa, _ = math.frexp(scale)
        assert mantissa == 0.5, f"scale {scale} is not a power of two"
        if amax:
            assert scale >= amax / 448
            assert scale / 2 < amax / 448 or scale == 2.0**-126
    assert scales[len(tiny)] == 1.0
    assert scales[len(tiny) + 1] == 2.0


def test_a_zero_block_gets_scale_one_and_zero_data() -> None:
    x = _randn(4, 256, seed=11)
    x[1, :128] = 0
    x[2, 128:] = -0.0
    q = quantize_fp8_ref(x, block=(1, 128))
    assert q.scales[1, 0] == 1.0
    assert q.scales[2, 1] == 1.0
    assert (q.data[1, :128].float() == 0).all()
    assert (q.data[2, 128:].float() == 0).all()
    assert (q.dequantize()[1, :128] == 0).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nan_or_inf_block_dequantizes_to_nan_only_in_that_block(bad: float) -> None:
    x = _randn(200, 256, seed=12)
    x[150, 200] = bad  # row block (150, 1); weight tile (1, 1); segment block of expert 1
    rows = quantize_fp8_ref(x, block=(1, 128))
    nan_rows = torch.zeros(200, 256, dtype=torch.bool)
    nan_rows[150, 128:] = True
    weights = quantize_fp8_ref(x[:128].clone(), block=(128, 128))
    assert not weights.dequantize().isnan().any()
    w = torch.cat([x, x[:56]])  # (256, 256)
    tiles = quantize_fp8_ref(w, block=(128, 128))
    nan_tile = torch.zeros(256, 256, dtype=torch.bool)
    nan_tile[128:, 128:] = True
    segments = quantize_fp8_ref(x, block=(128, 1), splits=[100, 100])
    nan_segment = torch.zeros(200, 256, dtype=torch.bool)
    nan_segment[100:200, 200] = True
    for q, where in ((rows, nan_rows), (tiles, nan_tile), (segments, nan_segment)):
        deq = q.dequantize()
        assert torch.equal(deq.isnan(), where), q
        assert q.scales.isnan().sum() == 1
        bits = q.scales[q.scales.isnan()].view(torch.int32)
        assert (bits == NAN_BITS).all(), "a NaN scale that is not the canonical NaN"


# ---------------------------------------------------------------- several forms, one read


@pytest.mark.parametrize("order", [((1, 128), (128, 1)), ((128, 1), (1, 128))], ids=str)
@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_fp8_ref], ids=lambda f: f.__name__)
def test_two_forms_in_one_call_equal_two_calls(order, quantize) -> None:
    splits = [50, 0, 300, 1]
    x = _randn(351, 256, dtype=torch.bfloat16, seed=13)
    both = quantize(x, block=order, splits=splits)
    assert isinstance(both, tuple)
    assert [q.block for q in both] == list(order)
    for q in both:
        alone = quantize_fp8_ref(x, block=q.block, splits=splits if q.block == (128, 1) else None)
        assert torch.equal(q.data.view(torch.uint8), alone.data.view(torch.uint8))
        assert torch.equal(q.scales.view(torch.int32), alone.scales.view(torch.int32))
        assert q.scales.stride() == alone.scales.stride()
    (single,) = quantize(x, block=((1, 128),))
    assert single.block == (1, 128)


@pytest.mark.parametrize("form", ["list", "tuple", "cpu tensor", "int32 tensor"])
def test_splits_in_every_form_give_one_result(form: str) -> None:
    splits = [3, 0, 200, 61]
    given = {
        "list": splits,
        "tuple": tuple(splits),
        "cpu tensor": torch.tensor(splits),
        "int32 tensor": torch.tensor(splits, dtype=torch.int32),
    }[form]
    x = _randn(264, 128, seed=14)
    q = quantize_fp8(x, block=(128, 1), splits=given)
    want = quantize_fp8_ref(x, block=(128, 1), splits=splits)
    assert q.splits is given
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.scales, want.scales)


def test_device_splits_are_never_read_on_the_host() -> None:
    """On the meta device every host read (``tolist``, ``item``, ``bool``) raises."""
    x = torch.empty(1000, 256, dtype=torch.bfloat16, device="meta")
    splits = torch.empty(5, dtype=torch.int64, device="meta")
    for quantize in (quantize_fp8, quantize_fp8_ref):
        rows, segments = quantize(x, block=((1, 128), (128, 1)), splits=splits)
        assert segments.data.shape == (256, -(-(1000 + 75) // 16) * 16)
        assert segments.scales.shape == (-(-1000 // 128) + 5, 256)
        assert segments.block_offsets.shape == (6,)
        assert segments.block_offsets.device.type == "meta"
        assert rows.scales.shape == (1000, 2)
        assert rows.scales.stride() == (1, 1000)
        with pytest.raises(ValueError, match="splits sums to 0 but t has 1000 rows"):
            quantize(x, block=(128, 1), splits=splits[:0])  # no counts: its length says so


def test_fp8blocks_round_trips_through_its_tensors() -> None:
    x = _randn(300, 128, seed=15)
    q = quantize_fp8_ref(x, block=(128, 1), splits=[100, 200])
    tensors = q.tensors()
    assert all(t is None or isinstance(t, torch.Tensor) for t in tensors)
    again = Fp8Blocks.from_tensors(
        tensors, block=q.block, dtype=q.dtype, shape=q.shape, splits=q.splits
    )
    assert again.tensors() == tensors or all(
        a is b for a, b in zip(again.tensors(), tensors, strict=True)
    )
    assert torch.equal(again.dequantize(), q.dequantize())
    with pytest.raises(ValueError, match="no data or no scales"):
        Fp8Blocks.from_tensors((None,) * 6, block=(1, 128), dtype=x.dtype, shape=x.shape)


# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block": (64, 128)}, ValueError, r"block is \(64, 128\), expected"),
        ({"block": ((1, 128), (128, 128))}, ValueError, "block is"),
        ({"block": ((1, 128), (1, 128))}, ValueError, "block is"),
        ({"block": (128, 1)}, ValueError, "block \\(128, 1\\) needs splits"),
        ({"block": (1, 128), "splits": [256]}, ValueError, "splits is only for block"),
        ({"block": (128, 1), "splits": [100, -1, 157]}, ValueError, r"splits\[1\] is -1"),
        ({"block": (128, 1), "splits": [100, 100]}, ValueError, "splits sums to 200 but t has 256"),
        ({"block": (128, 1), "splits": torch.tensor([255])}, ValueError, "sums to 255"),
        ({"block": (128, 1), "splits": []}, ValueError, "sums to 0 but t has 256"),
        ({"block": (128, 1), "splits": [128.0, 128]}, TypeError, r"splits\[0\] must be an int"),
        ({"block": (128, 1), "splits": [True, 255]}, TypeError, r"splits\[0\] .* got bool"),
        ({"block": (128, 1), "splits": "256"}, TypeError, "sequence of ints .*, got str"),
        ({"block": (128, 1), "splits": {100, 156}}, TypeError, "sequence of ints .*, got set"),
        ({"block": (128, 1), "splits": torch.tensor([256.0])}, TypeError, "dtype torch.float32"),
        ({"block": (128, 1), "splits": torch.tensor([[256]])}, ValueError, r"1-D \(E,\)"),
        (
            {"block": (128, 1), "splits": torch.zeros(1, dtype=torch.long, device="meta")},
            ValueError,
            "splits is on meta, expected cpu like t",
        ),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_blocks_and_splits_are_named(kwargs, error, match) -> None:
    x = _randn(256, 128, seed=16)
    for quantize in (quantize_fp8, quantize_fp8_ref):
        with pytest.raises(error, match=match):
            quantize(x, **kwargs)


def test_bad_tensors_are_named() -> None:
    with pytest.raises(ValueError, match="t's last dimension is 100, expected a multiple of 128"):
        quantize_fp8(torch.zeros(4, 100), block=(1, 128))
    with pytest.raises(ValueError, match="t's last dimension is 200"):
        quantize_fp8(torch.zeros(4, 200), block=(128, 1), splits=[4])
    with pytest.raises(ValueError, match=r"t has shape \(2, 4, 128\), expected \(T, C\)"):
        quantize_fp8(torch.zeros(2, 4, 128), block=(1, 128))
    with pytest.raises(TypeError, match=r"t has dtype torch\.float64, expected torch\.bfloat16"):
        quantize_fp8(torch.zeros(4, 128, dtype=torch.float64), block=(1, 128))
    with pytest.raises(TypeError, match=r"t must be a torch\.Tensor, got list"):
        quantize_fp8([torch.zeros(4, 128)], block=(1, 128))
    with pytest.raises(
        ValueError, match=r"t has shape \(1, 128, 200\), expected N and K multiples"
    ):
        quantize_fp8(torch.zeros(1, 128, 200), block=(128, 128))
    with pytest.raises(ValueError, match="t is an empty list"):
        quantize_fp8([], block=(128, 128))
    good = torch.zeros(128, 128)
    with pytest.raises(TypeError, match=r"t\[1\] has dtype torch.bfloat16, expected torch.float32"):
        quantize_fp8([good, good.bfloat16()], block=(128, 128))
    with pytest.raises(ValueError, match=r"t\[2\] is \(256, 128\) on cpu, expected \(128, 128\)"):
        quantize_fp8([good, good, torch.zeros(256, 128)], block=(128, 128))
    with pytest.raises(ValueError, match=r"t\[0\] has shape \(1, 128, 128\), expected \(N, K\)"):
        quantize_fp8([good[None]], block=(128, 128))
    with pytest.raises(TypeError, match=r"t\[1\] must be a torch\.Tensor, got str"):
        quantize_fp8([good, "w"], block=(128, 128))


@pytest.mark.parametrize(
    ("block", "t"),
    [
        ((1, 128), lambda: torch.zeros(4, 128).to_sparse()),
        ((1, 128), lambda: torch.zeros(4, 128).to_mkldnn()),
        ((128, 1), lambda: torch.nested.nested_tensor([torch.zeros(4, 128)] * 2)),
        ((128, 128), lambda: [torch.zeros(128, 128), torch.zeros(128, 128).to_sparse()]),
        ((128, 128), lambda: [torch.zeros(128, 128), torch.zeros(128, 128).to_mkldnn()]),
    ],
    ids=["sparse", "mkldnn", "nested", "member-sparse", "member-mkldnn"],
)
def test_tensors_that_are_not_dense_are_named(block: tuple[int, int], t) -> None:
    # Catches: a sparse, mkldnn or nested tensor reaching torch's internals unnamed.
    splits = {"splits": [4]} if block == (128, 1) else {}
    for quantize in (quantize_fp8, quantize_fp8_ref):
        with pytest.raises(TypeError, match=r"^t(\[1\])? is a \S+ tensor, expected a dense"):
            quantize(t(), block=block, **splits)


EMPTY_WEIGHTS = [(2, 128, 0), (2, 0, 128), (0, 128, 128), (128, 0)]


@pytest.mark.parametrize(
    ("shape", "listed"),
    [(shape, False) for shape in EMPTY_WEIGHTS] + [(s, True) for s in EMPTY_WEIGHTS if s[0]],
)
def test_empty_weights_quantize_to_empty_forms(shape: tuple[int, ...], listed: bool) -> None:
    # Catches: a weight of no rows or columns failing in a reshape instead of giving empty forms.
    w = torch.zeros(shape, dtype=torch.bfloat16)
    if listed and w.dim() == 3:
        w = list(w.unbind(0))
    if listed and isinstance(w, torch.Tensor):
        w = [w, w.clone()]
    for quantize in (quantize_fp8, quantize_fp8_ref):
        form = quantize(w, block=(128, 128))
        N, K = shape[-2:]
        E = len(w) if isinstance(w, list) else (shape[0] if len(shape) == 3 else None)
        lead = () if E is None else (E,)
        assert form.data.shape == (*lead, N, K)
        assert form.data_t.shape == (*lead, K, N)
        assert form.scales.shape == (*lead, N // 128, K // 128)
        back = form.dequantize()
        assert (
            [t.shape for t in back] == [(N, K)] * E
            if isinstance(w, list)
            else back.shape == w.shape
        )


# ---------------------------------------------------------------- ops, compile, fallback


def test_opcheck_passes_for_each_custom_op() -> None:
    x = _randn(300, 256, dtype=torch.bfloat16, seed=17)
    row, seg, block = _fp8_ops_offsets([100, 0, 200])
    torch.library.opcheck(_fp8_ops.rows_op, (x,))
    members = [x[:256].reshape(1, 256, 256), x[44:300].reshape(1, 256, 256)]
    torch.library.opcheck(_fp8_ops.weights_op, (members,))
    for with_rows in (False, True):
        args = (x, row, seg, block, -(-300 // 128) + 3, -(-(300 + 45) // 16) * 16, with_rows)
        torch.library.opcheck(_fp8_ops.segments_op, args)


def _fp8_ops_offsets(splits: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seg, blocks, _, _ = _segment_layout(splits)
    rows = [sum(splits[:e]) for e in range(len(splits) + 1)]
    return torch.tensor(rows), torch.tensor(seg), torch.tensor(blocks)


@pytest.mark.parametrize("splits_form", ["list", "tensor"])
def test_torch_compile_fullgraph_traces_the_quantizer(splits_form: str) -> None:
    torch._dynamo.reset()
    splits = [100, 0, 156]
    given = splits if splits_form == "list" else torch.tensor(splits)

    def quantize_all(x: torch.Tensor, w: torch.Tensor, splits):
        rows, segments = quantize_fp8(x, block=((1, 128), (128, 1)), splits=splits)
        weights = quantize_fp8(w, block=(128, 128))
        return rows.dequantize(), segments.dequantize(), segments.scales, weights.dequantize()

    x = _randn(256, 256, dtype=torch.bfloat16, seed=18)
    w = _randn(2, 128, 256, seed=19)
    compiled = torch.compile(quantize_all, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x, w, given), quantize_all(x, w, given), strict=True):
        assert torch.equal(got, want)


def test_plain_eager_calls_skip_the_op_machinery_and_others_do_not(monkeypatch) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = record_calls(monkeypatch, _fp8_ops, ("rows_op", "weights_op", "segments_op"))
    x, w = _randn(300, 256, dtype=torch.bfloat16, seed=21), _randn(2, 128, 256, seed=22)
    splits = torch.tensor([100, 0, 200])
    got = [
        quantize_fp8(x, block=(1, 128)),
        quantize_fp8(w, block=(128, 128)),
        *quantize_fp8(x, block=((1, 128), (128, 1)), splits=splits),
    ]
    want = [
        quantize_fp8_ref(x, block=(1, 128)),
        quantize_fp8_ref(w, block=(128, 128)),
        *quantize_fp8_ref(x, block=((1, 128), (128, 1)), splits=splits),
    ]
    for g, r in zip(got, want, strict=True):
        assert torch.equal(g.data.view(torch.uint8), r.data.view(torch.uint8))
        assert torch.equal(g.scales, r.scales)
    assert calls == []  # plain eager: the kernels ran directly
    recorded = x.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"^t requires grad, but quantize_fp8 is not"):
        quantize_fp8(recorded, block=(1, 128))  # autograd would record it: refused
    with AllocationRecorder(numel=1):  # a dispatch mode: the op
        quantize_fp8(x, block=(1, 128))
    with torch.no_grad():
        quantize_fp8(recorded, block=(1, 128))  # grad mode off: directly again
    with FakeTensorMode() as mode:  # a dispatch mode, and fake tensors: the op
        quantize_fp8(mode.from_tensor(w), block=(128, 128))
    assert calls == ["rows_op", "weights_op"]


def test_direct_quantizer_calls_show_in_the_profiler_under_the_op_names() -> None:
    x = _randn(300, 256, dtype=torch.bfloat16, seed=23)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        quantize_fp8(x, block=((1, 128), (128, 1)), splits=[100, 0, 200])
        quantize_fp8(x[:256].reshape(2, 128, 256), block=(128, 128))
    names = {event.name for event in prof.events()}
    assert {"groupgrad::quantize_fp8_segments", "groupgrad::quantize_fp8_weights"} <= names


def test_cuda_kernels_fall_back_to_the_reference_once_without_triton(monkeypatch, caplog) -> None:
    monkeypatch.setattr(_fp8_ops, "load_triton_kernels", lambda module: (None, "no triton here"))
    _fp8_ops.say_once.cache_clear()
    x = _randn(130, 256, seed=20)
    with caplog.at_level(logging.WARNING, logger=_fp8_ops.__name__):
        data, scales = _fp8_ops._rows_cuda(x)
        _fp8_ops._rows_cuda(x)
        row, seg, block = _fp8_ops_offsets([130])
        _fp8_ops._segments_cuda(x, row, seg, block, 3, 160, True)
        _fp8_ops._weights_cuda([x[:128, :256].reshape(1, 128, 256)])
    said = [r for r in caplog.records if "no triton here" in r.getMessage()]
    assert len(said) == 1, "the fallback was not said exactly once"
    want = _fp8_ops.rows_ref(x)
    assert torch.equal(data.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scales, want[1])


def test_the_one_read_cuda_quantizer_takes_aligned_16_bit_activations_only(monkeypatch) -> None:
    """``_segments_cuda`` hands an activation to the CUTLASS extension's one-read kernel
    only when that kernel can read it (16-bit, contiguous, 16-byte aligned, padded tokens a
    multiple of 16) and the backend runs on its device; else Triton quantizes it. Checked
    here with the backend's answer stood in; on the GPU by test_gpu_fp8_quant.py."""
    from groupgrad.kernels import _cutlass

    monkeypatch.setattr(_cutlass, "unavailable_reason", lambda device: None)
    x = _randn(256, 256, dtype=torch.bfloat16, seed=31)
    flat = x.new_zeros(256 * 256 + 8)
    assert _fp8_ops.cuda_quantizer(x, 304) is _cutlass
    assert _fp8_ops.cuda_quantizer(x.half(), 304) is _cutlass
    assert _fp8_ops.cuda_quantizer(flat[8:].view(256, 256), 304) is _cutlass
    assert _fp8_ops.cuda_quantizer(x.float(), 304) is None
    assert _fp8_ops.cuda_quantizer(x.t(), 304) is None  # not contiguous
    assert _fp8_ops.cuda_quantizer(flat[1 : 1 + 256 * 256].view(256, 256), 304) is None
    assert _fp8_ops.cuda_quantizer(x, 296) is None  # padded tokens not a multiple of 16
    monkeypatch.setattr(_cutlass, "unavailable_reason", lambda device: "not sm_90")
    assert _fp8_ops.cuda_quantizer(x, 304) is None

    def tools_missing(device: torch.device) -> str:
        raise RuntimeError("install the GPU extra")

    monkeypatch.setattr(_cutlass, "unavailable_reason", tools_missing)
    assert _fp8_ops.cuda_quantizer(x, 304) is None  # Triton quantizes; the GEMMs will say why


def test_importing_the_package_imports_neither_triton_nor_the_triton_kernels() -> None:
    code = (
        "import sys, groupgrad.kernels as k; k.quantize_fp8; "
        "print('triton' in sys.modules, 'groupgrad.kernels._fp8_triton' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
