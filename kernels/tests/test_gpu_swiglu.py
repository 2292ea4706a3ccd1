"""The fused Triton SwiGLU × probs kernels on a CUDA device, against the reference.

Run with ``nox -s tests-gpu`` or ``pytest -m gpu kernels/tests/test_gpu_swiglu.py``.

Legend: ``T`` tokens, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import pytest
import torch

from groupgrad.kernels import swiglu_probs, swiglu_probs_backward
from groupgrad.kernels._swiglu import (
    load_triton_kernels,
    swiglu_probs_backward_ref,
    swiglu_probs_ref,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_triton_kernels_load_on_this_machine() -> None:
    kernels, reason = load_triton_kernels()
    assert kernels is not None, f"the GPU path would fall back to the reference: {reason}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("T", "F_"), [(1, 8), (4093, 768), (517, 14336), (64, 1000)])
def test_triton_kernels_match_the_reference_on_cuda(dtype, probs_dtype, T, F_) -> None:
    kernels, reason = load_triton_kernels()
    assert kernels is not None, reason
    gen = torch.Generator(device="cuda").manual_seed(T + F_)
    h = (2 * torch.randn(T, 2 * F_, device="cuda", generator=gen)).to(dtype)
    da = torch.randn(T, F_, device="cuda", generator=gen).to(dtype)
    probs = None
    if probs_dtype is not None:
        probs = torch.rand(T, device="cuda", generator=gen).to(probs_dtype)
    a = kernels.swiglu_probs_triton(h, probs)
    dh, dprobs, a_again = kernels.swiglu_probs_backward_triton(da, h, probs)
    ref_dh, ref_dprobs, ref_a = swiglu_probs_backward_ref(da, h, probs)
    assert torch.equal(ref_a, swiglu_probs_ref(h, probs))
    ulp = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}
    torch.testing.assert_close(a, ref_a, rtol=ulp[dtype], atol=1e-5)
    torch.testing.assert_close(dh, ref_dh, rtol=ulp[dtype], atol=1e-5)
    assert torch.equal(a_again, a), "backward's recomputed activation differs from forward's"
    if probs is not None:
        assert dprobs.dtype == probs.dtype
        torch.testing.assert_close(dprobs, ref_dprobs, rtol=ulp[probs.dtype] + 1e-5, atol=1e-4)


def test_public_entry_points_run_the_triton_kernels_on_cuda() -> None:
    kernels, reason = load_triton_kernels()
    assert kernels is not None, reason
    gen = torch.Generator(device="cuda").manual_seed(7)
    h = torch.randn(300, 2 * 768, device="cuda", generator=gen).to(torch.bfloat16)
    da = torch.randn(300, 768, device="cuda", generator=gen).to(torch.bfloat16)
    probs = torch.rand(300, device="cuda", generator=gen)
    assert torch.equal(swiglu_probs(h, probs), kernels.swiglu_probs_triton(h, probs))
    got = swiglu_probs_backward(da, h, probs)
    want = kernels.swiglu_probs_backward_triton(da, h, probs)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
