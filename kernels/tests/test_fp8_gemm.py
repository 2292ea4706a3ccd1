"""FP8 grouped GEMMs on the reference path: results, output dtypes, errors, custom ops, compile.

Expected results are fp64 products of the dequantized operands, computed
here per expert (``_expected_*``); the CUTLASS kernels run against the same
oracle on a GPU in ``test_gpu_fp8_gemm.py``.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from groupgrad.kernels import (
    Fp8Blocks,
    _fp8_gemm,
    _validate,
    grouped_dgrad,
    grouped_dgrad_ref,
    grouped_fprop,
    grouped_fprop_ref,
    grouped_wgrad,
    grouped_wgrad_ref,
    prepare_wgrad,
    quantize_fp8,
    quantize_fp8_ref,
    swiglu_probs_backward_fp8,
    swiglu_probs_fp8,
)

SPLITS = [150, 0, 37, 300, 1]  # ragged, an empty expert, one token
T, E, N, K = sum(SPLITS), len(SPLITS), 256, 384
ROWS, WEIGHTS, SEGMENTS = (1, 128), (128, 128), (128, 1)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _expert_rows(splits: list[int]) -> list[slice]:
    starts = [sum(splits[:e]) for e in range(len(splits))]
    return [slice(s, s + n) for s, n in zip(starts, splits, strict=True)]


def _expected_rows(op: str, a: Fp8Blocks, w: Fp8Blocks, splits: list[int]) -> torch.Tensor:
    a64, w64 = a.dequantize().double(), torch.as_tensor(w.dequantize()).double()
    cols = w64.shape[1] if op == "fprop" else w64.shape[2]
    out = torch.zeros(a64.shape[0], cols, dtype=torch.float64)
    for e, rows in enumerate(_expert_rows(splits)):
        out[rows] = a64[rows] @ (w64[e].T if op == "fprop" else w64[e])
    return out


def _expected_wgrad(dy: Fp8Blocks, x: Fp8Blocks, splits: list[int]) -> torch.Tensor:
    dy64, x64 = dy.dequantize().double(), x.dequantize().double()
    return torch.stack([dy64[rows].T @ x64[rows] for rows in _expert_rows(splits)])


@pytest.fixture(scope="module")
def operands() -> dict[str, Fp8Blocks]:
    x, dy = _randn(T, K, seed=1), _randn(T, N, seed=2)
    w = _randn(E, N, K, seed=3) * 0.05
    w[3, :128, :128] *= 1e4  # one tile far louder than its neighbours: scales are per tile
    x_rows, x_segments = quantize_fp8(x, block=(ROWS, SEGMENTS), splits=SPLITS)
    dy_rows, dy_segments = quantize_fp8(dy, block=(ROWS, SEGMENTS), splits=torch.tensor(SPLITS))
    return {
        "x": x_rows, "dy": dy_rows, "w": quantize_fp8(w, block=WEIGHTS),
        "x_seg": x_segments, "dy_seg": dy_segments,
    }  # fmt: skip


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("twin", [False, True], ids=["kernel", "ref"])
@pytest.mark.parametrize("op", ["fprop", "dgrad"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16])
def test_fprop_dgrad_match_fp64_of_dequantized(
    operands: dict[str, Fp8Blocks], op: str, out_dtype: torch.dtype | None, twin: bool
) -> None:
    a = operands["x" if op == "fprop" else "dy"]
    fn = {
        ("fprop", False): grouped_fprop, ("fprop", True): grouped_fprop_ref,
        ("dgrad", False): grouped_dgrad, ("dgrad", True): grouped_dgrad_ref,
    }[op, twin]  # fmt: skip
    expected = _expected_rows(op, a, operands["w"], SPLITS)
    if out_dtype is None:
        y = fn(a, operands["w"], SPLITS)
        assert y.dtype == torch.bfloat16  # the dtype the activation was quantized from
    else:
        out = torch.full(expected.shape, float("nan"), dtype=out_dtype)
        y = fn(a, operands["w"], torch.tensor(SPLITS), out=out)
        assert y is out
    tol = 1e-5 if y.dtype == torch.float32 else 2.0 ** -(8 if y.dtype == torch.bfloat16 else 11)
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol * expected.abs().max())


@pytest.mark.parametrize("twin", [False, True], ids=["kernel", "ref"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "listed"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_wgrad_lands_in_fp32_main_grads(
    operands: dict[str, Fp8Blocks], packed: bool, accumulate: bool, twin: bool
) -> None:
    dy, x = operands["dy_seg"], operands["x_seg"]
    expected = _expected_wgrad(dy, x, SPLITS)
    start = _randn(E, N, K, seed=4, dtype=torch.float32)
    before = start if accumulate else torch.full_like(start, float("nan"))
    out: torch.Tensor | list[torch.Tensor] = before.clone() if packed else list(before.clone())
    fn = grouped_wgrad_ref if twin else grouped_wgrad
    got = fn(dy, x, SPLITS, out=out, accumulate=accumulate)
    assert got is out
    result = torch.stack(list(got)) if not packed else got
    want = expected + start.double() if accumulate else expected
    torch.testing.assert_close(result.double(), want, rtol=1e-5, atol=1e-4)
    if not accumulate:  # the empty expert: exact zeros, never the NaN poison
        assert torch.equal(result[1], torch.zeros(N, K))


def test_wgrad_defaults_to_fp32_and_takes_out_dtype(operands: dict[str, Fp8Blocks]) -> None:
    dy, x = operands["dy_seg"], operands["x_seg"]
    assert grouped_wgrad(dy, x, SPLITS).dtype == torch.float32
    bf16 = grouped_wgrad(dy, x, SPLITS, out_dtype=torch.bfloat16)
    expected = _expected_wgrad(dy, x, SPLITS)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.double(), expected, rtol=2**-8, atol=1e-3)


def test_wgrad_operands_may_carry_splits_in_different_forms(
    operands: dict[str, Fp8Blocks],
) -> None:
    # x was quantized with a list, dy with a tensor: equal counts, one result
    got = grouped_wgrad(operands["dy_seg"], operands["x_seg"], torch.tensor(SPLITS))
    expected = _expected_wgrad(operands["dy_seg"], operands["x_seg"], SPLITS)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_a_per_tensor_scale_would_fail_the_oracle(operands: dict[str, Fp8Blocks]) -> None:
    """The oracle sees block scales: with the loud tile's scale everywhere the result moves."""
    w = operands["w"]
    one_scale = Fp8Blocks(
        w.data, torch.full_like(w.scales, float(w.scales.max())), block=WEIGHTS,
        dtype=w.dtype, shape=w.shape, data_t=w.data_t,
    )  # fmt: skip
    right = grouped_fprop(operands["x"], w, SPLITS, out=torch.empty(T, N))
    wrong = grouped_fprop(operands["x"], one_scale, SPLITS, out=torch.empty(T, N))
    assert (right - wrong).abs().max() > 100 * right.abs().max() * 2**-8


