"""Selective activation checkpointing (``create_selective_checkpoint_contexts``) over groupgrad layers.

Its policy may ask to save any op's output, groupgrad's GEMMs included (the
usual "save the matmuls, recompute the pointwise ops"). The GEMMs write into
an output and return nothing, so there is nothing of theirs to save: they are
among the ops checkpointing always runs (``SAC_IGNORED_OPS``), in the forward
and again in the recomputation, and every gradient equals the run without
checkpointing, bit for bit, with other dispatch modes stacked too. Runs the
kernels' reference on the CPU.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

from groupgrad.modules import GroupedLinear, GroupedMLP

E, H, F = 4, 128, 128
SPLITS = [70, 0, 37, 21]
T = sum(SPLITS)


def _save_groupgrad_and_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    """Save every groupgrad op's and matmul's output, recompute the rest."""
    if getattr(op, "namespace", None) == "groupgrad" or op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _model(kind: str, device: str) -> nn.ModuleList:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.ModuleList([GroupedLinear(E, H, H, bias=True, device=device) for _ in range(2)])
    dtype, fp8 = (torch.bfloat16, "blockwise") if kind == "fp8 mlp" else (torch.float32, None)
    options = {"dtype": dtype, "device": device, "fp8_recipe": fp8}
    layers = nn.ModuleList(
        [GroupedMLP(E, H, F, accumulate_into_main_grad=True, **options) for _ in range(2)]
    )
    for p in layers.parameters():
        p.main_grad = torch.zeros(p.shape, device=device)  # type: ignore[attr-defined]
        p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    return layers


def _region(layers: nn.ModuleList, probs: Tensor) -> Callable[[Tensor], Tensor]:
    def run(x: Tensor) -> Tensor:
        for layer in layers:
            extra = () if isinstance(layer, GroupedLinear) else (probs,)
            x = torch.nn.functional.gelu(layer(x, SPLITS, *extra))
        return x

    return run


def _gradients(
    kind: str, wrap: Callable[[Callable[[Tensor], Tensor], Tensor], Tensor], device: str = "cpu"
) -> dict:
    layers = _model(kind, device)
    dtype = torch.bfloat16 if kind == "fp8 mlp" else torch.float32
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_()
    probs = torch.rand(T, generator=gen).to(device).requires_grad_()
    wrap(_region(layers, probs), x).float().square().sum().backward()
    got = {"x": x.grad, "probs": probs.grad}
    for name, p in layers.named_parameters():
        got[name] = p.main_grad if hasattr(p, "main_grad") else p.grad
    return got


def _plain(region: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return region(x)


def _selective(region: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    contexts = functools.partial(create_selective_checkpoint_contexts, _save_groupgrad_and_matmuls)
    return checkpoint(region, x, use_reentrant=False, context_fn=contexts)  # type: ignore[no-any-return]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["linear", "mlp", "fp8 mlp"])
def test_a_policy_saving_the_gemms_gives_the_gradients_of_no_checkpoint(
    kind: str, device: str
) -> None:
    want = _gradients(kind, _plain, device)
    got = _gradients(kind, _selective, device)
    assert got.keys() == want.keys()
    for name, value in want.items():
        if value is None:  # probs of the linear layers: unused
            assert got[name] is None, name
            continue
        assert torch.isfinite(value).all(), name
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("kind", ["linear", "fp8 mlp"])
def test_a_policy_saving_the_gemms_under_another_dispatch_mode_too(kind: str) -> None:
    # Catches: the GEMMs passed to the checkpoint's modes only where no other mode is stacked
    # (a FLOP counter, a debug mode): there the replay of their empty return came back.
    want = _gradients(kind, _plain)
    with FlopCounterMode(display=False):
        got = _gradients(kind, _selective)
    for name, value in want.items():
        if value is not None:
            assert torch.equal(got[name], value), name
