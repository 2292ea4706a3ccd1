"""The kernel variants' names and generated sources, and the plans that name them (CPU only)."""

from __future__ import annotations

import itertools

import pytest
import torch

from groupgrad.kernels import tuning

_DTYPES = {
    "fprop": [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
    "dgrad": [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
    "wgrad": [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float16, torch.float32),
    ],
}


@pytest.mark.parametrize("op", sorted(_DTYPES))
def test_every_plan_names_a_default_variant(op: str) -> None:
    compiled = {v.name for v in tuning.VARIANTS}
    for (din, dout), (T, E), (N, K) in itertools.product(
        _DTYPES[op], [(32768, 8), (32768, 128), (100, 3)], [(4096, 1024), (1024, 4096)]
    ):
        plan = tuning.plan_for(op, din, dout, T, E, N, K)
        assert plan.variant in compiled, (op, din, dout, T, E, N, K)


def test_an_explicit_epilogue_subtile_reaches_the_template_and_the_name() -> None:
    auto = tuning.Variant("wgrad", "bf16", "f32", "pong", (128, 128, 64), (1, 2))
    wide = tuning.Variant("wgrad", "bf16", "f32", "pong", (128, 128, 64), (1, 2), epilogue_n=64)
    assert auto.name == "wgrad_bf16_f32_pong_128x128x64_c1x2"  # the default set's names stay
    assert wide.name == "wgrad_bf16_f32_pong_128x128x64_c1x2_e64"
    assert "128, 128, 64, 1, 2, 0>" in auto.translation_unit()  # 0: CUTLASS chooses
    assert "128, 128, 64, 1, 2, 64>" in wide.translation_unit()
    assert wide.name in wide.translation_unit()


def test_variant_names_are_unique_across_the_sets() -> None:
    names = [v.name for v in tuning.VARIANTS + tuning.TUNING_VARIANTS]
    assert len(names) == len(set(names))
