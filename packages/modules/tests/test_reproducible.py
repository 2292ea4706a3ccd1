"""No op whose CUDA kernel adds atomically runs in a grouped op's forward or backward.

CUDA's ``index_add_``, ``scatter_add_`` and their kind add in an order that
changes from run to run, so a gradient summed by one differs in its last bits
between two runs of the same step (DEVICE_RUNS 201 and 204 found bias
gradients that did). The GPU suite compares the bits of repeated backwards;
this checks, on any device, that the modules' own code around the grouped
kernels calls none of those ops. The kernels are custom ops, opaque to the
dispatch mode below; their CUDA implementations have no atomics (the GPU
tests compare their reruns bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from groupgrad.modules import GroupedLinear, GroupedMLP, routed_grouped_mlp

E, H, F = 4, 128, 128
SPLITS = [5, 0, 9, 2]
T = sum(SPLITS)

# aten ops whose CUDA kernels add with atomics (index_put_ with accumulate=True sorts first
# on CUDA and is deterministic; scatter_reduce is named with its reduction below: amax and
# amin are order-free, its sums and products are not)
ATOMIC = {
    "aten::index_add",
    "aten::index_add_",
    "aten::index_reduce",
    "aten::index_reduce_",
    "aten::scatter_add",
    "aten::scatter_add_",
    "aten::scatter_reduce(sum)",
    "aten::scatter_reduce(prod)",
    "aten::scatter_reduce(mean)",
    "aten::scatter_reduce_(sum)",
    "aten::scatter_reduce_(prod)",
    "aten::scatter_reduce_(mean)",
    "aten::put",
    "aten::put_",
    "aten::embedding_dense_backward",
    "aten::_embedding_bag_backward",
    "aten::_embedding_bag_dense_backward",
    "aten::histc",
}


class OpRecorder(TorchDispatchMode):
    """Records the name of every aten op dispatched (``scatter_reduce`` with its reduction)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("aten::scatter_reduce"):
            name += f"({kwargs.get('reduce', args[4] if len(args) > 4 else None)})"
        self.names.add(name)
        return func(*args, **kwargs)


def _atomic_ops(step: Callable[[], None]) -> set[str]:
    recorder = OpRecorder()
    with recorder:
        step()
    return recorder.names & ATOMIC


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

    assert _atomic_ops(step) == set()
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

    assert _atomic_ops(step) == set()
    assert all(t.grad is not None for t in leaves)


def test_the_recorder_sees_atomic_ops_and_tells_order_free_reductions_apart() -> None:
    index, ones = torch.tensor([0, 0, 2]), torch.ones(3, 2)

    def step() -> None:
        torch.zeros(3, 2).index_add_(0, index, ones)
        torch.zeros(3, 2).scatter_reduce_(0, index[:, None].expand(3, 2), ones, "amax")
        torch.zeros(3, 2).scatter_reduce(0, index[:, None].expand(3, 2), ones, "sum")

    assert _atomic_ops(step) == {"aten::index_add_", "aten::scatter_reduce(sum)"}
