"""PyTorch's ``DistributedDataParallel`` around the grouped layers (one gloo rank in-process).

DDP averages a gradient when autograd produces it, in backward. A delayed
weight gradient (``delay_wgrad_compute``) lands later, in ``backward_dw()``,
where DDP never sees it: each rank would keep its own gradient, silently.
So a delayed layer whose weights DDP averages is refused at forward.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from groupgrad.modules import GroupedLinear, GroupedMLP

E, K, N = 2, 8, 4
SPLITS = [3, 3]


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layer(kind: str, delay: bool) -> torch.nn.Module:
    if kind == "linear":
        return GroupedLinear(E, K, N, bias=True, delay_wgrad_compute=delay)
    return GroupedMLP(E, K, N, single_grouped_weight=True, delay_wgrad_compute=delay)


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_delayed_layer_whose_weights_ddp_averages_is_refused(kind: str, compiled: bool) -> None:
    # Catches: backward_dw() delivering each rank's own weight gradient under DDP, never
    # averaged (the ranks' weights drift apart without a word).
    model = DistributedDataParallel(_layer(kind, delay=True))
    step = torch.compile(model, backend="aot_eager") if compiled else model
    with pytest.raises(
        RuntimeError,
        match=r"has delay_wgrad_compute=True inside torch\.nn\.parallel\.DistributedDataParallel"
        r".*would never be averaged over the ranks \('(fc1\.)?weight0?'",
    ):
        step(torch.randn(sum(SPLITS), K), SPLITS)


@pytest.mark.usefixtures("one_rank")
def test_delayed_weights_ddp_ignores_and_undelayed_layers_run_under_ddp() -> None:
    torch.manual_seed(0)
    ignored = _layer("linear", delay=True)
    ignored._ddp_params_and_buffers_to_ignore = ["weight0", "weight1"]  # reduced by the user
    DistributedDataParallel(ignored)(torch.randn(6, K), SPLITS).sum().backward()
    ignored.backward_dw()
    assert ignored.weight0.grad is not None
    plain = _layer("mlp", delay=False)
    x = torch.randn(6, K)
    want = torch.autograd.grad(plain(x, SPLITS).square().sum(), list(plain.parameters()))
    DistributedDataParallel(plain)(x, SPLITS).square().sum().backward()
    for param, grad in zip(plain.parameters(), want, strict=True):
        torch.testing.assert_close(param.grad, grad)  # one rank: the average is its own
