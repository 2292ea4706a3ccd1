"""The SwiGLU × probs step: reference vs PyTorch autograd, custom ops, and the Triton kernels.

The Triton kernels run on the CPU under the Triton interpreter
(``TRITON_INTERPRET=1``, which must be set before the kernels are defined, so
they run in a subprocess); those tests skip, with a reason, where triton is
not installed. On a GPU, ``test_gpu_mlp.py`` runs them compiled.

Legend: ``T`` tokens, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from groupgrad.modules import _swiglu
from groupgrad.modules._swiglu import (
    swiglu_probs,
    swiglu_probs_backward,
    swiglu_probs_backward_ref,
    swiglu_probs_ref,
)

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
    with pytest.raises(ValueError, match=r"h has shape \(9, 23\), expected \(T, 2F\)"):
        swiglu_probs(h[:, :23])
    with pytest.raises(ValueError, match=r"probs has shape \(8,\), expected \(T,\) = \(9,\)"):
        swiglu_probs(h, probs[:8])
    with pytest.raises(ValueError, match=r"da has shape \(9, 11\), expected \(T, F\) = \(9, 12\)"):
        swiglu_probs_backward(da[:, :11], h, probs)


def test_plain_eager_calls_skip_the_op_machinery_and_traced_ones_do_not(monkeypatch) -> None:
    calls: list[str] = []

    def recording(name: str, real):
        def op(*args):
            calls.append(name)
            return real(*args)

        return op

    monkeypatch.setattr(_swiglu, "swiglu_probs_op", recording("fwd", _swiglu.swiglu_probs_op))
    monkeypatch.setattr(
        _swiglu,
        "swiglu_probs_backward_op",
        recording("bwd", _swiglu.swiglu_probs_backward_op),
    )
    h, da, probs = _inputs(9, 12, torch.bfloat16, torch.float32)
    assert torch.equal(swiglu_probs(h, probs), swiglu_probs_ref(h, probs))
    swiglu_probs_backward(da, h, probs)
    assert calls == []  # plain eager: the kernels ran directly
    swiglu_probs(h.requires_grad_(), probs)  # autograd would record it: through the op
    with torch.no_grad():
        swiglu_probs_backward(da, h, probs)  # grad mode off: directly again
    assert calls == ["fwd"]


def test_cuda_kernel_falls_back_to_the_reference_and_says_so_once(monkeypatch, caplog) -> None:
    # The CUDA kernels of the ops, called directly on CPU tensors with triton "missing".
    monkeypatch.setattr(_swiglu, "load_triton_kernels", lambda: (None, "triton is missing"))
    _swiglu._say_once.cache_clear()
    h, da, probs = _inputs(5, 8, torch.bfloat16, torch.float32)
    with caplog.at_level(logging.WARNING, logger="groupgrad.modules._swiglu"):
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


# ---------------------------------------------------------------- Triton, interpreted

_TRITON_MISSING = importlib.util.find_spec("triton") is None

# Runs in a fresh interpreter: loads the inputs, runs the Triton kernels, saves the outputs.
_PAYLOAD = """
import sys, torch
from groupgrad.modules import _swiglu_triton as kernels
cases = torch.load(sys.argv[1])
results = []
for h, da, probs in cases:
    a = kernels.swiglu_probs_triton(h, probs)
    dh, dprobs, a_again = kernels.swiglu_probs_backward_triton(da, h, probs)
    results.append((a, dh, dprobs, a_again))
torch.save(results, sys.argv[2])
"""


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """One unit in the last place of ``dtype`` (Triton's fp32 math rounds differently)."""
    return {
        "rtol": {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype],
        "atol": 1e-5,
    }


SHAPES = [(7, 5), (19, 1030), (1, 1), (0, 8), (3, 0)]  # F = 1030: several chunks + a masked tail


@pytest.mark.skipif(_TRITON_MISSING, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernels_match_the_reference_under_the_interpreter(dtype, tmp_path: Path) -> None:
    cases = []
    for index, (T, F_) in enumerate(SHAPES):
        for probs_dtype in (None, torch.float32, torch.bfloat16):
            cases.append(_inputs(T, F_, dtype, probs_dtype, seed=index))
    torch.save(cases, tmp_path / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PAYLOAD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = torch.load(tmp_path / "out.pt")
    assert len(results) == len(cases)
    for (h, da, probs), (a, dh, dprobs, a_again) in zip(cases, results, strict=True):
        label = f"T={h.shape[0]} F={h.shape[1] // 2} probs={None if probs is None else probs.dtype}"
        ref_dh, ref_dprobs, _ = swiglu_probs_backward_ref(da, h, probs)
        tol = _tolerance(dtype)
        assert a.dtype == dh.dtype == dtype
        torch.testing.assert_close(a, swiglu_probs_ref(h, probs), **tol, msg=f"a, {label}")
        torch.testing.assert_close(dh, ref_dh, **tol, msg=f"dh, {label}")
        assert torch.equal(a_again, a), f"recomputed a differs from forward's, {label}"
        if probs is None:
            assert dprobs is None
        else:
            assert dprobs.dtype == probs.dtype
            torch.testing.assert_close(dprobs, ref_dprobs, **_tolerance(probs.dtype), msg=label)


def test_triton_column_blocks_tile_the_ffn_width_exactly() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    from groupgrad.modules._swiglu_triton import _block_f

    assert _block_f(768) == 256  # not 512: a half-masked last block
    assert _block_f(14336) == 512
    assert _block_f(2048) == 512
    assert _block_f(96) == 128  # no power-of-two divisor >= 64: cover F
    assert _block_f(40) == 64
    assert _block_f(5000) == 512
