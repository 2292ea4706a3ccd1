"""The FP8 SwiGLU ops on the reference path: the chain they stand for, bit for bit; errors; ops.

The fused Triton kernels run against this reference on a GPU in
``test_gpu_swiglu_fp8.py``. Every expectation here is built from the public
quantizer (``quantize_fp8_ref``) and the bf16 SwiGLU reference, never from the
code under test.

Legend: ``T`` tokens, ``F`` ffn_hidden_size, ``E`` experts.
"""

from __future__ import annotations

import pytest
import torch

from groupgrad.kernels import (
    Fp8Blocks,
    _swiglu_fp8,
    quantize_fp8_ref,
    swiglu_probs_backward_fp8,
    swiglu_probs_backward_fp8_ref,
    swiglu_probs_backward_ref,
    swiglu_probs_fp8,
    swiglu_probs_fp8_ref,
    swiglu_probs_ref,
)
from groupgrad_testsupport.allocations import AllocationRecorder
from groupgrad_testsupport.calls import record_calls

ROWS, TOKENS = (1, 128), (128, 1)
SPLITS = [100, 0, 37, 163]  # an empty expert, segments not multiples of 16 or 128
T, F = sum(SPLITS), 256


def _randn(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def _h(seed: int = 1, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fc1's output with column blocks 1e4 apart, so a block-mixing kernel shows."""
    h = _randn(T, 2 * F, dtype=torch.float32, seed=seed)
    spread = torch.tensor([1e-2, 1e2, 1.0, 1e-1])[torch.arange(2 * F) // 128 % 4]
    return (h * spread).to(dtype)


def _probs(seed: int = 2) -> torch.Tensor:
    return torch.rand(T, generator=torch.Generator().manual_seed(seed))


def _same(got: Fp8Blocks | None, want: Fp8Blocks) -> None:
    assert got is not None
    assert got.block == want.block
    assert tuple(got.shape) == tuple(want.shape)
    assert got.dtype == want.dtype
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scales, want.scales)
    assert got.scales.stride() == want.scales.stride()
    assert torch.equal(got.dequantize(), want.dequantize())


def _unfused_forward(h: torch.Tensor, probs: torch.Tensor | None) -> tuple[Fp8Blocks, torch.Tensor]:
    """The chain the forward op stands for: h's (1, 128) form, and a from it dequantized."""
    h_rows = quantize_fp8_ref(h, block=ROWS)
    a = swiglu_probs_ref(h_rows.dequantize().to(h.dtype), probs)
    return h_rows, a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("op", [swiglu_probs_fp8, swiglu_probs_fp8_ref])
def test_forward_is_quantize_dequantize_swiglu_quantize(op, with_probs, dtype) -> None:
    h, probs = _h(dtype=dtype), _probs() if with_probs else None
    h_rows, a_rows = op(h, probs)
    want_h, a = _unfused_forward(h, probs)
    _same(h_rows, want_h)
    _same(a_rows, quantize_fp8_ref(a, block=ROWS))
    assert a_rows.dtype == dtype


@pytest.mark.parametrize("splits_form", ["list", "cpu tensor"])
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("op", [swiglu_probs_backward_fp8, swiglu_probs_backward_fp8_ref])
def test_backward_quantizes_dh_and_the_forwards_a(op, with_probs, splits_form) -> None:
    h, probs, da = _h(), _probs() if with_probs else None, _randn(T, F, seed=3)
    splits = SPLITS if splits_form == "list" else torch.tensor(SPLITS)
    h_rows, _a_rows = swiglu_probs_fp8(h, probs)
    dh_rows, dh_tokens, dprobs, a_tokens = op(da, h_rows, probs, splits=splits)

    dh, want_dprobs, a = swiglu_probs_backward_ref(da, h_rows.dequantize().to(h.dtype), probs)
    _, a_forward = _unfused_forward(h, probs)
    assert torch.equal(a, a_forward)  # backward recomputes the forward's a, bit for bit
    want_rows, want_tokens = quantize_fp8_ref(dh, block=(ROWS, TOKENS), splits=SPLITS)
    _same(dh_rows, want_rows)
    _same(dh_tokens, want_tokens)
    _same(a_tokens, quantize_fp8_ref(a_forward, block=TOKENS, splits=SPLITS))
    assert a_tokens is not None
    assert a_tokens.splits is splits
    if with_probs:
        assert dprobs is not None
        assert torch.equal(dprobs, want_dprobs)
    else:
        assert dprobs is None


@pytest.mark.parametrize(
    "asked", [(True, False, False), (False, True, False), (False, False, True), (False,) * 3]
)
def test_backward_writes_only_the_forms_asked(asked) -> None:
    h_rows, _ = swiglu_probs_fp8(_h(), None)
    dh_rows, dh_tokens, _, a_tokens = swiglu_probs_backward_fp8(
        _randn(T, F, seed=3), h_rows, None, splits=SPLITS,
        dh_rows=asked[0], dh_tokens=asked[1], a_tokens=asked[2],
    )  # fmt: skip
    assert [f is not None for f in (dh_rows, dh_tokens, a_tokens)] == list(asked)


def test_no_tokens_and_one_expert_with_all() -> None:
    empty = torch.zeros(0, 2 * F, dtype=torch.bfloat16)
    h_rows, a_rows = swiglu_probs_fp8(empty, torch.zeros(0))
    assert a_rows.shape == (0, F)
    assert a_rows.data.shape == (0, F)
    dh_rows, dh_tokens, dprobs, a_tokens = swiglu_probs_backward_fp8(
        torch.zeros(0, F, dtype=torch.bfloat16), h_rows, torch.zeros(0), splits=[0, 0]
    )
    assert dh_rows is not None
    assert dh_rows.shape == (0, 2 * F)
    assert dprobs is not None
    assert dprobs.shape == (0,)
    assert a_tokens is not None
    assert a_tokens.dequantize().shape == (0, F)
    h = _h()
    h_rows, _ = swiglu_probs_fp8(h, None)
    _, dh_tokens, _, _ = swiglu_probs_backward_fp8(_randn(T, F, seed=3), h_rows, splits=[T])
    assert dh_tokens is not None
    assert dh_tokens.dequantize().shape == (T, 2 * F)


def test_nan_in_h_stays_nan() -> None:
    h = _h()
    h[7, 3] = float("nan")
    h_rows, a_rows = swiglu_probs_fp8(h, None)
    assert h_rows.dequantize()[7, :128].isnan().all()
    assert a_rows.dequantize()[7, :128].isnan().all()
    assert not a_rows.dequantize()[8].isnan().any()


# ---------------------------------------------------------------- errors, nothing written


def test_forward_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"expected \(T, 2F\) with F a multiple of 128"):
        swiglu_probs_fp8(torch.zeros(4, 2 * 192, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"h has dtype torch\.float64"):
        swiglu_probs_fp8(torch.zeros(4, 2 * F, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"probs has shape \(3,\), expected \(T,\) = \(4,\)"):
        swiglu_probs_fp8(torch.zeros(4, 2 * F, dtype=torch.bfloat16), torch.zeros(3))


def test_backward_errors_name_the_argument() -> None:
    h_rows, a_rows = swiglu_probs_fp8(_h(), None)
    da = _randn(T, F, seed=3)
    with pytest.raises(
        TypeError, match=r"h is a Tensor, expected an Fp8Blocks of block \(1, 128\)"
    ):
        swiglu_probs_backward_fp8(da, _h(), splits=SPLITS)  # type: ignore[arg-type]
    tokens = quantize_fp8_ref(_h(), block=TOKENS, splits=SPLITS)
    with pytest.raises(ValueError, match=r"h is an Fp8Blocks of block \(128, 1\), expected"):
        swiglu_probs_backward_fp8(da, tokens, splits=SPLITS)
    row_major_scales = Fp8Blocks(
        h_rows.data, h_rows.scales.contiguous(), block=ROWS, dtype=h_rows.dtype, shape=h_rows.shape
    )
    with pytest.raises(ValueError, match=r"h\.scales is .*expected \(300, 4\) with strides"):
        swiglu_probs_backward_fp8(da, row_major_scales, splits=SPLITS)
    with pytest.raises(TypeError, match="dh_tokens is 1, expected True or False"):
        swiglu_probs_backward_fp8(da, h_rows, splits=SPLITS, dh_tokens=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"h has shape \(300, 256\).*expected \(T, 2F\)"):
        swiglu_probs_backward_fp8(da, a_rows, splits=SPLITS)
    with pytest.raises(ValueError, match=r"da has shape \(300, 200\), expected F a multiple"):
        swiglu_probs_backward_fp8(da[:, :200], h_rows, splits=SPLITS)
    with pytest.raises(ValueError, match=r"^da has shape \(256,\), expected \(T, F\)"):
        swiglu_probs_backward_fp8(da[0], h_rows, splits=SPLITS)
    with pytest.raises(TypeError, match=r"^da is torch\.int64, expected a floating-point"):
        swiglu_probs_backward_fp8(da.long(), h_rows, splits=SPLITS)
    with pytest.raises(ValueError, match="splits sums to 299 but da has 300 rows"):
        swiglu_probs_backward_fp8(da, h_rows, splits=[100, 0, 36, 163])
    with pytest.raises(ValueError, match=r"probs has shape \(2,\)"):
        swiglu_probs_backward_fp8(da, h_rows, torch.zeros(2), splits=SPLITS)


# ---------------------------------------------------------------- ops, compile


def test_opcheck_passes_for_both_custom_ops() -> None:
    h, probs = _h(), _probs()
    torch.library.opcheck(_swiglu_fp8.forward_op, (h, probs))
    torch.library.opcheck(_swiglu_fp8.forward_op, (h, None))
    h_rows, _ = swiglu_probs_fp8(h, probs)
    from groupgrad.kernels._fp8 import segment_offsets

    row, seg, block = segment_offsets(SPLITS, h.device)
    num_blocks, padded = -(-T // 128) + 4, -(-(T + 60) // 16) * 16
    for forms in [(True, True, True), (False, True, False)]:
        args = (
            _randn(T, F, seed=3), h_rows.data, h_rows.scales.t(), probs, row, seg, block,
            num_blocks, padded, *forms,
        )  # fmt: skip
        # test_schema cannot compare float8 outputs on the CPU (no allclose for Float8)
        torch.library.opcheck(
            _swiglu_fp8.backward_op,
            args,
            test_utils=("test_faketensor", "test_autograd_registration"),
        )


@pytest.mark.parametrize("splits_form", ["list", "tensor"])
def test_torch_compile_fullgraph_traces_both_ops(splits_form) -> None:
    torch._dynamo.reset()
    splits = SPLITS if splits_form == "list" else torch.tensor(SPLITS)

    def step(h, probs, da, splits):
        h_rows, a_rows = swiglu_probs_fp8(h, probs)
        dh_rows, dh_tokens, dprobs, a_tokens = swiglu_probs_backward_fp8(
            da, h_rows, probs, splits=splits
        )
        return (
            a_rows.dequantize(),
            dh_rows.dequantize(),
            dh_tokens.dequantize(),
            a_tokens.dequantize(),
            dprobs,
        )

    args = (_h(), _probs(), _randn(T, F, seed=3), splits)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args), step(*args), strict=True):
        assert torch.equal(got, want)


def test_plain_eager_calls_skip_the_op_machinery_and_traced_ones_do_not(monkeypatch) -> None:
    calls = record_calls(monkeypatch, _swiglu_fp8, ("forward_op", "backward_op"))
    h, probs, da = _h(), _probs(), _randn(T, F, seed=3)
    h_rows, a_rows = swiglu_probs_fp8(h, probs)
    got = swiglu_probs_backward_fp8(da, h_rows, probs, splits=torch.tensor(SPLITS))
    assert calls == []  # plain eager: the kernels ran directly
    want_h, want_a = swiglu_probs_fp8_ref(h, probs)
    _same(h_rows, want_h)
    _same(a_rows, want_a)
    want = swiglu_probs_backward_fp8_ref(da, want_h, probs, splits=SPLITS)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, Fp8Blocks):
            _same(g, w)
        else:
            assert torch.equal(g, w)
    recorded = probs.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"^probs requires grad, but swiglu_probs_fp8 is not"):
        swiglu_probs_fp8(h, recorded)  # autograd would record it: refused
    with AllocationRecorder(numel=1):  # a dispatch mode: the op
        swiglu_probs_fp8(h, probs)
    with torch.no_grad():
        swiglu_probs_fp8(h, recorded)  # grad mode off: directly again
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda da, h_rows: swiglu_probs_backward_fp8(da, h_rows, splits=SPLITS)[0].data,
        fullgraph=True,
        backend="aot_eager",
    )
    compiled(da, h_rows)  # traced: the op
    assert calls == ["forward_op", "backward_op"]