def test_prepared_fp8_wgrad_runs_once(operands: dict[str, Fp8Blocks]) -> None:
    out = torch.zeros(E, N, K)
    prepared = prepare_wgrad(
        operands["dy_seg"], operands["x_seg"], SPLITS, out=out, accumulate=True
    )
    assert torch.equal(out, torch.zeros(E, N, K))  # nothing written before run()
    prepared.run()
    once = out.clone()
    with pytest.raises(RuntimeError, match="ran already"):
        prepared.run()
    assert torch.equal(out, once)


def test_no_tokens_at_all() -> None:
    splits = [0, 0]
    x8 = quantize_fp8(torch.zeros(0, 128), block=SEGMENTS, splits=splits)
    out = [torch.full((128, 128), float("nan")) for _ in splits]
    grouped_wgrad(x8, x8, splits, out=out)
    assert all(torch.equal(o, torch.zeros(128, 128)) for o in out)
    rows8 = quantize_fp8(torch.zeros(0, 128), block=ROWS)
    w8 = quantize_fp8(torch.ones(2, 128, 128), block=WEIGHTS)
    assert grouped_fprop(rows8, w8, splits).shape == (0, 128)


# --------------------------------------------------------------------------- errors


def test_mixing_fp8_with_bf16_names_the_argument(operands: dict[str, Fp8Blocks]) -> None:
    x_bf16 = _randn(T, K, seed=1)
    with pytest.raises(
        TypeError, match=r"^x is a Tensor, expected an Fp8Blocks of block \(1, 128\)"
    ):
        grouped_fprop(x_bf16, operands["w"], SPLITS)
    with pytest.raises(TypeError, match=r"^weights is a Tensor, expected an Fp8Blocks"):
        grouped_dgrad(operands["dy"], _randn(E, N, K, seed=3), SPLITS)
    with pytest.raises(TypeError, match=r"^x is a Tensor"):
        grouped_wgrad(operands["dy_seg"], x_bf16, SPLITS)


def test_wrong_block_names_the_argument(operands: dict[str, Fp8Blocks]) -> None:
    with pytest.raises(
        ValueError, match=r"^x is an Fp8Blocks of block \(128, 1\), expected \(1, 128\)"
    ):
        grouped_fprop(operands["x_seg"], operands["w"], SPLITS)
    with pytest.raises(
        ValueError, match=r"^dy is an Fp8Blocks of block \(1, 128\), expected \(128, 1\)"
    ):
        grouped_wgrad(operands["dy"], operands["x_seg"], SPLITS)
    with pytest.raises(
        ValueError, match=r"^w1 is an Fp8Blocks of block \(1, 128\), expected \(128, 128\)"
    ):
        grouped_fprop(operands["x"], operands["x"], SPLITS, names=["w1"])


