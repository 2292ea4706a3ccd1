"""The ``"groupgrad"`` experts implementation against transformers' own eager experts.

Tiny random-init models built in code (``tiny.py``): Qwen3-MoE and Mixtral
(fused ``grouped_mlp``), GPT-OSS experts (transposed, interleaved, biases,
own gate: ``grouped_linear``), Nemotron-H experts (no gate), and SwiGLU
experts with biases declared with transformers' decorator (fused, router
weights applied after ``down_proj``). fp32 must match eager within 1e-5
relative; bf16 may err at most twice eager bf16's error against an fp64 eager
run (max and mean absolute error), plus an atol of one bf16 ulp at the
reference's largest magnitude for the max (a single rounding landing the
other way).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from groupgrad_testsupport import atomic_ops, load_sibling
from groupgrad_testsupport.experts import run_experts as experts_step

tiny = load_sibling(__file__, "tiny")

import groupgrad.integrations.transformers as ggt  # noqa: E402 (registers "groupgrad")

TOKENS = 48
FUSED = {"qwen3_moe", "mixtral", "swiglu_bias", "swiglu_bias_post_norm"}
ROUTED = {"qwen3_moe", "mixtral"}  # fused with nothing after down_proj: one routed op


def groupgrad_node(name: str) -> str:
    """The autograd node groupgrad's experts leave for the tiny module ``name``."""
    if name in ROUTED:
        return "RoutedMLPFunctionBackward"
    return "GroupedMLPFunctionBackward" if name in FUSED else "GroupedLinearFunctionBackward"


def rel_err(actual: Tensor, expected: Tensor) -> float:
    """Max abs difference over max abs of ``expected`` (NaN anywhere gives NaN, which fails)."""
    diff = (actual.detach().double() - expected.detach().double()).abs().max()
    return float(diff / expected.detach().double().abs().max().clamp_min(1e-30))


def autograd_nodes(out: Tensor) -> set[str]:
    """Names of every node in ``out``'s backward graph."""
    seen: set[str] = set()
    stack = [out.grad_fn]
    visited: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        seen.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return seen


def run_experts(
    experts: nn.Module, hidden: Tensor, index: Tensor, weights: Tensor, dy: Tensor
) -> dict[str, Tensor]:
    """Forward and backward of one experts module; every result by name, and its autograd nodes."""
    out, results = experts_step(experts, hidden, index, weights, dy)
    results["_nodes"] = autograd_nodes(out)  # type: ignore[assignment]
    return results


def _weights_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """Mixtral's router hands the experts fp32 weights; the others the model's dtype."""
    return torch.float32 if name == "mixtral" else dtype


def _inputs(name: str, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, tiny.HIDDEN, generator=generator).to(dtype)
    dy = torch.randn(TOKENS, tiny.HIDDEN, generator=generator).to(dtype)
    index, weights = tiny.routing(TOKENS, seed, dtype=_weights_dtype(name, dtype))
    return hidden, index, weights, dy