def test_the_one_kernel_backward_takes_aligned_16_bit_operands_only(monkeypatch) -> None:
    """``_backward_cuda`` hands the backward to the CUTLASS extension's one kernel only when it
    can read the operands (``da`` as the one-read quantizer takes an activation; ``h``'s data
    16-byte aligned) and the backend runs on its device; else Triton's kernels (here, with no
    Triton, the reference). Checked with the backend's answer stood in; on the GPU by
    test_gpu_swiglu_fp8.py."""
    from groupgrad.kernels import _cutlass

    monkeypatch.setattr(_cutlass, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(_swiglu_fp8, "_triton_for", lambda t: None)
    took: list[torch.dtype] = []

    def one_kernel(cutlass, da, *args):
        took.append(da.dtype)
        return _swiglu_fp8.backward_ref(da, *args)

    monkeypatch.setattr(_swiglu_fp8, "_backward_one_kernel", one_kernel)
    offsets = quantize_fp8_ref(_randn(T, 128), block=TOKENS, splits=SPLITS)
    E = len(SPLITS)
    tail = (offsets.row_offsets, offsets.seg_offsets, offsets.block_offsets)
    sizes = (-(-T // 128) + E, -(-(T + 15 * E) // 16) * 16, True, True, True)
    for dtype, aligned, takes in [
        (torch.bfloat16, True, True),
        (torch.float16, True, True),
        (torch.float32, True, False),
        (torch.bfloat16, False, False),
    ]:
        h = quantize_fp8_ref(_h(dtype=dtype), block=ROWS)
        data = h.data
        if not aligned:  # the same bytes, 8 bytes past a 16-byte boundary
            data = h.data.new_empty(h.data.numel() + 8)[8:].view_as(h.data).copy_(h.data)
        da = _randn(T, F, dtype=dtype, seed=5)
        took.clear()
        got = _swiglu_fp8._backward_cuda(da, data, h.scales.t(), _probs(), *tail, *sizes)
        assert took == ([dtype] if takes else []), (dtype, aligned)
        want = _swiglu_fp8.backward_ref(da, h.data, h.scales.t(), _probs(), *tail, *sizes)
        for g, w in zip(got, want, strict=True):
            fp8 = g.dtype == torch.float8_e4m3fn
            assert (
                torch.equal(g.view(torch.uint8), w.view(torch.uint8)) if fp8 else torch.equal(g, w)
            )
