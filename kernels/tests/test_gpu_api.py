"""The public grouped GEMMs on an H100/H200: CUTLASS through the custom ops.

Checks that the CUTLASS backend (not the reference fallback) runs each call,
against an fp64 truth with the reference path (``grouped_*_ref``, fp32 compute)
as PyTorch's own computation: CUTLASS may err at most twice as much plus a
small atol. Also ``torch.compile(fullgraph=True)``, ``torch.library.opcheck`` and
CUDA-graph capture with device splits.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import pytest
import torch

import groupgrad.kernels as gk
from groupgrad.kernels import _cutlass
from groupgrad_testsupport import assert_as_close_as_torch, poisoned

pytestmark = pytest.mark.gpu(capability=(9, 0))  # the CUTLASS kernels are built for sm_90a

E, K, N = 5, 256, 384
SPLITS = [0, 301, 1, 0, 129]  # empty first, middle and last-but-one; odd; one token
T = sum(SPLITS)


@pytest.fixture
def cutlass_calls(monkeypatch):
    """Counts calls that reach the CUTLASS backend (a fallback would not)."""
    calls: list[str] = []
    for op in ("fprop", "dgrad", "wgrad"):
        original = getattr(_cutlass, op)

        def spy(*args, _op=op, _original=original, **kwargs):
            calls.append(_op)
            return _original(*args, **kwargs)

        monkeypatch.setattr(_cutlass, op, spy)
    return calls


def _splits_as(kind: str):
    if kind == "list":
        return list(SPLITS)
    if kind == "cpu":
        return torch.tensor(SPLITS)
    if kind == "cuda_int32":
        return torch.tensor(SPLITS, dtype=torch.int32, device="cuda")
    if kind == "cuda_strided":  # every other entry of a longer tensor (not contiguous)
        return torch.tensor([c for count in SPLITS for c in (count, -7)], device="cuda")[::2]
    return torch.tensor(SPLITS, device="cuda")


def _weights_as(w_ENK: torch.Tensor, form: str):
    if form == "packed":
        return w_ENK
    return [w_ENK[e].clone() for e in range(w_ENK.shape[0])]  # separate allocations


def _rows(e: int) -> slice:
    start = sum(SPLITS[:e])
    return slice(start, start + SPLITS[e])


def _check(ours: torch.Tensor, truth: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """DESIGN's rule, with slack 1e-5 (fp32 outputs) or 2e-3 of the largest ``|truth|``, plus 1e-6."""
    rtol = 1e-5 if ours.dtype == torch.float32 else 2e-3
    assert_as_close_as_torch(ours, truth, ref, atol=1e-6, rtol=rtol, what=what)


@pytest.mark.parametrize("form", ["packed", "list"])
@pytest.mark.parametrize("splits_kind", ["list", "cpu", "cuda_int32", "cuda_int64", "cuda_strided"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fprop_dgrad(dtype, splits_kind: str, form: str, cutlass_calls) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, K, generator=gen).to(dtype).cuda()
    dy = torch.randn(T, N, generator=gen).to(dtype).cuda()
    w_ENK = torch.randn(E, N, K, generator=gen).to(dtype).cuda()
    weights = _weights_as(w_ENK, form)
    y = poisoned((T, N), dtype=dtype, device="cuda")
    assert gk.grouped_fprop(x, weights, _splits_as(splits_kind), out=y) is y
    dx = gk.grouped_dgrad(dy, weights, _splits_as(splits_kind))
    assert cutlass_calls == ["fprop", "dgrad"]
    y_ref = gk.grouped_fprop_ref(x, weights, SPLITS)
    dx_ref = gk.grouped_dgrad_ref(dy, weights, SPLITS)
    for e in range(E):
        r = _rows(e)
        _check(y[r], x[r].double() @ w_ENK[e].double().T, y_ref[r], f"fprop expert {e}")
        _check(dx[r], dy[r].double() @ w_ENK[e].double(), dx_ref[r], f"dgrad expert {e}")


@pytest.mark.parametrize(
    ("out_form", "accumulate"),
    [
        ("packed", False),
        ("packed", True),
        ("main_grads", False),
        ("main_grads", True),
        ("out_dtype", False),
    ],
)
@pytest.mark.parametrize("splits_kind", ["list", "cuda_int64", "cuda_strided"])
def test_wgrad_fp32(splits_kind: str, out_form: str, accumulate: bool, cutlass_calls) -> None:
    gen = torch.Generator().manual_seed(2)
    dy = torch.randn(T, N, generator=gen).to(torch.bfloat16).cuda()
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16).cuda()
    start = torch.randn(E, N, K, generator=gen).cuda()
    if out_form == "packed":
        out = start.clone() if accumulate else torch.full_like(start, float("nan"))
    elif out_form == "main_grads":  # each expert's own fp32 buffer, not adjacent in memory
        out = [
            start[e].clone() if accumulate else poisoned((N, K), device="cuda") for e in range(E)
        ]
    else:
        out = None
    kwargs = {"out_dtype": torch.float32} if out is None else {"out": out}
    result = gk.grouped_wgrad(dy, x, _splits_as(splits_kind), accumulate=accumulate, **kwargs)
    assert cutlass_calls == ["wgrad"]
    if out is not None:
        assert result is out
    ours = [result[e] for e in range(E)]
    ref_out = start.clone() if accumulate else torch.empty_like(start)
    gk.grouped_wgrad_ref(dy, x, SPLITS, out=ref_out, accumulate=accumulate)
    for e in range(E):
        r = _rows(e)
        truth = dy[r].double().T @ x[r].double()
        if accumulate:
            truth = truth + start[e].double()
        if SPLITS[e] == 0:
            expected = start[e] if accumulate else torch.zeros_like(start[e])
            assert torch.equal(ours[e], expected), f"empty expert {e}"
        else:
            _check(ours[e], truth, ref_out[e], f"wgrad expert {e}")