def test_inner_size_mismatch(operands: dict[str, Fp8Blocks]) -> None:
    with pytest.raises(ValueError, match=r"^x has 256 columns, expected K = 384"):
        grouped_fprop(operands["dy"], operands["w"], SPLITS)


def test_splits_that_straddle_the_quantized_blocks(operands: dict[str, Fp8Blocks]) -> None:
    moved = [151, 0, 36, 300, 1]
    with pytest.raises(ValueError, match=r"^dy was quantized with splits \[150, 0, 37, 300, 1\]"):
        grouped_wgrad(operands["dy_seg"], operands["x_seg"], moved)
    with pytest.raises(ValueError, match=r"^dy was quantized for 5 experts, splits has 2 entries"):
        grouped_wgrad(operands["dy_seg"], operands["x_seg"], torch.tensor([T - 1, 1]))


def test_splits_refilled_after_quantization_are_compared_with_the_blocks() -> None:
    # Catches: the check comparing the live splits object the operands were quantized with
    # (refilled since: accepted, and a wgrad over experts its blocks straddle) instead of the
    # counts the blocks were cut by.
    splits = [100, 200]
    x, dy = _randn(300, K, seed=11), _randn(300, N, seed=12)
    x8 = quantize_fp8(x, block=SEGMENTS, splits=splits)
    dy8 = quantize_fp8(dy, block=SEGMENTS, splits=splits)
    splits[0], splits[1] = 200, 100  # the caller's buffer, refilled
    with pytest.raises(ValueError, match=r"^dy was quantized with splits \[100, 200\] but splits"):
        grouped_wgrad(dy8, x8, splits)
    got = grouped_wgrad(dy8, x8, [100, 200])  # the counts the blocks were cut by
    want = _expected_wgrad(dy8, x8, [100, 200])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_the_reference_op_makes_a_wgrad_of_other_counts_nan(operands: dict[str, Fp8Blocks]) -> None:
    # Catches: the CPU op (what torch.compile runs, no host check) computing a plausible wgrad
    # over experts the blocks straddle, where the CUDA setup makes every output NaN.
    dy, x = operands["dy_seg"], operands["x_seg"]
    out = [torch.zeros(N, K) for _ in range(E)]
    moved = torch.tensor([151, 0, 36, 300, 1])
    torch.ops.groupgrad.fp8_grouped_wgrad(
        dy.data, dy.scales, dy.row_offsets, x.data, x.scales, x.row_offsets, moved, T, out, True,
    )  # fmt: skip
    assert all(dw.isnan().all() for dw in out)


def test_the_source_dtype_and_the_expert_count_are_checked(operands: dict[str, Fp8Blocks]) -> None:
    x = copy.copy(operands["x"])
    x.dtype = torch.int32  # fprop would return it
    with pytest.raises(TypeError, match=r"^x says it was quantized from torch\.int32, expected"):
        grouped_fprop(x, operands["w"], SPLITS)
    w = operands["w"]
    none = Fp8Blocks(w.data[:0], w.scales[:0], block=WEIGHTS, dtype=w.dtype, shape=(0, N, K),
                     data_t=w.data_t[:0])  # fmt: skip
    with pytest.raises(ValueError, match=r"shape \(0, 256, 384\), expected at least one expert"):
        grouped_fprop(operands["x"], none, [])
    x_none = quantize_fp8(_randn(0, K, seed=1), block=SEGMENTS, splits=[])
    with pytest.raises(ValueError, match=r"^dy was quantized for no expert \(splits had no entr"):
        grouped_wgrad(x_none, x_none, [])


def test_a_sealed_form_is_held_to_the_gemm_rules_on_every_call(
    operands: dict[str, Fp8Blocks],
) -> None:
    # Catches: the seal's mark that the GEMMs' rules hold for its form set before they were
    # checked (a quantized form no GEMM takes would pass from its second call on), or read
    # before the source dtype's check.
    x_none = quantize_fp8(_randn(0, K, seed=1), block=SEGMENTS, splits=[])
    w_2d = quantize_fp8(_randn(N, K, seed=2), block=WEIGHTS)  # one weight, not (E, N, K)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"quantized for no expert"):
            grouped_wgrad(x_none, x_none, [])
        with pytest.raises(ValueError, match=r"^weights is an Fp8Blocks of shape \(256, 384\)"):
            grouped_fprop(operands["x"], w_2d, SPLITS)
    x = copy.copy(operands["x"])
    grouped_fprop(x, operands["w"], SPLITS)
    seal = x._seal_holds("x")
    assert seal is not None
    assert seal[1]  # marked: the rules held
    x.dtype = torch.int32
    with pytest.raises(TypeError, match=r"^x says it was quantized from torch\.int32"):
        grouped_fprop(x, operands["w"], SPLITS)


