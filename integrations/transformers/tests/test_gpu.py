"""The ``"groupgrad"`` experts on a CUDA GPU (CUTLASS GEMMs, Triton SwiGLU) against transformers.

Sizes are GPU-friendly (``H = 128``, ``F = 64``, ``E = 8``, ``T = 512``) so
the grouped GEMMs take the CUTLASS path; any fallback to the reference path
fails the test. bf16 must err at most twice transformers' own bf16 (eager
and ``grouped_mm``) against fp64 eager, plus an atol of one bf16 ulp at the
largest magnitude; with fp32 ``grad_dtype`` the wgrads are fp32 from the
epilogue, under 1 % of their elements exactly bf16.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import groupgrad.integrations.transformers as ggt
from groupgrad_testsupport.experts import run_experts

pytestmark = pytest.mark.gpu

H, F, E, K, T = 128, 64, 8, 2, 512


def _experts(name: str) -> nn.Module:
    common = {
        "vocab_size": 64,
        "hidden_size": H,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts_per_tok": K,
        "experts_implementation": "eager",
    }
    torch.manual_seed(0)
    if name == "qwen3_moe":
        config = Qwen3MoeConfig(
            intermediate_size=256,
            moe_intermediate_size=F,
            num_experts=E,
            mlp_only_layers=[],
            **common,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = MixtralForCausalLM(
            MixtralConfig(intermediate_size=F, num_local_experts=E, **common)
        )
    experts = model.model.layers[0].mlp.experts
    experts.config = copy.deepcopy(experts.config)
    return experts.to("cuda", torch.bfloat16)


def _inputs(name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, H, generator=gen)
    dy = torch.randn(T, H, generator=gen)
    index = torch.rand(T, E, generator=gen).argsort(dim=-1)[:, :K]
    weights = torch.softmax(torch.randn(T, K, generator=gen), dim=-1)
    weights = weights if name == "mixtral" else weights.to(torch.bfloat16)
    return (
        hidden.to("cuda", torch.bfloat16),
        index.cuda(),
        weights.cuda(),
        dy.to("cuda", torch.bfloat16),
    )


def _run(experts: nn.Module, implementation: str, inputs: tuple[Tensor, ...]) -> dict[str, Tensor]:
    experts.config._experts_implementation = implementation
    _, found = run_experts(experts, *inputs)
    torch.cuda.synchronize()
    return found


@pytest.fixture
def no_fallback(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.WARNING, logger="groupgrad")
    yield
    fallbacks = [r.getMessage() for r in caplog.records if r.name.startswith("groupgrad")]
    assert not fallbacks, fallbacks


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_bf16_on_cuda_errs_at_most_twice_transformers(name: str) -> None:
    experts = _experts(name)
    inputs = _inputs(name)
    reference = copy.deepcopy(experts).double()
    fp64 = _run(
        reference, "eager", tuple(t.double() if t.is_floating_point() else t for t in inputs)
    )
    ours = _run(experts, "groupgrad", inputs)
    for baseline in ("eager", "grouped_mm"):
        theirs = _run(experts, baseline, inputs)
        for key, expected in fp64.items():
            ours_err = (ours[key].double() - expected).abs()
            their_err = (theirs[key].double() - expected).abs()
            atol = 2**-8 * expected.abs().max()
            assert ours_err.max() <= 2 * their_err.max() + atol, (baseline, key)
            assert ours_err.mean() <= 2 * their_err.mean(), (baseline, key)


@pytest.mark.usefixtures("no_fallback")
def test_fp32_grad_dtype_on_cuda_comes_from_the_epilogue() -> None:
    experts = _experts("qwen3_moe")
    assert ggt.experts_route(experts).fused
    rounded = _run(experts, "groupgrad", _inputs("qwen3_moe"))
    for p in experts.parameters():
        p.grad = None  # PyTorch refuses a new grad_dtype while a .grad of another dtype exists
        p.grad_dtype = torch.float32
    fp32 = _run(experts, "groupgrad", _inputs("qwen3_moe"))
    for key in ("d_gate_up_proj", "d_down_proj"):
        grad = fp32[key]
        assert grad.dtype == torch.float32
        exact = (grad.to(torch.bfloat16).float() == grad).double().mean()
        assert exact < 0.01, (key, float(exact))
        diff = (grad.to(torch.bfloat16).double() - rounded[key].double()).abs().max()
        assert diff <= 2**-8 * rounded[key].double().abs().max(), key