def test_wgrad_bf16_out_default_dtype(cutlass_calls) -> None:
    gen = torch.Generator().manual_seed(3)
    dy = torch.randn(T, N, generator=gen).to(torch.bfloat16).cuda()
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16).cuda()
    dw = gk.grouped_wgrad(dy, x, SPLITS)
    assert dw.dtype == torch.bfloat16
    assert cutlass_calls == ["wgrad"]
    ref = gk.grouped_wgrad_ref(dy, x, SPLITS)
    for e in range(E):
        r = _rows(e)
        _check(dw[e], dy[r].double().T @ x[r].double(), ref[e], f"wgrad expert {e}")


def test_torch_compile_fullgraph(cutlass_calls) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16).cuda()
    w_ENK = torch.randn(E, N, K, generator=gen).to(torch.bfloat16).cuda()
    splits = torch.tensor(SPLITS, device="cuda")

    def step(x, w_ENK, splits, main_grad):
        y = gk.grouped_fprop(x, w_ENK, splits)
        dx = gk.grouped_dgrad(y, w_ENK, splits)
        gk.grouped_wgrad(y, x, splits, out=main_grad, accumulate=True)
        return y, dx

    main_eager = torch.zeros(E, N, K, device="cuda")
    main_compiled = torch.zeros(E, N, K, device="cuda")
    y_e, dx_e = step(x, w_ENK, splits, main_eager)
    y_c, dx_c = torch.compile(step, fullgraph=True)(x, w_ENK, splits, main_compiled)
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    torch.testing.assert_close(dx_c, dx_e, rtol=0, atol=0)
    torch.testing.assert_close(main_compiled, main_eager, rtol=0, atol=0)
    assert "wgrad" in cutlass_calls


def test_opcheck_on_cuda() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16).cuda()
    dy = torch.randn(T, N, generator=gen).to(torch.bfloat16).cuda()
    w_ENK = torch.randn(E, N, K, generator=gen).to(torch.bfloat16).cuda()
    splits = torch.tensor(SPLITS, device="cuda")
    ops = torch.ops.groupgrad
    torch.library.opcheck(
        ops.grouped_fprop.default,
        (x, [w_ENK], splits, torch.empty(T, N, dtype=x.dtype, device="cuda")),
    )
    torch.library.opcheck(
        ops.grouped_dgrad.default,
        (dy, [w_ENK], splits, torch.empty(T, K, dtype=x.dtype, device="cuda")),
    )
    for accumulate in (False, True):
        out = torch.zeros(E, N, K, device="cuda")
        torch.library.opcheck(ops.grouped_wgrad.default, (dy, x, splits, [out], accumulate))


def test_cuda_graph_capture_public_wgrad(cutlass_calls) -> None:
    gen = torch.Generator().manual_seed(6)
    dy = torch.randn(T, N, generator=gen).to(torch.bfloat16).cuda()
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16).cuda()
    splits = torch.tensor(SPLITS, device="cuda")
    main_grads = [torch.zeros(N, K, device="cuda") for _ in range(E)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gk.grouped_wgrad(dy, x, splits, out=main_grads, accumulate=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gk.grouped_wgrad(dy, x, splits, out=main_grads, accumulate=True)
    new = [T, 0, 0, 0, 0]
    splits.copy_(torch.tensor(new))
    for g in main_grads:
        g.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    truth = 2 * (dy.double().T @ x.double())
    ref = 2 * (dy.float().T @ x.float())
    _check(main_grads[0], truth, ref, "replayed expert 0")
    for e in range(1, E):
        assert torch.equal(main_grads[e], torch.zeros_like(main_grads[e])), f"expert {e}"
