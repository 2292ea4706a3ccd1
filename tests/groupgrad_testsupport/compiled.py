"""What the ``torch.compile`` suites measure: how many fp32 gradient values are bf16 in disguise.

DESIGN ("Compile"): every route that delivers fp32 wgrads in eager delivers
them under ``torch.compile`` too. A gradient that was computed in bf16 and
only stored in fp32 has every value exactly representable in bf16; one
straight from the GEMM's fp32 epilogue has almost none. The suites compare
that share between a compiled run and its eager twin.
"""

from __future__ import annotations

import torch
from torch import Tensor

SHARE_SLACK = 0.005
"""How far the compiled share may exceed eager's: 0.5 percentage points."""


def bf16_exact_share(t: Tensor) -> float:
    """The share of the nonzero elements of ``t`` that are exactly representable in bf16.

    Raises:
        ValueError: ``t`` is not fp32, or has no nonzero element (nothing to measure).
    """
    if t.dtype != torch.float32:
        raise ValueError(f"expected an fp32 gradient, got {t.dtype}")
    nonzero = t.detach()[t.detach() != 0]
    if nonzero.numel() == 0:
        raise ValueError("the gradient is all zeros; there is nothing to measure")
    return float((nonzero.to(torch.bfloat16).float() == nonzero).double().mean())


def assert_keeps_fp32(compiled: Tensor, eager: Tensor, what: str) -> None:
    """``compiled`` is fp32 and no more bf16-exact than ``eager`` plus a slack.

    The slack is :data:`SHARE_SLACK`, or 4 elements' worth for a gradient of
    fewer than 800 nonzero elements (a bias: a few of its sums land on a bf16
    value by chance, and compiled activations round a little differently).
    A gradient computed in bf16 is 100 % bf16-exact, far past either. Where
    eager's gradient is all zeros (an expert without tokens) the compiled one
    must be too.
    """
    assert compiled.dtype == torch.float32, f"{what}: compiled gradient is {compiled.dtype}"
    if not eager.any():  # an expert without tokens: a zero wgrad, nothing to measure
        assert not compiled.any(), f"{what}: eager's gradient is zero, the compiled one is not"
        return
    got, want = bf16_exact_share(compiled), bf16_exact_share(eager)
    slack = max(SHARE_SLACK, 4 / int((compiled != 0).sum()))
    assert got <= want + slack, (
        f"{what}: {got:.1%} of the compiled fp32 gradient is bf16-exact against eager's "
        f"{want:.1%} (rounded to bf16 on the way?)"
    )


def compiled_graphs() -> int:
    """How many graphs Dynamo has compiled in this process so far (take differences)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