def _pair(name: str, seed: int, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    eager = tiny.use_implementation(tiny.EXPERTS_MODULES[name](seed).to(dtype), "eager")
    ours = tiny.use_implementation(copy.deepcopy(eager), "groupgrad")
    return eager, ours


# ------------------------------------------------------------------ routes


@pytest.mark.parametrize(
    ("name", "fused", "probs_in_mlp", "transposed"),
    [
        ("qwen3_moe", True, True, False),
        ("mixtral", True, True, False),
        ("swiglu_bias", True, False, False),
        ("gpt_oss", False, False, True),
        ("nemotron_h", False, False, False),
    ],
)
def test_route_of_each_layout(name: str, fused: bool, probs_in_mlp: bool, transposed: bool) -> None:
    route = ggt.experts_route(tiny.EXPERTS_MODULES[name](0))
    assert (route.fused, route.probs_in_mlp, route.transposed) == (fused, probs_in_mlp, transposed)
    assert (route.reason == "") == fused


# --------------------------------------------------------------- fp32 parity


@pytest.mark.parametrize("name", sorted(tiny.EXPERTS_MODULES))
def test_experts_match_eager_in_fp32(name: str) -> None:
    eager, ours = _pair(name, seed=3, dtype=torch.float32)
    hidden, index, weights, dy = _inputs(name, torch.float32, seed=4)
    expected = run_experts(eager, hidden, index, weights, dy)
    actual = run_experts(ours, hidden, index, weights, dy)
    assert groupgrad_node(name) in actual.pop("_nodes"), "the groupgrad op did not run"
    expected.pop("_nodes")
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert rel_err(actual[key], value) <= 1e-5, (key, rel_err(actual[key], value))
    unused = 1  # tiny.routing leaves expert 1 without tokens
    for key in ("d_gate_up_proj", "d_up_proj", "d_down_proj"):
        if key in actual:
            assert torch.count_nonzero(actual[key][unused]) == 0, key


@pytest.mark.parametrize("name", sorted(tiny.CAUSAL_LMS))
def test_causal_lm_matches_eager_in_fp32(name: str) -> None:
    eager = tiny.causal_lm(name, seed=5)
    ours = copy.deepcopy(eager)
    ours.set_experts_implementation("groupgrad")
    assert ours.config._experts_implementation == "groupgrad"
    assert eager.config._experts_implementation == "eager"
    ids = torch.randint(0, tiny.VOCAB, (3, 12), generator=torch.Generator().manual_seed(6))
    results = []
    for model in (eager, ours):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out, dict(model.named_parameters())))
    (out_e, params_e), (out_o, params_o) = results
    assert rel_err(out_o.logits, out_e.logits) <= 1e-5
    assert abs(float(out_o.loss.detach() - out_e.loss.detach())) <= 1e-5 * abs(
        float(out_e.loss.detach())
    )
    for key, param in params_e.items():
        assert param.grad is not None, key
        assert rel_err(params_o[key].grad, param.grad) <= 1e-5, (
            key,
            rel_err(params_o[key].grad, param.grad),
        )


def test_constructor_argument_selects_groupgrad() -> None:
    model = tiny.CAUSAL_LMS["qwen3_moe"][1](
        tiny.qwen3_moe_config(experts_implementation="groupgrad")
    )
    assert model.config._experts_implementation == "groupgrad"
    experts = model.model.layers[0].mlp.experts
    hidden, index, weights, _ = _inputs("qwen3_moe", torch.float32, seed=7)
    assert "RoutedMLPFunctionBackward" in autograd_nodes(
        experts(hidden, index, weights.requires_grad_())
    )


# --------------------------------------------------------------- bf16 rule


def _fp64_reference(eager_bf16: nn.Module, inputs: tuple[Tensor, ...]) -> dict[str, Tensor]:
    reference = copy.deepcopy(eager_bf16).double()
    hidden, index, weights, dy = inputs
    return run_experts(reference, hidden.double(), index, weights.double(), dy.double())


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "swiglu_bias"])
def test_bf16_errs_at_most_twice_eager(name: str) -> None:
    eager, ours = _pair(name, seed=8, dtype=torch.bfloat16)
    inputs = _inputs(name, torch.bfloat16, seed=9)
    reference = _fp64_reference(eager, inputs)
    eager_results = run_experts(eager, *inputs)
    our_results = run_experts(ours, *inputs)
    for key, expected in reference.items():
        if key == "_nodes":
            continue
        ours_err = (our_results[key].double() - expected).abs()
        eager_err = (eager_results[key].double() - expected).abs()
        atol = 2**-8 * expected.abs().max()
        assert ours_err.max() <= 2 * eager_err.max() + atol, (key, float(ours_err.max()))
        assert ours_err.mean() <= 2 * eager_err.mean(), (key, float(ours_err.mean()))


