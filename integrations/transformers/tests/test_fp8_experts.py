"""``"groupgrad_fp8"``: transformers experts with their GEMMs in blockwise FP8 (reference kernels on CPU).

FP8 rounds every GEMM operand to e4m3 (3 mantissa bits), so the results are
checked against transformers' own eager experts in fp32 within FP8's error
(a few percent, relative to the norm) — and to differ from them by more than
bf16 would, so a silent fall back to bf16 GEMMs fails. Weight gradients of
bf16 experts whose ``grad_dtype`` is fp32 must arrive in fp32, not rounded.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from groupgrad_testsupport import atomic_ops, load_sibling
from groupgrad_testsupport.compiled import bf16_exact_share
from groupgrad_testsupport.experts import run_experts

tiny = load_sibling(__file__, "tiny")

import groupgrad.integrations.transformers as ggt  # noqa: E402 (registers both names)

H = F = 128  # FP8 blocks: hidden size and expert width multiples of 128
E, K, T = 4, 2, 40


def _experts(name: str) -> nn.Module:
    common = {"hidden_size": H, "num_experts_per_tok": K, "experts_implementation": "eager"}
    if name == "qwen3_moe":
        module: nn.Module = Qwen3MoeExperts(
            Qwen3MoeConfig(moe_intermediate_size=F, num_experts=E, **common)
        )
    elif name == "mixtral":
        module = MixtralExperts(MixtralConfig(intermediate_size=F, num_local_experts=E, **common))
    else:  # transposed weights, interleaved gate/up, biases, its own gate: two grouped linears
        module = GptOssExperts(GptOssConfig(intermediate_size=F, num_local_experts=E, **common))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / H**0.5)
    return module


def _bf16_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """``(hidden, index, weights, dy)`` of ``T`` tokens, each choosing ``K`` distinct experts."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=generator).bfloat16()
    index = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=generator), dim=-1).bfloat16()
    dy = torch.randn(T, H, generator=generator).bfloat16()
    return hidden, index, weights, dy


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_both_names_are_registered() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ggt.FP8_IMPLEMENTATION == "groupgrad_fp8"
    assert ALL_EXPERTS_FUNCTIONS["groupgrad_fp8"] is ggt.groupgrad_fp8_experts_forward
    assert ALL_EXPERTS_FUNCTIONS["groupgrad"] is ggt.groupgrad_experts_forward


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_fp8_experts_within_fp8_error_with_fp32_wgrads(name: str) -> None:
    eager = _experts(name)
    ours = tiny.use_implementation(copy.deepcopy(eager).to(torch.bfloat16), "groupgrad_fp8")
    bf16 = tiny.use_implementation(copy.deepcopy(eager).to(torch.bfloat16), "groupgrad")
    for module in (ours, bf16):
        for param in module.parameters():
            param.grad_dtype = torch.float32
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, H, generator=generator)
    index = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=generator), dim=-1)
    dy = torch.randn(T, H, generator=generator)
    _, want = run_experts(eager, hidden, index, weights, dy)
    _, got = run_experts(ours, hidden.bfloat16(), index, weights.bfloat16(), dy.bfloat16())
    _, near = run_experts(bf16, hidden.bfloat16(), index, weights.bfloat16(), dy.bfloat16())
    assert want.keys() == got.keys()
    for key, value in want.items():
        error, bf16_error = _rel(got[key], value), _rel(near[key], value)
        assert error < 0.15, (key, error)
        if key.endswith(("proj", "out", "hidden")):  # a GEMM result: FP8 rounds more than bf16
            assert error > 2 * bf16_error, (key, error, bf16_error)
        # transposed weights take their gradient through a bf16 copy (ExpertsRoute.transposed)
        if key.startswith("d_") and key.endswith("proj") and name != "gpt_oss":
            assert got[key].dtype == torch.float32, key
            assert bf16_exact_share(got[key]) < 0.1, key


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_no_expert_rows_leave_the_last_experts_fp8_blocks_unchanged(name: str) -> None:
    # Catches: "no expert" rows (sorted after the last expert's) quantized with their token's
    # values into that expert's 128-token wgrad blocks: its gradient changed with them.
    ours = tiny.use_implementation(_experts(name).to(torch.bfloat16), "groupgrad_fp8")
    hidden, index, weights, dy = _bf16_inputs(seed=2)
    extra = 20  # tokens whose every choice is the "no expert" slot, of a large size
    _, alone = run_experts(ours, hidden, index, weights, dy)
    ours.zero_grad()
    _, beside = run_experts(
        ours,
        torch.cat([hidden, torch.full((extra, H), 1e3).bfloat16()]),
        torch.cat([index, torch.full((extra, K), E)]),
        torch.cat([weights, torch.full((extra, K), 0.5).bfloat16()]),
        torch.cat([dy, torch.ones(extra, H).bfloat16()]),
    )
    for key, value in alone.items():
        if key.startswith("d_") and key.endswith("proj"):
            assert torch.equal(beside[key], value), key
    assert torch.equal(beside["out"][:T], alone["out"])
    assert not beside["out"][T:].any()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_no_op_that_adds_atomically_on_cuda(name: str) -> None:
    # Catches: an FP8 step's gather, combine or bias gradient summed by index_add_ again.
    ours = tiny.use_implementation(_experts(name).to(torch.bfloat16), "groupgrad_fp8")
    inputs = _bf16_inputs(seed=3)
    assert atomic_ops(lambda: run_experts(ours, *inputs)) == set()


def test_sizes_not_multiples_of_128_are_named() -> None:
    experts = tiny.use_implementation(tiny.EXPERTS_MODULES["qwen3_moe"](0), "groupgrad_fp8")
    index, weights = tiny.routing(8, seed=2)
    with pytest.raises(
        ValueError,
        match=r"^Qwen3MoeExperts has hidden size 32 and expert width 24; the experts "
        r"implementation 'groupgrad_fp8' needs multiples of 128 .*use 'groupgrad'",
    ):
        experts(torch.randn(8, tiny.HIDDEN), index, weights)


@pytest.mark.parametrize("implementation", ["groupgrad", "groupgrad_fp8"])
def test_a_fullgraph_compile_gives_eagers_fp32_wgrads(implementation: str) -> None:
    # Catches: the CPU check of the expert ids reading them on the host (int(ids.min())), which
    # a full graph cannot trace ("could not guard on data-dependent expression").
    eager = tiny.use_implementation(_experts("qwen3_moe").to(torch.bfloat16), implementation)
    twin = copy.deepcopy(eager)
    for module in (eager, twin):
        for param in module.parameters():
            param.grad_dtype = torch.float32  # (a deep copy does not carry it)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=generator).bfloat16()
    index = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=generator), dim=-1).bfloat16()
    dy = torch.randn(T, H, generator=generator).bfloat16()
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True)
    _, want = run_experts(eager, hidden, index, weights, dy)
    _, got = run_experts(compiled, hidden, index, weights, dy)
    got = {key.replace("_orig_mod.", ""): value for key, value in got.items()}
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        torch.testing.assert_close(got[key], value, rtol=2e-2, atol=1e-3, msg=key)
    for name in ("gate_up_proj", "down_proj"):
        assert got[f"d_{name}"].dtype == torch.float32
        assert bf16_exact_share(got[f"d_{name}"]) < 0.5, name
