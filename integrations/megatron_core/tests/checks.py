"""What the parent tests assert on the ranks' results (``mcore_worker.py``), in one place.

Every expectation comes from an independent computation: Megatron's own
``SequentialMLP`` layer run on the same weights and inputs (fp32), and the
same ``SequentialMLP`` layer run in fp64 (the truth for bf16 runs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

FP32_REL = 1e-5
"""fp32: largest |groupgrad - SequentialMLP| allowed, relative to the tensor's largest |value|."""

BF16_ATOL_REL = 2.0**-9
"""bf16 rule's small atol, relative to the fp64 tensor's largest |value| (half a bf16 ulp at it)."""


def named_tensors(result: dict[str, Any]) -> dict[str, Tensor]:
    """One layer run's tensors by name: ``out0``, ``out1``, ``dx0``, ``dx1``, ``main_grad:<param>``."""
    tensors = {f"out{i}": t for i, t in enumerate(result["out"])}
    tensors.update({f"dx{i}": t for i, t in enumerate(result["dx"])})
    tensors.update({f"main_grad:{k}": t for k, t in result["main_grad"].items()})
    return tensors


def relative_differences(result: dict[str, Any], against: str = "sequential") -> dict[str, float]:
    """``max |groupgrad - against| / max |against|`` of every tensor (same names required)."""
    ours, theirs = named_tensors(result["groupgrad"]), named_tensors(result[against])
    assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
    diffs = {}
    for name, expected in theirs.items():
        actual = ours[name]
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        assert torch.isfinite(actual).all(), f"{name} has non-finite values"
        scale = expected.double().abs().max().clamp_min(1e-30)
        diffs[name] = ((actual.double() - expected.double()).abs().max() / scale).item()
    return diffs


def assert_fp32_matches_sequential(result: dict[str, Any], where: str) -> dict[str, float]:
    """Outputs, input grads and every main_grad within :data:`FP32_REL` of SequentialMLP's."""
    diffs = relative_differences(result)
    for name, tensor in named_tensors(result["sequential"]).items():
        assert tensor.abs().max() > 0, (
            f"{where}: SequentialMLP's {name} is all zeros; the test could not fail"
        )
    bad = {k: v for k, v in diffs.items() if not v <= FP32_REL}
    assert not bad, f"{where}: groupgrad differs from SequentialMLP (relative to max): {bad}"
    return diffs


def bf16_error_ratios(result: dict[str, Any], where: str) -> dict[str, float]:
    """Per tensor: ``err(groupgrad) / (2·err(SequentialMLP) + atol)`` against fp64; must be ≤ 1.

    ``err`` is the largest absolute difference to the fp64 run; ``atol`` is
    :data:`BF16_ATOL_REL` times the fp64 tensor's largest |value|.
    """
    ours, theirs = named_tensors(result["groupgrad"]), named_tensors(result["sequential"])
    truth = named_tensors(result["fp64"])
    assert sorted(ours) == sorted(truth) == sorted(theirs)
    ratios = {}
    for name, exact in truth.items():
        exact = exact.double()
        assert torch.isfinite(ours[name]).all(), (
            f"{where}: groupgrad's {name} has non-finite values"
        )
        scale = exact.abs().max().item()
        assert scale > 0, f"{where}: the fp64 {name} is all zeros; the test could not fail"
        err_ours = (ours[name].double() - exact).abs().max().item()
        err_theirs = (theirs[name].double() - exact).abs().max().item()
        ratios[name] = err_ours / (2 * err_theirs + BF16_ATOL_REL * scale)
    return ratios


def assert_bf16_within_twice_sequential(result: dict[str, Any], where: str) -> dict[str, float]:
    """The bf16 rule: groupgrad's error against fp64 at most twice SequentialMLP's, plus a small atol."""
    ratios = bf16_error_ratios(result, where)
    bad = {k: v for k, v in ratios.items() if not v <= 1.0}
    assert not bad, (
        f"{where}: groupgrad's bf16 error exceeds 2x SequentialMLP's + atol (ratio > 1): {bad}"
    )
    return ratios
