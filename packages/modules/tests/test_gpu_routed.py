"""routed_grouped_mlp on a CUDA device: the CUTLASS path, its results and its peak memory.

Run on the H200 with ``nox -s tests-gpu`` or
``pytest -m gpu packages/modules/tests/test_gpu_routed.py``.

Legend: ``T`` tokens, ``k`` choices per token, ``S = T·k`` slots, ``E``
experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import Tensor

from groupgrad.modules import grouped_mlp, routed_grouped_mlp
from groupgrad_testsupport import cuda_peak_growth

pytestmark = pytest.mark.gpu

E, H, F, K = 8, 1024, 512, 4


def _case(tokens: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(x, w1, w2, slots, splits, weights)`` on the GPU, bf16, skewed routing."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g) + torch.linspace(0, 2, E)
    top, ids = logits.topk(K, dim=-1)
    sorted_ids, slots = torch.sort(ids.reshape(-1), stable=True)
    splits = torch.bincount(sorted_ids, minlength=E)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * F, H, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, generator=g) / F**0.5).to(torch.bfloat16)
    cuda = [t.cuda() for t in (x, w1, w2, slots, splits, top.softmax(-1))]
    return cuda[0], cuda[1], cuda[2], cuda[3], cuda[4], cuda[5]


def _unrouted(x: Tensor, w1: Tensor, w2: Tensor, slots: Tensor, splits: Tensor, w: Tensor):
    tokens, k = w.shape
    y = grouped_mlp(x[slots // k], w1, w2, splits, w.reshape(-1)[slots])
    unsorted = torch.empty_like(y).index_copy(0, slots, y)
    return unsorted.view(tokens, k, -1).sum(dim=1, dtype=torch.float32).to(y.dtype)


def _step(fn, x: Tensor, w1: Tensor, w2: Tensor, slots, splits, w: Tensor, dy: Tensor):
    for t in (x, w1, w2, w):
        t.grad = None
    out = fn(x, w1, w2, slots, splits, w)
    out.backward(dy)
    return out


def test_cutlass_results_match_the_unrouted_chain(caplog: pytest.LogCaptureFixture) -> None:
    x, w1, w2, slots, splits, w = _case(1536)
    leaves = [t.requires_grad_() for t in (x, w1, w2, w)]
    for p in (w1, w2):
        p.grad_dtype = torch.float32
    dy = torch.randn_like(x)
    with caplog.at_level(logging.WARNING, logger="groupgrad"):
        ours = _step(routed_grouped_mlp, x, w1, w2, slots, splits, w, dy)
        ours_grads = [t.grad.clone() for t in leaves]
        theirs = _step(_unrouted, x, w1, w2, slots, splits, w, dy)
        theirs_grads = [t.grad.clone() for t in leaves]
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no reference fallback
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
    for name, a, b in zip(("x", "w1", "w2", "weights"), ours_grads, theirs_grads, strict=True):
        assert a.dtype == b.dtype, name
        assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm(), name
    assert ours_grads[1].dtype == torch.float32


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_peak_memory_below_the_unrouted_chain(grad_dtype: torch.dtype) -> None:
    """The routed op's peak is below the chain's by at least one gathered ``(S, H)`` copy."""
    tokens = 4096
    x, w1, w2, slots, splits, w = _case(tokens)
    for t in (x, w1, w2, w):
        t.requires_grad_()
    for p in (w1, w2):
        p.grad_dtype = grad_dtype
    dy = torch.randn_like(x)
    peaks = {}
    for name, fn in (("routed", routed_grouped_mlp), ("unrouted", _unrouted)):
        _step(fn, x, w1, w2, slots, splits, w, dy)  # warm-up: lazy buffers settle

        def run(fn=fn) -> None:
            _step(fn, x, w1, w2, slots, splits, w, dy)
            for t in (x, w1, w2, w):
                t.grad = None

        peaks[name] = cuda_peak_growth(run)
    slot_rows = tokens * K * H * 2  # one (S, H) bf16 tensor
    assert peaks["routed"] <= peaks["unrouted"] - slot_rows, peaks


def test_second_backward_is_refused_on_the_gpu() -> None:
    x, w1, w2, slots, splits, w = _case(256)
    w1.requires_grad_()
    out = routed_grouped_mlp(x, w1, w2, slots, splits, w)
    out.float().sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time over one forward"):
        out.float().sum().backward()