# ------------------------------------------------------- grad_dtype route


def _representable_in_bf16(t: Tensor) -> float:
    """Fraction of ``t``'s elements that bf16 holds exactly."""
    return float((t.to(torch.bfloat16).to(t.dtype) == t).double().mean())


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_fp32_grad_dtype_gets_unrounded_wgrads(name: str) -> None:
    eager, ours = _pair(name, seed=10, dtype=torch.bfloat16)
    bf16_grads = copy.deepcopy(ours)
    for param in ours.parameters():
        param.grad_dtype = torch.float32
    inputs = _inputs(name, torch.bfloat16, seed=11)
    reference = _fp64_reference(eager, inputs)
    fp32 = run_experts(ours, *inputs)
    rounded = run_experts(bf16_grads, *inputs)
    used = [e for e in range(tiny.EXPERTS) if e != 1]
    for key in ("d_gate_up_proj", "d_down_proj"):
        grad = fp32[key]
        assert grad.dtype == torch.float32, key
        assert rounded[key].dtype == torch.bfloat16, key
        assert _representable_in_bf16(grad[used]) < 0.01, key
        # the fp32 gradient is the one the bf16 route rounds, and nearer fp64 on average
        assert rel_err(grad.to(torch.bfloat16), rounded[key]) <= 2**-8, key
        fp32_err = (grad.double() - reference[key]).abs().mean()
        bf16_err = (rounded[key].double() - reference[key]).abs().mean()
        assert fp32_err < bf16_err, (key, float(fp32_err), float(bf16_err))


# ------------------------------------------------------------ reproducible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(tiny.EXPERTS_MODULES))
def test_no_op_that_adds_atomically_on_cuda(name: str, dtype) -> None:
    # Catches: a gather, combine or bias gradient summed by index_add_ / scatter_add_ (their
    # atomic adds on CUDA change a gradient's bits from run to run).
    eager, ours = _pair(name, seed=12, dtype=dtype)
    inputs = _inputs(name, dtype, seed=13)
    assert atomic_ops(lambda: experts_step(ours, *inputs)) == set()
    if not name.startswith("swiglu_bias"):  # transformers' own experts loops: index_add_
        assert atomic_ops(lambda: experts_step(eager, *inputs)) == {"aten::index_add_"}


# ------------------------------------------------------------ edge cases


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])  # their eager loops skip the slot
def test_the_no_expert_slot_computes_nothing_whatever_its_weight(name: str) -> None:
    # Catches: an id equal to num_experts run through the last expert (its output times the
    # router weight added, and every gradient with it), where the eager loop skips it.
    eager, ours = _pair(name, seed=14, dtype=torch.float32)
    hidden, index, weights, dy = _inputs(name, torch.float32, seed=15)
    index = index.clone()
    index[::3, 1] = tiny.EXPERTS  # the "no expert" slot, with the router's nonzero weight
    expected = run_experts(eager, hidden, index, weights, dy)
    actual = run_experts(ours, hidden, index, weights, dy)
    assert weights[::3, 1].abs().min() > 0
    for key in ("out", "d_hidden", "d_weights", *(k for k in expected if k.endswith("_proj"))):
        assert rel_err(actual[key], expected[key]) <= 1e-5, key
    assert not actual["d_weights"][::3, 1].any()


