"""The FP8 grouped GEMMs on an H100/H200: CUTLASS's blockwise kernels against fp64 truth.

Every call here must reach CUTLASS: the reference kernels are replaced by
one that raises (``no_reference``), so a silent fallback fails. The truth is
an fp64 product of the dequantized operands; Hopper's FP8 MMA promotes its
accumulators every 128-token block, so the allowed relative (Frobenius)
error is 5e-4 — twice cuBLASLt's blockwise ``scaled_mm`` error on the same
data (2.3–2.5e-4, DEVICE_RUNS.md run 54) — plus the output's rounding.
Outputs are poisoned with NaN before a kernel writes them.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import copy

import pytest
import torch

from groupgrad.kernels import (
    _fp8_gemm,
    grouped_dgrad,
    grouped_fprop,
    grouped_fprop_ref,
    grouped_wgrad,
    grouped_wgrad_ref,
    quantize_fp8,
    tuning,
)

pytestmark = pytest.mark.gpu(capability=(9, 0))

ROWS, WEIGHTS, SEGMENTS = (1, 128), (128, 128), (128, 1)
FP8_REL = 5e-4
SPLIT_SETS = {
    "ragged": [150, 0, 4113, 77],
    "skewed": [3000, 1, 0, 0, 17, 128, 129, 0],
    "one_expert": [0, 0, 513, 0],
    "many_small": [9] * 48 + [0] * 16,
}


_REFERENCES = {"rows_ref": _fp8_gemm.rows_ref, "wgrad_ref": _fp8_gemm.wgrad_ref}


@pytest.fixture(autouse=True)
def no_reference(monkeypatch):
    """A fallback to the reference fails the test instead of passing it silently."""

    def refuse(*args, **kwargs):
        raise AssertionError("the FP8 call fell back to the reference path")

    monkeypatch.setattr(_fp8_gemm, "rows_ref", refuse)
    monkeypatch.setattr(_fp8_gemm, "wgrad_ref", refuse)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


def _rows_of(splits: list[int]) -> list[slice]:
    starts = [sum(splits[:e]) for e in range(len(splits))]
    return [slice(s, s + n) for s, n in zip(starts, splits, strict=True)]


def _rel(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.double() - truth).norm() / truth.norm().clamp_min(1e-30))


def _splits_as(splits: list[int], kind: str):
    return list(splits) if kind == "list" else torch.tensor(splits, device="cuda")


@pytest.mark.parametrize("kind", ["list", "device"])
@pytest.mark.parametrize("name", list(SPLIT_SETS))
def test_fprop_and_dgrad_match_fp64(name: str, kind: str) -> None:
    splits = SPLIT_SETS[name]
    T, E, N, K = sum(splits), len(splits), 384, 256
    x, dy, w = _randn(T, K, seed=1), _randn(T, N, seed=2), _randn(E, N, K, seed=3, scale=0.05)
    x8, dy8 = quantize_fp8(x, block=ROWS), quantize_fp8(dy, block=ROWS)
    w8 = quantize_fp8(w, block=WEIGHTS)
    x64, dy64, w64 = x8.dequantize().double(), dy8.dequantize().double(), w8.dequantize().double()
    y_truth, dx_truth = torch.zeros(T, N, dtype=torch.float64, device="cuda"), None
    dx_truth = torch.zeros(T, K, dtype=torch.float64, device="cuda")
    for e, rows in enumerate(_rows_of(splits)):
        y_truth[rows], dx_truth[rows] = x64[rows] @ w64[e].T, dy64[rows] @ w64[e]
    y = grouped_fprop(
        x8,
        w8,
        _splits_as(splits, kind),
        out=torch.full((T, N), float("nan"), device="cuda", dtype=torch.bfloat16),
    )
    dx = grouped_dgrad(dy8, w8, _splits_as(splits, kind))
    assert y.dtype == dx.dtype == torch.bfloat16
    bf16_rounding = 2.0**-8
    assert _rel(y, y_truth) <= FP8_REL + bf16_rounding
    assert _rel(dx, dx_truth) <= FP8_REL + bf16_rounding
    assert not y.isnan().any()
    again = grouped_fprop(x8, w8, _splits_as(splits, kind))
    assert torch.equal(again, y)  # deterministic: no split-K atomics


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "listed"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("name", list(SPLIT_SETS))
def test_wgrad_into_fp32_main_grads_matches_fp64(name: str, accumulate: bool, packed: bool) -> None:
    splits = SPLIT_SETS[name]
    T, E, N, K = sum(splits), len(splits), 256, 384
    dy, x = _randn(T, N, seed=4), _randn(T, K, seed=5)
    dy8 = quantize_fp8(dy, block=SEGMENTS, splits=torch.tensor(splits, device="cuda"))
    x8 = quantize_fp8(x, block=SEGMENTS, splits=splits)
    dy64, x64 = dy8.dequantize().double(), x8.dequantize().double()
    truth = torch.stack([dy64[rows].T @ x64[rows] for rows in _rows_of(splits)])
    start = torch.randn(E, N, K, device="cuda")
    if accumulate:
        truth = truth + start.double()
    before = start if accumulate else torch.full_like(start, float("nan"))
    out = before.clone() if packed else [before[e].clone() for e in range(E)]
    got = grouped_wgrad(
        dy8, x8, torch.tensor(splits, device="cuda"), out=out, accumulate=accumulate
    )
    result = got if packed else torch.stack(got)
    for e, count in enumerate(splits):
        if count == 0:  # an empty expert: exact zeros on overwrite, untouched on accumulate
            assert torch.equal(
                result[e], start[e] if accumulate else torch.zeros(N, K, device="cuda")
            )
    assert not result.isnan().any()
    assert _rel(result, truth) <= FP8_REL
    rerun = before.clone() if packed else [before[e].clone() for e in range(E)]
    grouped_wgrad(dy8, x8, splits, out=rerun, accumulate=accumulate)
    assert torch.equal(rerun if packed else torch.stack(rerun), result)


@pytest.mark.parametrize("x_splits", ["device", "list"])
def test_a_wgrad_of_operands_quantized_with_other_splits_is_nan(x_splits: str) -> None:
    """Device ``splits`` are never compared on the host: the setup kernel compares the call's
    counts with each operand's own running counts and, where they differ (the operand's
    128-token blocks straddle the call's experts), makes every ``main_grad`` NaN — packed and
    listed, accumulating and overwriting — instead of a plausible wrong gradient. Equal counts
    in another tensor agree."""
    splits, other = SPLIT_SETS["ragged"], [151, 0, 4112, 77]  # the same T
    T, E, N, K = sum(splits), len(splits), 256, 384
    assert sum(other) == T
    dev = torch.tensor(splits, device="cuda")
    dy8 = quantize_fp8(_randn(T, N, seed=4), block=SEGMENTS, splits=dev)
    x = _randn(T, K, seed=5)
    x8 = quantize_fp8(x, block=SEGMENTS, splits=_splits_as(other, x_splits))
    for accumulate in (True, False):
        packed = grouped_wgrad(
            dy8, x8, dev, out=torch.zeros(E, N, K, device="cuda"), accumulate=accumulate
        )
        listed = grouped_wgrad(
            dy8, x8, dev, out=[torch.zeros(N, K, device="cuda") for _ in range(E)],
            accumulate=accumulate,
        )  # fmt: skip
        for got in (packed, torch.stack(listed)):
            assert got.isnan().all(), f"{int((~got.isnan()).sum())} elements not NaN"
    agreeing = quantize_fp8(x, block=SEGMENTS, splits=_splits_as(splits, x_splits))
    got = grouped_wgrad(dy8, agreeing, dev)
    dy64, x64 = dy8.dequantize().double(), agreeing.dequantize().double()
    truth = torch.stack([dy64[rows].T @ x64[rows] for rows in _rows_of(splits)])
    assert _rel(got, truth) <= FP8_REL


def test_wgrad_accumulating_by_reduce_add_matches_the_c_loading_kernel_bit_for_bit() -> None:
    """L2's fp32 add (TMA reduce-add) rounds as the epilogue's ``C + result`` does.

    (``grouped_wgrad`` picks the reduce-add kernel from 1024 tokens per expert:
    the ``"ragged"`` splits of the test above.)

    Expert 0's ``dy`` is zero, so its product is exactly zero: its subnormal
    ``main_grad`` entries must come back unchanged (no flush to zero).
    """
    splits = SPLIT_SETS["skewed"]
    T, E, N, K = sum(splits), len(splits), 256, 384
    dev = torch.tensor(splits, device="cuda")
    dy = _randn(T, N, seed=8)
    dy[: splits[0]] = 0
    dy8 = quantize_fp8(dy, block=SEGMENTS, splits=dev)
    x8 = quantize_fp8(_randn(T, K, seed=9), block=SEGMENTS, splits=dev)
    start = torch.randn(E, N, K, device="cuda")
    start[0] = torch.randn(N, K, device="cuda") * 1e-40  # subnormal fp32
    assert (start[0] != 0).any()
    assert (start[0].abs() < torch.finfo(torch.float32).tiny).all()
    loads_c = tuning.fp8_variant_for("wgrad", torch.float32)  # what overwrites run
    adds = tuning.fp8_variant_for("wgrad", torch.float32, accumulate=True, tokens_per_expert=1e9)
    assert adds != loads_c
    via_c, via_add = start.clone(), start.clone()
    tuning.run_fp8_cutlass("wgrad", dy8, x8, dev, via_c, variant=loads_c, accumulate=True)
    tuning.run_fp8_cutlass("wgrad", dy8, x8, dev, via_add, variant=adds, accumulate=True)
    assert torch.equal(via_add[0], start[0])
    assert torch.equal(via_add, via_c)
    assert not torch.equal(via_add[1:], start[1:])


@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
def test_every_tile_order_gives_the_same_bits(op: str) -> None:
    """The scheduler's swizzle and raster order move tiles between CTAs, never change them."""
    splits = SPLIT_SETS["ragged"]
    T, E, N, K = sum(splits), len(splits), 384, 256
    dev = torch.tensor(splits, device="cuda")
    if op == "wgrad":
        a = quantize_fp8(_randn(T, N, seed=10), block=SEGMENTS, splits=dev)
        b = quantize_fp8(_randn(T, K, seed=11), block=SEGMENTS, splits=dev)
        variant = tuning.fp8_variant_for(
            op, torch.float32, accumulate=True, tokens_per_expert=T / E
        )
        start = torch.randn(E, N, K, device="cuda")
    else:
        a = quantize_fp8(_randn(T, K if op == "fprop" else N, seed=10), block=ROWS)
        b = quantize_fp8(_randn(E, N, K, seed=11, scale=0.05), block=WEIGHTS)
        variant = tuning.fp8_variant_for(op, torch.bfloat16)
        start = torch.zeros(T, N if op == "fprop" else K, device="cuda", dtype=torch.bfloat16)
    results = []
    for swizzle, along_n in [(1, False), (8, True), (2, False), (4, True)]:
        out = start.clone()
        tuning.run_fp8_cutlass(
            op, a, b, dev, out, variant=variant, accumulate=op == "wgrad", max_swizzle=swizzle,
            raster_along_n=along_n,
        )  # fmt: skip
        results.append(out)
    assert all(torch.equal(r, results[0]) for r in results[1:])
    assert not torch.equal(results[0], start)


