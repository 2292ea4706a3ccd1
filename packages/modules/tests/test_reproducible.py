"""No op whose CUDA kernel adds atomically runs in a grouped op's forward or backward.

CUDA's ``index_add_``, ``scatter_add_`` and their kind add in an order that
changes from run to run, so a gradient summed by one differs in its last bits
between two runs of the same step (DEVICE_RUNS 201 and 204 found bias
gradients that did). The GPU suite compares the bits of repeated backwards;
this checks, on any device, that the modules' own code around the grouped
kernels calls none of those ops (``groupgrad_testsupport.atomic_ops``). The
kernels are custom ops, opaque to it; their CUDA implementations have no
atomics (the GPU tests compare their reruns bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from groupgrad.modules import GroupedLinear, GroupedMLP, routed_grouped_mlp
from groupgrad_testsupport import atomic_ops

E, H, F = 4, 128, 128
SPLITS = [5, 0, 9, 2]
T = sum(SPLITS)


def _layer(kind: str, dtype: torch.dtype, packed: bool, delay: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    options = {
        "bias": True,
        "dtype": dtype,
        "single_grouped_weight": packed,
        "delay_wgrad_compute": delay,
    }
    if kind == "linear":
        return GroupedLinear(E, H, H, **options)
    fp8 = "blockwise" if kind == "fp8 mlp" else None
    return GroupedMLP(E, H, F, fp8_recipe=fp8, **options)


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("linear", torch.float32),
        ("linear", torch.float16),
        ("linear", torch.bfloat16),
        ("mlp", torch.float32),
        ("mlp", torch.bfloat16),
        ("fp8 mlp", torch.bfloat16),
    ],
)
def test_no_atomic_op_in_a_layers_step(kind: str, dtype: torch.dtype, packed: bool, delay: bool):
    # Catches: a bias gradient (of any dy dtype) summed by index_add_ again.
    layer = _layer(kind, dtype, packed, delay)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(T, generator=gen).requires_grad_()
    extra = () if kind == "linear" else (probs,)

    def step() -> None:
        layer(x, SPLITS, *extra).float().square().sum().backward()
        layer.backward_dw()

    assert atomic_ops(step) == set()
    assert all(p.grad is not None for p in layer.parameters())  # the whole backward ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_atomic_op_in_the_routed_op(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    k = 2
    ids = torch.randint(0, E, (T, k), generator=gen)
    sorted_ids, slots = torch.sort(ids.reshape(-1), stable=True)
    splits = torch.bincount(sorted_ids, minlength=E)
    weights = torch.rand(T, k, generator=gen).softmax(-1).requires_grad_()
    x = torch.randn(T, H, generator=gen).to(dtype).requires_grad_()
    w1 = (torch.randn(E, 2 * F, H, generator=gen) / H**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, H, F, generator=gen) / F**0.5).to(dtype).requires_grad_()
    leaves: list[Tensor] = [x, weights, w1, w2]

    def step() -> None:
        out = routed_grouped_mlp(x, w1, w2, slots, splits, weights)
        out.float().square().sum().backward()

    assert atomic_ops(step) == set()
    assert all(t.grad is not None for t in leaves)
