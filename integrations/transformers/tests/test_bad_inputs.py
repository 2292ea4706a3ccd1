"""Bad inputs to the "groupgrad" experts implementation: a named error, nothing written.

Every case builds a tiny Qwen3-MoE experts module running on groupgrad,
breaks one argument (or the module), and checks the exception type, that the
message names the argument and its value, and that neither the expert
weights nor their ``.grad`` changed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from groupgrad_testsupport import load_sibling

tiny = load_sibling(__file__, "tiny")

import groupgrad.integrations.transformers as ggt  # noqa: E402 (registers "groupgrad")

TOKENS = 12


def _module() -> nn.Module:
    eager = tiny.use_implementation(tiny.EXPERTS_MODULES["qwen3_moe"](3), "eager")
    return tiny.use_implementation(copy.deepcopy(eager), "groupgrad")


def _inputs() -> tuple[Tensor, Tensor, Tensor]:
    hidden = torch.randn(TOKENS, tiny.HIDDEN, generator=torch.Generator().manual_seed(4))
    index, weights = tiny.routing(TOKENS, 5, dtype=torch.float32)
    return hidden, index, weights


def _set(name: str, value: object) -> Callable[[nn.Module], None]:
    def change(module: nn.Module) -> None:
        delattr(module, name)
        setattr(module, name, value)

    return change


CASES: list[tuple[str, Callable[..., Any], Callable[[nn.Module], None] | None, type, str]] = [
    ("weights-fewer-choices", lambda h, i, w: (h, i, w[:, :1]), None, ValueError,
     r"top_k_index has shape \(12, 2\) and top_k_weights \(12, 1\)"),
    ("index-1d", lambda h, i, w: (h, i[:, 0], w[:, 0]), None, ValueError,
     r"top_k_index has shape \(12,\) and top_k_weights \(12,\), expected one \(tokens, top_k\)"),
    ("index-3d", lambda h, i, w: (h, i[None], w[None]), None, ValueError,
     r"top_k_index has shape \(1, 12, 2\)"),
    ("hidden-fewer-rows", lambda h, i, w: (h[:-1], i, w), None, ValueError,
     r"hidden_states has shape \(11, 32\), expected \(12, hidden\)"),
    ("hidden-3d", lambda h, i, w: (h[None], i, w), None, ValueError,
     r"hidden_states has shape \(1, 12, 32\), expected \(12, hidden\)"),
    ("hidden-wrong-width", lambda h, i, w: (h[:, :-1], i, w), None, ValueError,
     r"x has shape \(12, 31\), expected \(tokens, 32\) for hidden_size=32"),
    ("index-float", lambda h, i, w: (h, i.float(), w), None, TypeError,
     r"top_k_index has dtype torch\.float32, expected an integer dtype"),
    ("index-bool", lambda h, i, w: (h, i > 0, w), None, TypeError,
     r"top_k_index has dtype torch\.bool, expected an integer dtype"),
    ("weights-int", lambda h, i, w: (h, i, (w * 10).long()), None, TypeError,
     r"top_k_weights has dtype torch\.int64, expected a floating-point dtype"),
    ("negative-expert-id", lambda h, i, w: (h, i - i.max() - 1, w), None, ValueError,
     r"top_k_index holds expert id -\d+, expected ids >= 0"),
    ("weights-more-choices", lambda h, i, w: (h, i, torch.cat([w, w[:, :1]], 1)), None, ValueError,
     r"top_k_index has shape \(12, 2\) and top_k_weights \(12, 3\)"),
    ("weights-not-a-tensor", lambda h, i, w: (h, i, w), _set("down_proj", None), TypeError,
     r"\.down_proj is NoneType, expected a Tensor"),
    ("hidden-fp64-into-fp32-experts", lambda h, i, w: (h.double(), i, w), None, TypeError,
     r"hidden_states has dtype torch\.float64 but Qwen3MoeExperts\.gate_up_proj has dtype "
     r"torch\.float32"),
    ("id-past-no-expert-slot", lambda h, i, w: (h, i + tiny.EXPERTS, w), None, ValueError,
     r"top_k_index holds expert id \d+, expected ids <= num_experts"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "change", "break_module", "error", "match"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_is_named_and_writes_nothing(name, change, break_module, error, match) -> None:
    module = _module()
    if break_module is not None:
        break_module(module)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    hidden, index, weights = change(*_inputs())
    with pytest.raises(error, match=match):
        module(hidden, index, weights).sum().backward()
    for n, p in module.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{name}: {n} changed"
        assert p.grad is None, f"{name}: {n}.grad written"


def test_the_unbroken_call_runs() -> None:
    module = _module()
    module(*_inputs()).sum().backward()
    assert all(p.grad is not None for p in module.parameters())
    assert ggt.IMPLEMENTATION == "groupgrad"