def _misaligned_like(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its shape and strides, one element past a 16-byte boundary."""
    count = t.untyped_storage().nbytes() // t.element_size() + 1
    view = torch.empty(count, dtype=t.dtype, device=t.device)[1:].as_strided(t.shape, t.stride())
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


def test_operands_moved_to_misaligned_memory_take_the_reference_path(monkeypatch) -> None:
    """A sealed form given misaligned scales (fprop) or data (wgrad) is sealed again as not
    placed, so its call's support check reads the addresses and the call runs on the
    reference path, with the reference's result: not the kernels' entry, which refuses
    the address, nor a kernel reading it."""
    taken: list[str] = []
    for name, reference in _REFERENCES.items():

        def recorded(*args, _name=name, _reference=reference, **kwargs):
            taken.append(_name)
            return _reference(*args, **kwargs)

        monkeypatch.setattr(_fp8_gemm, name, recorded)
    splits = SPLIT_SETS["ragged"]
    T, E, N, K = sum(splits), len(splits), 256, 384
    x8, dy8 = (
        quantize_fp8(_randn(T, C, seed=s), block=(ROWS, SEGMENTS), splits=splits)
        for C, s in ((K, 1), (N, 2))
    )
    w8 = quantize_fp8(_randn(E, N, K, seed=3), block=WEIGHTS)
    assert all(form._placed(_fp8_gemm.placed_for_kernels) for form in (*x8, *dy8, w8))
    grouped_fprop(x8[0], w8, splits)
    grouped_wgrad(dy8[1], x8[1], splits)
    assert taken == []  # placed: the kernels
    x_rows = copy.copy(x8[0])
    x_rows.scales = _misaligned_like(x_rows.scales)
    got = grouped_fprop(x_rows, w8, splits)
    assert taken == ["rows_ref"]
    assert not x_rows._placed(_fp8_gemm.placed_for_kernels)
    assert torch.equal(got, grouped_fprop_ref(x8[0], w8, splits))
    dy_seg = copy.copy(dy8[1])
    dy_seg.data = _misaligned_like(dy_seg.data)
    taken.clear()
    got = grouped_wgrad(dy_seg, x8[1], splits)
    assert taken == ["wgrad_ref"]
    assert not dy_seg._placed(_fp8_gemm.placed_for_kernels)
    assert torch.equal(got, grouped_wgrad_ref(dy8[1], x8[1], splits))


def test_wgrad_into_bf16() -> None:
    splits = SPLIT_SETS["ragged"]
    T, N, K = sum(splits), 256, 384
    dy8 = quantize_fp8(_randn(T, N, seed=6), block=SEGMENTS, splits=splits)
    x8 = quantize_fp8(_randn(T, K, seed=7), block=SEGMENTS, splits=splits)
    truth = torch.stack(
        [dy8.dequantize().double()[r].T @ x8.dequantize().double()[r] for r in _rows_of(splits)]
    )
    got = grouped_wgrad(dy8, x8, splits, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert _rel(got, truth) <= FP8_REL + 2.0**-8


def test_cuda_graph_captures_quantize_and_the_three_gemms() -> None:
    splits_list = SPLIT_SETS["skewed"]
    T, E, N, K = sum(splits_list), len(splits_list), 256, 384
    splits = torch.tensor(splits_list, device="cuda")
    x, dy, w = _randn(T, K, seed=8), _randn(T, N, seed=9), _randn(E, N, K, seed=10, scale=0.05)
    main_grad = torch.zeros(E, N, K, device="cuda")

    def step():
        x_rows, x_seg = quantize_fp8(x, block=(ROWS, SEGMENTS), splits=splits)
        dy_rows, dy_seg = quantize_fp8(dy, block=(ROWS, SEGMENTS), splits=splits)
        w8 = quantize_fp8(w, block=WEIGHTS)
        y = grouped_fprop(x_rows, w8, splits)
        dx = grouped_dgrad(dy_rows, w8, splits)
        grouped_wgrad(dy_seg, x_seg, splits, out=main_grad, accumulate=True)
        return y, dx

    eager_y, eager_dx = step()
    eager_grad = main_grad.clone()
    main_grad.zero_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    main_grad.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, dx = step()
    main_grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager_y)
    assert torch.equal(dx, eager_dx)
    assert torch.equal(main_grad, eager_grad)


def test_compile_fullgraph_runs_the_cutlass_kernels() -> None:
    splits_list = SPLIT_SETS["ragged"]
    T, E, N, K = sum(splits_list), len(splits_list), 256, 384
    splits = torch.tensor(splits_list, device="cuda")
    x, w = _randn(T, K, seed=11), _randn(E, N, K, seed=12, scale=0.05)

    def fprop(x, w):
        return grouped_fprop(quantize_fp8(x, block=ROWS), quantize_fp8(w, block=WEIGHTS), splits)

    assert torch.equal(torch.compile(fprop, fullgraph=True)(x, w), fprop(x, w))