def test_out_may_not_overlap_what_the_fp8_kernels_read(operands: dict[str, Fp8Blocks]) -> None:
    # Catches: out sharing memory with an operand's scales, or with the transposed weights
    # dgrad reads (only the data fprop reads was compared): on the GPU the kernel would read
    # what its epilogue wrote, a silent wrong result. Nothing is written on a refusal.
    w, x, dy_seg = operands["w"], operands["x"], operands["dy_seg"]
    shared = torch.zeros(E * K * N, dtype=torch.uint8)  # (E, K, N) e4m3 and a (T, K) bf16 out
    w_t = copy.copy(w)
    w_t.data_t = shared.view(torch.float8_e4m3fn).view(E, K, N).copy_(w.data_t)
    before = shared.clone()
    with pytest.raises(ValueError, match=r"^out overlaps weights in memory"):
        grouped_dgrad(
            operands["dy"], w_t, SPLITS, out=shared[: T * K * 2].view(torch.bfloat16).view(T, K)
        )
    # Catches: an out over the orientation the op does not read (the other op reads it: one
    # quantized weight serves fprop and dgrad), which was accepted and overwritten.
    with pytest.raises(ValueError, match=r"^out overlaps weights in memory"):
        grouped_fprop(x, w_t, SPLITS, out=shared[: T * N * 2].view(torch.bfloat16).view(T, N))
    w_d = copy.copy(w)
    held = torch.zeros(E * N * K, dtype=torch.uint8)
    w_d.data = held.view(torch.float8_e4m3fn).view(E, N, K).copy_(w.data)
    held_before = held.clone()
    with pytest.raises(ValueError, match=r"^out overlaps weights in memory"):
        grouped_dgrad(
            operands["dy"], w_d, SPLITS, out=held[: T * K * 2].view(torch.bfloat16).view(T, K)
        )
    assert torch.equal(held, held_before)
    y = torch.zeros(T, N, dtype=torch.bfloat16)  # x's (T, 3) scales in its first bytes
    x_s = copy.copy(x)
    x_s.scales = y.view(-1).view(torch.float32)[: T * 3].view(3, T).t().copy_(x.scales)
    with pytest.raises(ValueError, match=r"^out overlaps x\.scales in memory"):
        grouped_fprop(x_s, w, SPLITS, out=y)
    dw = torch.zeros(E, N, K)  # dy's scales in its first rows
    dy_s = copy.copy(dy_seg)
    dy_s.scales = dw.view(-1)[: dy_seg.scales.numel()].view_as(dy_seg.scales).copy_(dy_seg.scales)
    dw_before = dw.clone()
    for out in (dw, list(dw.unbind(0))):
        with pytest.raises(ValueError, match=r"^out(\[0\])? overlaps dy\.scales in memory"):
            grouped_wgrad(dy_s, operands["x_seg"], SPLITS, out=out, accumulate=True)
    assert torch.equal(shared, before)
    assert torch.equal(dw, dw_before)


def test_a_hand_built_form_of_a_shape_no_gemm_takes_is_named(
    operands: dict[str, Fp8Blocks],
) -> None:
    # Catches: "the activation" or "an Fp8Blocks" in the message instead of the argument.
    x = operands["x_seg"]

    def declared(shape: tuple[int, ...]) -> Fp8Blocks:
        form = copy.copy(x)
        form.shape = shape
        return form

    dy = operands["dy_seg"]
    with pytest.raises(ValueError, match=rf"^x has shape \({T}, 100\), expected K and N multiples"):
        grouped_wgrad(dy, declared((T, 100)), SPLITS)
    with pytest.raises(ValueError, match=r"^x is a \(128, 1\) Fp8Blocks of shape \(1, "):
        grouped_wgrad(dy, declared((1, T, K)), SPLITS)


