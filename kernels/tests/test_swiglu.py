"""The SwiGLU × probs ops: reference vs PyTorch autograd, custom ops, fallback, Triton tiles.

The Triton kernels themselves run on a GPU, against the reference, in
``test_gpu_swiglu.py``; here the CUDA kernels of the ops are called on CPU
tensors with the Triton module faked or missing.

Legend: ``T`` tokens, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from torch.nn import functional as F

from groupgrad.kernels import (
    _swiglu,
    swiglu_probs,
    swiglu_probs_backward,
    swiglu_probs_backward_ref,
    swiglu_probs_ref,
)
from groupgrad.kernels._swiglu_tiles import block_f, tile
from groupgrad_testsupport.allocations import AllocationRecorder
from groupgrad_testsupport.calls import record_calls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(T: int, F_: int, dtype: torch.dtype, probs_dtype: torch.dtype | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = (2 * torch.randn(T, 2 * F_, generator=gen)).to(dtype)
    da = torch.randn(T, F_, generator=gen).to(dtype)
    probs = None if probs_dtype is None else torch.rand(T, generator=gen).to(probs_dtype)
    return h, da, probs


def _pytorch_swiglu(h: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    gate, up = h.chunk(2, dim=1)
    a = F.silu(gate) * up
    return a if probs is None else a * probs[:, None]


@pytest.mark.parametrize("with_probs", [False, True])
def test_reference_matches_pytorch_autograd_in_fp64(with_probs: bool) -> None:
    h, da, probs = _inputs(37, 24, torch.float64, torch.float64 if with_probs else None)
    h_leaf = h.clone().requires_grad_()
    p_leaf = None if probs is None else probs.clone().requires_grad_()
    a_torch = _pytorch_swiglu(h_leaf, p_leaf)
    wrt = [h_leaf] if p_leaf is None else [h_leaf, p_leaf]
    grads = torch.autograd.grad(a_torch, wrt, da)

    torch.testing.assert_close(swiglu_probs_ref(h, probs), a_torch.detach())
    dh, dprobs, a = swiglu_probs_backward_ref(da, h, probs)
    torch.testing.assert_close(dh, grads[0])
    torch.testing.assert_close(a, a_torch.detach())
    if with_probs:
        torch.testing.assert_close(dprobs, grads[1])
    else:
        assert dprobs is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16], ids=str)
def test_low_precision_is_fp32_math_rounded_once(dtype, probs_dtype) -> None:
    h, da, probs = _inputs(29, 40, dtype, probs_dtype, seed=1)
    h64, da64 = h.double(), da.double()
    p64 = None if probs is None else probs.double()
    dh64, dp64, a64 = swiglu_probs_backward_ref(da64, h64, p64)
    a = swiglu_probs_ref(h, probs)
    dh, dprobs, a_again = swiglu_probs_backward_ref(da, h, probs)
    assert a.dtype == dtype
    assert dh.dtype == dtype
    # one rounding of a (nearly) exact fp32 result: within one unit in the last place
    torch.testing.assert_close(a, a64.to(dtype))
    torch.testing.assert_close(dh, dh64.to(dtype))
    assert torch.equal(a_again, a), "backward's recomputed activation differs from forward's"
    if probs is not None:
        assert dprobs.dtype == probs.dtype
        torch.testing.assert_close(dprobs, dp64.to(probs.dtype))


@pytest.mark.parametrize("with_probs", [False, True])
def test_the_twins_agree_on_a_da_of_another_dtype_than_h(with_probs: bool) -> None:
    # Catches: the op rounding an fp32 da to h's bf16 first and its twin not (4 in 16 dh
    # elements and dprobs differing): a twin must give the op's results.
    h, _, probs = _inputs(29, 40, torch.bfloat16, torch.float32 if with_probs else None, seed=3)
    da = torch.randn(29, 40, generator=torch.Generator().manual_seed(4))  # fp32
    for got, want in zip(
        swiglu_probs_backward(da, h, probs), swiglu_probs_backward_ref(da, h, probs), strict=True
    ):
        assert (got is None and want is None) or torch.equal(got, want)


@pytest.mark.parametrize("with_probs", [False, True])
def test_custom_ops_pass_opcheck(with_probs: bool) -> None:
    h, da, probs = _inputs(11, 16, torch.bfloat16, torch.float32 if with_probs else None)
    torch.library.opcheck(_swiglu.swiglu_probs_op, (h, probs))
    torch.library.opcheck(_swiglu.swiglu_probs_backward_op, (da, h, probs))


def test_public_entry_points_run_the_ops_and_check_shapes() -> None:
    h, da, probs = _inputs(9, 12, torch.bfloat16, torch.float32)
    assert torch.equal(swiglu_probs(h, probs), swiglu_probs_ref(h, probs))
    for got, want in zip(
        swiglu_probs_backward(da, h, probs), swiglu_probs_backward_ref(da, h, probs), strict=True
    ):
        assert torch.equal(got, want)
    assert swiglu_probs_backward(da, h)[1] is None


TWINS = {
    "op": (swiglu_probs, swiglu_probs_backward),
    "ref": (swiglu_probs_ref, swiglu_probs_backward_ref),
}


@pytest.mark.parametrize("twin", ["op", "ref"])
def test_both_twins_check_shapes(twin: str) -> None:
    # Catches: the *_ref twins broadcasting a probs or da of the wrong shape over the tokens.
    forward, backward = TWINS[twin]
    h, da, probs = _inputs(9, 12, torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match=r"h has shape \(9, 23\), expected \(T, 2F\)"):
        forward(h[:, :23])
    for short in (probs[:1], torch.cat([probs, probs[:1]])):
        with pytest.raises(ValueError, match=r"probs has shape \(\d+,\), expected \(T,\) = \(9,\)"):
            forward(h, short)
        with pytest.raises(ValueError, match=r"probs has shape \(\d+,\), expected \(T,\) = \(9,\)"):
            backward(da, h, short)
    with pytest.raises(ValueError, match=r"da has shape \(1, 12\), expected \(T, F\) = \(9, 12\)"):
        backward(da[:1], h, probs)


BAD_DTYPES = [
    # Catches: an int64 h computed in fp32 and truncated back, fp64 (the *_ref twin's oracle
    # dtype) run through the public op, integer probs acting as float scales.
    ("h-int64", lambda h, da, p: (h.long(), da, p), TypeError, r"h has dtype torch\.int64, expected"),
    ("h-fp64", lambda h, da, p: (h.double(), da, p), TypeError, r"h has dtype torch\.float64, expected"),
    ("probs-int", lambda h, da, p: (h, da, (p * 4).long()), TypeError,
     r"probs has dtype torch\.int64, expected a floating-point tensor"),
    ("da-int", lambda h, da, p: (h, da.long(), p), TypeError,
     r"da has dtype torch\.int64, expected a floating-point tensor"),
    ("probs-meta", lambda h, da, p: (h, da, p.to("meta")), ValueError,
     r"probs is on meta, expected h's device cpu"),
    # Catches: a sparse operand reaching torch's internals unnamed; an input autograd records
    # given an output the op cannot differentiate (its twin could: the two differed).
    ("h-sparse", lambda h, da, p: (h.to_sparse(), da, p), TypeError,
     r"^h is a torch\.sparse_coo tensor, expected a dense"),
    ("probs-sparse", lambda h, da, p: (h, da, p.to_sparse()), TypeError,
     r"^probs is a torch\.sparse_coo tensor, expected a dense"),
    ("da-sparse", lambda h, da, p: (h, da.to_sparse(), p), TypeError,
     r"^da is a torch\.sparse_coo tensor, expected a dense"),
    ("h-requires-grad", lambda h, da, p: (h.requires_grad_(), da, p), ValueError,
     r"^h requires grad, but swiglu_probs(_backward)? is not differentiable"),
    ("probs-requires-grad", lambda h, da, p: (h, da, p.requires_grad_()), ValueError,
     r"^probs requires grad, but swiglu_probs(_backward)? is not differentiable"),
    ("da-requires-grad", lambda h, da, p: (h, da.requires_grad_(), p), ValueError,
     r"^da requires grad, but swiglu_probs_backward is not differentiable"),
]  # fmt: skip


@pytest.mark.parametrize("twin", ["op", "ref"])
@pytest.mark.parametrize(
    ("name", "change", "error", "match"), BAD_DTYPES, ids=[c[0] for c in BAD_DTYPES]
)
def test_both_twins_check_dtypes_and_devices(twin, name, change, error, match) -> None:
    h, da, probs = change(*_inputs(9, 12, torch.bfloat16, torch.float32))
    forward, backward = TWINS[twin]
    if twin == "ref" and name == "h-fp64":  # the oracle dtype: accepted, fp64 math
        want = F.silu(h[:, :12]) * h[:, 12:] * probs.double()[:, None]
        assert torch.allclose(forward(h, probs), want, rtol=1e-12, atol=0)
        return
    is_forward = not name.startswith("da")
    with pytest.raises(error, match=match):
        forward(h, probs) if is_forward else backward(da, h, probs)
    if is_forward:
        with pytest.raises(error, match=match):
            backward(da.to(torch.float32), h, probs)


def test_plain_eager_calls_skip_the_op_machinery_and_traced_ones_do_not(monkeypatch) -> None:
    calls = record_calls(monkeypatch, _swiglu, ("swiglu_probs_op", "swiglu_probs_backward_op"))
    h, da, probs = _inputs(9, 12, torch.bfloat16, torch.float32)
    assert torch.equal(swiglu_probs(h, probs), swiglu_probs_ref(h, probs))
    swiglu_probs_backward(da, h, probs)
    assert calls == []  # plain eager: the kernels ran directly
    recorded = h.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"^h requires grad, but swiglu_probs is not"):
        swiglu_probs(recorded, probs)  # autograd would record it: refused, not differentiable
    with AllocationRecorder(numel=1):  # a dispatch mode: through the op
        swiglu_probs(h, probs)
    with torch.no_grad():
        swiglu_probs_backward(da, recorded, probs)  # grad mode off: directly again
    assert calls == ["swiglu_probs_op"]


def test_cuda_kernel_falls_back_to_the_reference_and_says_so_once(monkeypatch, caplog) -> None:
    # The CUDA kernels of the ops, called directly on CPU tensors with triton "missing".
    monkeypatch.setattr(_swiglu, "load_triton_kernels", lambda: (None, "triton is missing"))
    _swiglu._say_once.cache_clear()
    h, da, probs = _inputs(5, 8, torch.bfloat16, torch.float32)
    with caplog.at_level(logging.WARNING, logger="groupgrad.kernels._swiglu"):
        a = _swiglu._swiglu_probs_cuda(h, probs)
        dh, dprobs, _ = _swiglu._swiglu_probs_backward_cuda(da, h, None)
    assert torch.equal(a, swiglu_probs_ref(h, probs))
    assert torch.equal(dh, swiglu_probs_backward_ref(da, h)[0])
    assert dprobs.shape == (0,)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["SwiGLU runs on the PyTorch reference on CUDA: triton is missing"]


def test_cuda_kernel_runs_the_triton_kernels_when_they_load(monkeypatch) -> None:
    calls: list[str] = []
    fake = types.SimpleNamespace(
        swiglu_probs_triton=lambda h, p: calls.append("fwd") or swiglu_probs_ref(h, p),
        swiglu_probs_backward_triton=lambda da, h, p: (
            calls.append("bwd") or swiglu_probs_backward_ref(da, h, p)
        ),
    )
    monkeypatch.setattr(_swiglu, "load_triton_kernels", lambda: (fake, None))
    h, da, probs = _inputs(5, 8, torch.bfloat16, torch.float32)
    _swiglu._swiglu_probs_cuda(h, probs)
    _swiglu._swiglu_probs_backward_cuda(da, h, probs)
    assert calls == ["fwd", "bwd"]


# ---------------------------------------------------------------- Triton tiles


def test_triton_column_blocks_tile_the_ffn_width_exactly() -> None:
    assert block_f(768) == 256  # not 512: a half-masked last block
    assert block_f(14336) == 512
    assert block_f(2048) == 512
    assert block_f(96) == 128  # no power-of-two divisor >= 64: cover F
    assert block_f(40) == 64
    assert block_f(5000) == 512
    assert block_f(1) == 1
    assert block_f(0) == 1


@pytest.mark.parametrize("F_", [1, 5, 8, 40, 96, 768, 1000, 1030, 14336])
def test_triton_tiles_hold_2048_elements_and_cover_a_row(F_: int) -> None:
    block_t, block_f_ = tile(F_)
    assert block_t * block_f_ == 2048
    assert block_f_ & (block_f_ - 1) == 0  # a power of two (tl.arange needs one)
    # whole blocks tile F exactly, or one block covers F, or F takes 512-wide blocks
    assert F_ % block_f_ == 0 or block_f_ >= min(F_, 512)


def test_cpu_calls_never_load_the_triton_kernels(monkeypatch) -> None:
    def forbidden():
        raise AssertionError("the Triton kernels were loaded for a CPU call")

    monkeypatch.setattr(_swiglu, "load_triton_kernels", forbidden)
    h, da, probs = _inputs(5, 8, torch.bfloat16, torch.float32)
    swiglu_probs(h, probs)  # plain eager: the CPU kernel directly
    swiglu_probs_backward(da, h, probs)
    with AllocationRecorder(numel=1):  # a dispatch mode: through the op's CPU kernel
        swiglu_probs(h, probs)
        swiglu_probs_backward(da, h, probs)