@pytest.mark.parametrize("name", ["gpt_oss", "swiglu_bias"])
def test_no_expert_rows_never_reach_the_last_experts_gemms(name: str) -> None:
    # Catches: a "no expert" row run through the last expert's GEMMs with its token's values
    # and zeroed only after: an fp16 overflow there turned into NaN (Inf x 0) in the output,
    # the input gradient and the last expert's weight gradient.
    _, ours = _pair(name, seed=20, dtype=torch.float16)
    with torch.no_grad():
        for param in ours.parameters():
            if param.dim() == 3:
                param[-1].mul_(1e3)  # the last expert overflows on any token of size
    hidden, index, weights, dy = _inputs(name, torch.float16, seed=21)
    index = index % (tiny.EXPERTS - 1)  # no real choice of the last expert
    index[::3] = tiny.EXPERTS  # every choice of these tokens is the "no expert" slot
    hidden = hidden.clone()
    hidden[::3] = 1e3
    actual = run_experts(ours, hidden, index, weights, dy)
    for key, value in actual.items():
        if isinstance(value, Tensor):
            assert torch.isfinite(value).all(), key
    assert not actual["out"][::3].any()
    assert not actual["d_hidden"][::3].any()


def test_an_id_past_the_no_expert_slot_raises_naming_it() -> None:
    _, ours = _pair("qwen3_moe", seed=16, dtype=torch.float32)
    hidden, index, weights, _ = _inputs("qwen3_moe", torch.float32, seed=17)
    index = index.clone()
    index[2, 0] = tiny.EXPERTS + 3
    with pytest.raises(ValueError, match=rf"expert id {tiny.EXPERTS + 3}, expected ids <= "):
        ours(hidden, index, weights)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_zero_tokens_give_an_empty_output_and_zero_gradients(name: str) -> None:
    eager, ours = _pair(name, seed=18, dtype=torch.float32)
    hidden, index, weights, _ = (t[:0] for t in _inputs(name, torch.float32, seed=19))
    expected = eager(hidden, index, weights)
    hidden.requires_grad_(True)
    out = ours(hidden, index, weights)
    assert out.shape == expected.shape == (0, tiny.HIDDEN)
    assert out.dtype == expected.dtype
    out.sum().backward()
    assert hidden.grad is not None
    assert hidden.grad.shape == (0, tiny.HIDDEN)
    grads = [p.grad for p in ours.parameters()]
    assert grads
    assert all(g is not None and not g.any() for g in grads)


def test_sentinel_ids_contribute_nothing() -> None:
    eager, ours = _pair("qwen3_moe", seed=12, dtype=torch.float32)
    hidden, index, weights, dy = _inputs("qwen3_moe", torch.float32, seed=13)
    sentinel_index, sentinel_weights = index.clone(), weights.clone()
    sentinel_index[::3, 1] = tiny.EXPERTS  # an expert-parallel sentinel: weight 0
    sentinel_weights[::3, 1] = 0.0
    valid_index = sentinel_index.clamp(max=tiny.EXPERTS - 1)
    valid_index[::3, 1] = 0  # the same choice on a real expert, weight 0
    expected = run_experts(eager, hidden, valid_index, sentinel_weights, dy)
    actual = run_experts(ours, hidden, sentinel_index, sentinel_weights, dy)
    for key in ("out", "d_hidden", "d_gate_up_proj", "d_down_proj"):
        assert rel_err(actual[key], expected[key]) <= 1e-5, key


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda h, i, w: (h, i, w[:, :1]),
            r"top_k_index has shape \(48, 2\) and top_k_weights \(48, 1\)",
        ),
        (
            lambda h, i, w: (h[:-1], i, w),
            r"hidden_states has shape \(47, 32\), expected \(48, hidden\)",
        ),
    ],
)
def test_mismatched_arguments_are_named(change: Callable[..., Any], match: str) -> None:
    _, ours = _pair("qwen3_moe", seed=16, dtype=torch.float32)
    hidden, index, weights, _ = _inputs("qwen3_moe", torch.float32, seed=17)
    with pytest.raises(ValueError, match=match):
        ours(*change(hidden, index, weights))


def test_tokens_per_expert_counts_every_expert() -> None:
    ids = torch.tensor([0, 0, 2, 2, 2, 5])
    counts = ggt.tokens_per_expert(ids, 6)
    assert counts.tolist() == [2, 0, 3, 0, 0, 1]