def test_hand_built_layout_is_refused(operands: dict[str, Fp8Blocks]) -> None:
    x = operands["x"]
    row_major = Fp8Blocks(x.data, x.scales.contiguous(), block=ROWS, dtype=x.dtype, shape=x.shape)
    with pytest.raises(
        ValueError, match=r"^x\.scales is \(488, 3\) \(3, 1\) torch\.float32 cpu, expected"
    ):
        grouped_fprop(row_major, operands["w"], SPLITS)
    w = operands["w"]
    no_t = Fp8Blocks(w.data, w.scales, block=WEIGHTS, dtype=w.dtype, shape=w.shape)
    with pytest.raises(ValueError, match=r"^weights\.data_t is None, expected \(5, 384, 256\)"):
        grouped_dgrad(operands["dy"], no_t, SPLITS)
    dy = operands["dy_seg"]
    int32_offsets = copy.copy(dy)
    int32_offsets.row_offsets = dy.row_offsets.int()
    with pytest.raises(
        TypeError,  # a dtype: a TypeError, whatever else the message shows
        match=r"^dy\.row_offsets is \(6,\) \(1,\) torch\.int32 cpu, expected \(6,\) with strides "
        r"\(1,\) torch\.int64",
    ):
        grouped_wgrad(int32_offsets, operands["x_seg"], SPLITS)
    e5m2 = copy.copy(w)
    e5m2.data_t = w.data_t.view(torch.float8_e5m2)
    with pytest.raises(TypeError, match=r"^weights\.data_t is \(5, 384, 256\) .*float8_e5m2"):
        grouped_dgrad(operands["dy"], e5m2, SPLITS)
    listed_shape = copy.copy(x)
    listed_shape.shape = list(x.shape)  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"^x\.shape is \[488, 384\], expected a tuple"):
        grouped_fprop(listed_shape, w, SPLITS)
    overlapping = copy.copy(dy)  # in bounds, but experts 0 and 1 would share columns
    overlapping.seg_offsets = torch.tensor([0, 0, 160, 208, 512, 528])
    with pytest.raises(ValueError, match=r"^dy\.seg_offsets is \[0, 0, 160, 208, 512, 528\], exp"):
        grouped_wgrad(overlapping, operands["x_seg"], SPLITS)
    for tampered in (None, dy.seg_offsets.tolist()):  # not a tensor: named, not torch's error
        sealed_then_tampered = copy.copy(dy)
        sealed_then_tampered.seg_offsets = tampered
        with pytest.raises(ValueError, match=rf"^dy\.seg_offsets is a {type(tampered).__name__} "):
            grouped_wgrad(sealed_then_tampered, operands["x_seg"], SPLITS)
    for part in ("data", "scales"):  # a hand-built form missing a tensor
        missing = Fp8Blocks(
            **{"data": x.data, "scales": x.scales, part: None},
            block=ROWS, dtype=x.dtype, shape=x.shape,
        )  # fmt: skip
        with pytest.raises(TypeError, match=r"^x holds .*NoneType .*expected torch\.float8_e4m3fn"):
            grouped_fprop(missing, w, SPLITS)
    matrix = copy.copy(dy)  # no expert count to read off it
    matrix.row_offsets = dy.row_offsets[:, None]
    with pytest.raises(ValueError, match=r"^x\.row_offsets is of shape \(6, 1\), expected an \(E"):
        grouped_wgrad(operands["dy_seg"], matrix, SPLITS)
    shifted = copy.copy(dy)  # past the tensors: an IndexError in the reference before
    shifted.row_offsets = dy.row_offsets + 1000
    with pytest.raises(ValueError, match=r"^dy\.row_offsets is \[1000, 1150"):
        grouped_wgrad(shifted, operands["x_seg"], SPLITS)
    strided_seg = torch.stack([dy.seg_offsets] * 2, 1)[:, 0]  # a hand-built form: all checked
    parts = (dy.data, None, dy.scales, dy.row_offsets, strided_seg, dy.block_offsets)
    strided = Fp8Blocks.from_tensors(parts, block=SEGMENTS, dtype=dy.dtype, shape=dy.shape)
    with pytest.raises(ValueError, match=r"^dy\.seg_offsets is \(6,\) \(2,\) torch\.int64"):
        grouped_wgrad(strided, operands["x_seg"], SPLITS)
    expanded = copy.copy(w)
    expanded.scales = w.scales[:1].expand(E, -1, -1)  # one expert's scales for all: stride 0
    with pytest.raises(ValueError, match=r"^weights\.scales is \(5, 2, 3\) \(0, 3, 1\)"):
        grouped_fprop(operands["x"], expanded, SPLITS)
    wide = Fp8Blocks(x.data.view(T, 3, 128)[:, :2].reshape(T, 256), x.scales[:, :2], block=ROWS,
                     dtype=x.dtype, shape=(T, 200))  # fmt: skip
    with pytest.raises(ValueError, match=r"expected K and N multiples of 128 for FP8"):
        grouped_dgrad(wide, operands["w"], SPLITS)


@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_fp8_ref], ids=["ops", "ref"])
def test_every_quantized_form_passes_the_full_layout_check(quantize) -> None:
    """The quantizer seals its forms, so the validator skips their tensors' check: each form,
    its seal cleared, must pass that check (a quantizer writing another layout fails here)."""
    x = _randn(T, K, seed=4)
    forms = [*quantize(x, block=(ROWS, SEGMENTS), splits=SPLITS), quantize(x, block=ROWS)]
    forms += [quantize(x, block=SEGMENTS, splits=torch.tensor(SPLITS))]
    forms += [quantize(_randn(E, N, K, seed=5), block=WEIGHTS)]
    forms += [quantize(list(_randn(E, N, K, seed=5).unbind(0)), block=WEIGHTS)]
    h_rows, a_rows = swiglu_probs_fp8(_randn(T, 2 * K, seed=6), None)  # the FP8 SwiGLU's too
    dh_rows, dh_seg, _, a_seg = swiglu_probs_backward_fp8(
        _randn(T, K, seed=7), h_rows, splits=SPLITS
    )
    for form in [*forms, h_rows, a_rows, dh_rows, dh_seg, a_seg]:
        assert form is not None
        assert form._seal_holds("x")
        form._seal = None
        assert _validate.fp8_operand("x", form, form.block) is form
        assert form._seal_holds("x")


def _misaligned_like(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its shape and strides, starting one element past its buffer's
    (16-byte aligned) start."""
    buffer = torch.empty(t.untyped_storage().nbytes() // t.element_size() + 1, dtype=t.dtype)
    view = buffer[1:].as_strided(t.shape, t.stride())
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


def test_a_seal_says_whether_the_kernels_may_read_its_tensors_where_they_lie(
    operands: dict[str, Fp8Blocks],
) -> None:
    """A seal records whether the CUDA kernels may read its form's data and scales where they
    lie (16-byte aligned, int32 sizes), so a call's support check reads their addresses no
    more: the quantizer's forms are placed; a form given misaligned scales or data is sealed
    again by the validator as not placed (on CUDA its call then takes the reference path,
    as before seals, instead of reaching the kernels' entry, which refuses it)."""
    placed = _fp8_gemm.placed_for_kernels
    assert all(form._placed(placed) for form in operands.values())
    x, w, dy, x_seg = (operands[name] for name in ("x", "w", "dy_seg", "x_seg"))
    want, want_dw = grouped_fprop(x, w, SPLITS), grouped_wgrad(dy, x_seg, SPLITS)
    runs = {  # one tensor of a form moved to misaligned memory, then a call that validates it
        ("x", "scales"): lambda form: grouped_fprop(form, w, SPLITS),
        ("dy_seg", "data"): lambda form: grouped_wgrad(form, x_seg, SPLITS),
        ("w", "data_t"): lambda form: grouped_fprop(x, form, SPLITS),  # dgrad reads it
    }
    for (name, part), run in runs.items():
        form = copy.copy(operands[name])
        setattr(form, part, _misaligned_like(getattr(form, part)))
        assert torch.equal(run(form), want_dw if name == "dy_seg" else want)
        assert form._seal_holds("x")
        assert not form._placed(placed), (name, part)
    # Given a tensor it cannot seal (a subclass), a form keeps no seal, so no stale fact.
    x = copy.copy(operands["x"])
    x.scales = operands["x"].scales.clone().as_subclass(_Marked)
    assert torch.equal(grouped_fprop(x, w, SPLITS), want)
    assert x._seal is None
    assert not x._placed(placed)


class _Marked(torch.Tensor):
    """A tensor subclass: a form holding one is not sealed."""


def test_a_sealed_form_changed_after_quantization_is_checked_again(
    operands: dict[str, Fp8Blocks],
) -> None:
    x = copy.copy(operands["x"])  # sealed by the quantizer
    x.scales = x.scales.clone()  # same layout, another tensor: checked, then sealed again
    assert not x._seal_holds("x")
    grouped_fprop(x, operands["w"], SPLITS)
    assert x._seal_holds("x")
    x.scales.t_()  # in place: another shape and strides
    with pytest.raises(ValueError, match=r"^x\.scales is \(3, 488\) \(488, 1\) torch\.float32"):
        grouped_fprop(x, operands["w"], SPLITS)
    # `.data =` gives a tensor other memory, shape, strides or dtype and moves no version:
    # checked again all the same (each x below has tensors of its own: the fixture's stay).
    x = copy.copy(operands["x"])
    x.scales = x.scales.clone()
    grouped_fprop(x, operands["w"], SPLITS)
    x.scales.data = x.scales.clone()  # another address, the same layout: passes, sealed again
    assert not x._seal_holds("x")
    grouped_fprop(x, operands["w"], SPLITS)
    assert x._seal_holds("x")
    x.scales.data = x.scales.view(torch.int32)  # the same memory, read as int32
    with pytest.raises(TypeError, match=r"^x holds torch\.float8_e4m3fn data and torch\.int32"):
        grouped_fprop(x, operands["w"], SPLITS)
    x = copy.copy(operands["x"])
    x.scales = x.scales.clone()
    grouped_fprop(x, operands["w"], SPLITS)
    x.scales.data = x.scales.contiguous()  # row-major now: the kernels read them column-major
    with pytest.raises(ValueError, match=r"^x\.scales is \(488, 3\) \(3, 1\) torch\.float32"):
        grouped_fprop(x, operands["w"], SPLITS)
    x = copy.copy(operands["x"])
    x.data = x.data.clone()
    grouped_fprop(x, operands["w"], SPLITS)
    x.data.data = x.data[: T - 8]  # the same address and strides, fewer rows
    with pytest.raises(ValueError, match=r"^x\.data is \(480, 384\) \(384, 1\)"):
        grouped_fprop(x, operands["w"], SPLITS)
    longer = copy.copy(operands["x"])
    longer.shape = (T + 1, K)  # the same tensors, another shape
    with pytest.raises(ValueError, match=r"^x\.data is \(488, 384\) \(384, 1\) .* expected \(489"):
        grouped_fprop(longer, operands["w"], [*SPLITS[:-1], 2])


def test_dgrad_reads_the_transposed_weights_as_the_cuda_kernel_does(
    operands: dict[str, Fp8Blocks],
) -> None:
    # Catches: the reference dgrad reading w.data where the CUDA kernel reads w.data_t, so a
    # form whose two orientations disagree gave CPU and GPU different answers.
    w = copy.copy(operands["w"])
    w.data_t = torch.zeros_like(w.data_t)  # another tensor: the form is checked again
    dx = grouped_dgrad(operands["dy"], w, SPLITS)
    assert not dx.any()
    w.data = torch.zeros_like(w.data)
    w.data_t = operands["w"].data_t
    want = grouped_dgrad(operands["dy"], operands["w"], SPLITS)
    assert want.any()
    assert torch.equal(grouped_dgrad(operands["dy"], w, SPLITS), want)


def test_token_counts_written_in_place_after_quantization_are_refused() -> None:
    # Catches: row_offsets edited in place to counts with the same 16-aligned segments and
    # blocks ([3, 0, 7] -> [5, 0, 5]): the form passed every layout check for splits [5, 0, 5],
    # and the wgrad read padding and shifted tokens (relative error 1.09, no NaN).
    gen = torch.Generator().manual_seed(7)
    x, dy = (torch.randn(10, 128, generator=gen) for _ in range(2))
    xs = quantize_fp8(x, block=SEGMENTS, splits=[3, 0, 7])
    dys = quantize_fp8(dy, block=SEGMENTS, splits=[5, 0, 5])
    xs.row_offsets.copy_(torch.tensor([0, 5, 5, 10]))
    out = torch.full((3, 128, 128), float("nan"))
    with pytest.raises(ValueError, match=r"^x\.row_offsets was written in place since x was "
                       r"built or checked \(version 0, now 1\)"):  # fmt: skip
        grouped_wgrad(dys, xs, [5, 0, 5], out=out)
    assert out.isnan().all()  # nothing written
    checked = Fp8Blocks.from_tensors(xs.tensors(), block=SEGMENTS, dtype=x.dtype, shape=x.shape)
    grouped_wgrad(dys, checked, [5, 0, 5])  # hand-built: checked, then sealed with its version
    checked.row_offsets.add_(0)
    with pytest.raises(ValueError, match=r"^x\.row_offsets was written in place since x was"):
        grouped_wgrad(dys, checked, [5, 0, 5])


def test_rejected_calls_write_nothing(operands: dict[str, Fp8Blocks]) -> None:
    out = [torch.full((N, K), 7.0) for _ in range(E)]
    out[3] = torch.full((N, K + 1), 7.0)
    with pytest.raises(ValueError, match=r"^out\[3\] has shape \(256, 385\), expected"):
        grouped_wgrad(operands["dy_seg"], operands["x_seg"], SPLITS, out=out, accumulate=True)
    assert all(bool((o == 7).all()) for o in out)
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        grouped_wgrad(operands["dy_seg"], operands["x_seg"], SPLITS, accumulate=True)
    y = torch.full((T, N), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"splits sums to 489 but x has 488 rows"):
        grouped_fprop(operands["x"], operands["w"], [*SPLITS[:-1], 2], out=y)
    assert bool((y == 7).all())


# --------------------------------------------------------------------------- ops, compile


# opcheck's test_schema compares inputs with torch.allclose, which torch 2.13 lacks for
# float8 on the CPU; it is left out, and the test checks the inputs stay unchanged itself.
_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_custom_ops_pass_opcheck(operands: dict[str, Fp8Blocks]) -> None:
    x, w, dyr = operands["x"], operands["w"], operands["dy"]
    dy, xs = operands["dy_seg"], operands["x_seg"]
    splits = torch.tensor(SPLITS)
    calls = [
        (_fp8_gemm.fp8_fprop_op,
         (x.data, x.scales, w.data, w.data_t, w.scales, splits, torch.empty(T, N))),
        (_fp8_gemm.fp8_dgrad_op,
         (dyr.data, dyr.scales, w.data, w.data_t, w.scales, splits, torch.empty(T, K))),
        (_fp8_gemm.fp8_wgrad_op,
         (dy.data, dy.scales, dy.row_offsets, xs.data, xs.scales, xs.row_offsets, splits, T,
          list(torch.empty(E, N, K)), True)),
    ]  # fmt: skip
    for op, args in calls:
        inputs = [t for t in args[:-1] if isinstance(t, torch.Tensor)]
        before = [
            t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in inputs
        ]
        torch.library.opcheck(op, args, test_utils=_OPCHECK_UTILS)
        for t, b in zip(inputs, before, strict=True):
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, b)


def test_compile_fullgraph_traces_quantize_and_the_three_gemms() -> None:
    x, dy = _randn(T, K, seed=5), _randn(T, N, seed=6)
    w = _randn(E, N, K, seed=7)
    splits = torch.tensor(SPLITS)

    def step(x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor):
        x_rows, x_seg = quantize_fp8(x, block=(ROWS, SEGMENTS), splits=splits)
        dy_rows, dy_seg = quantize_fp8(dy, block=(ROWS, SEGMENTS), splits=splits)
        w8 = quantize_fp8(w, block=WEIGHTS)
        y = grouped_fprop(x_rows, w8, splits)
        dx = grouped_dgrad(dy_rows, w8, splits)
        grouped_wgrad(dy_seg, x_seg, splits, out=main_grad, accumulate=True)
        return y, dx

    eager_grad, compiled_grad = torch.ones(E, N, K), torch.ones(E, N, K)
    eager = step(x, dy, w, eager_grad)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, dy, w, compiled_grad)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(eager_grad, compiled_grad)
    assert eager_grad.dtype == torch.float32
    assert not torch.equal(eager_grad, torch.ones(E, N, K))


def test_one_block_of_channels() -> None:
    """K = N = 128: the (T, 1) scales of a (1, 128) form are row- and column-major at once."""
    splits = [130, 0, 50]
    x, dy = _randn(180, 128, seed=8), _randn(180, 128, seed=9)
    w = quantize_fp8(_randn(3, 128, 128, seed=10), block=WEIGHTS)
    x_rows, x_seg = quantize_fp8(x, block=(ROWS, SEGMENTS), splits=splits)
    dy_rows, dy_seg = quantize_fp8(dy, block=(ROWS, SEGMENTS), splits=splits)
    for op, a in (("fprop", x_rows), ("dgrad", dy_rows)):
        got = (grouped_fprop if op == "fprop" else grouped_dgrad)(a, w, splits)
        want = _expected_rows(op, a, w, splits)
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=2**-8 * want.abs().max())
    got_w = grouped_wgrad(dy_seg, x_seg, splits)
    want_w = _expected_wgrad(dy_seg, x_seg, splits)
    torch.testing.assert_close(got_w.double(), want_w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("ref", [False, True], ids=["kernel", "ref"])
def test_fp8_operands_autograd_would_record_are_refused(
    operands: dict[str, Fp8Blocks], ref: bool
) -> None:
    """An operand whose tensors autograd records (grad mode on): the GEMMs are not
    differentiable, so they refuse it instead of returning an output through which that
    tensor would silently get no gradient. The quantizers refuse such a tensor first."""
    fprop, wgrad = (grouped_fprop_ref, grouped_wgrad_ref) if ref else (grouped_fprop, grouped_wgrad)
    quantize = quantize_fp8_ref if ref else quantize_fp8
    x = _randn(T, K, seed=1).requires_grad_()
    with pytest.raises(ValueError, match=r"^t requires grad, but quantize_fp8 is not"):
        quantize(x, block=(ROWS, SEGMENTS), splits=SPLITS)
    with torch.no_grad():
        x_rows, x_segments = quantize(x, block=(ROWS, SEGMENTS), splits=SPLITS)
    x_rows.scales.requires_grad_()  # what a hand-built form of recorded tensors carries
    x_segments.scales.requires_grad_()
    y = torch.full((T, N), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^x requires grad, but grouped_fprop is not"):
        fprop(x_rows, operands["w"], SPLITS, out=y)
    out = torch.full((E, N, K), 7.0)
    with pytest.raises(ValueError, match=r"^x requires grad, but grouped_wgrad is not"):
        wgrad(operands["dy_seg"], x_segments, SPLITS, out=out, accumulate=True)
    assert bool((y == 7).all())  # nothing written
    assert bool((out == 7).all())
    with torch.no_grad():  # not recorded: the same operands run
        x_rows, _ = quantize_fp8(x, block=(ROWS, SEGMENTS), splits=SPLITS)
        fprop(x_rows, operands["w"], SPLITS, out=y)
    assert torch.equal(y, fprop(operands["x"], operands["w"], SPLITS))


def test_fake_forms_are_not_sealed() -> None:
    """A fake tensor has no address to remember (reading one warns, and will raise): forms of
    fake tensors stay unsealed, and the validator checks them in full on every call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FakeTensorMode():
            x8 = quantize_fp8(_randn(T, K, seed=1), block=ROWS)
            w8 = quantize_fp8(_randn(E, N, K, seed=3), block=WEIGHTS)
            y = grouped_fprop(x8, w8, SPLITS)
    assert x8._seal is None
    assert w8._seal is None
    assert tuple(y.shape) == (T, N)


def test_an_fp8_row_output_of_another_dtype_names_the_ones_it_takes(
    operands: dict[str, Fp8Blocks],
) -> None:
    y64 = torch.zeros(T, N, dtype=torch.float64)
    with pytest.raises(
        TypeError,
        match=r"^out has dtype torch\.float64, expected torch\.bfloat16, torch\.float16 or "
        r"torch\.float32 \(an FP8 fprop writes any of them; x was quantized from",
    ):
        grouped_fprop(operands["x"], operands["w"], SPLITS, out=y64)
    assert not y64.any()
