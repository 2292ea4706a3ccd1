"""Registration of ``"groupgrad"`` in transformers' experts registry, and the version gate."""

from __future__ import annotations

import re
import warnings

import pytest
import transformers
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

import groupgrad.integrations.transformers as ggt


def test_import_registers_groupgrad() -> None:
    assert ALL_EXPERTS_FUNCTIONS["groupgrad"] is ggt.groupgrad_experts_forward
    assert "groupgrad" in ALL_EXPERTS_FUNCTIONS.valid_keys()
    assert ggt.IMPLEMENTATION == "groupgrad"


def test_register_is_idempotent() -> None:
    before = dict(ExpertsInterface._global_mapping)
    ggt.register()
    ggt.register()
    assert dict(ExpertsInterface._global_mapping) == before


def test_a_foreign_groupgrad_entry_is_not_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    def impostor(*args: object) -> None:
        return None

    monkeypatch.setitem(ExpertsInterface._global_mapping, "groupgrad", impostor)
    with pytest.raises(RuntimeError, match=r"registered already as .*impostor"):
        ggt.register()
    assert ExpertsInterface._global_mapping["groupgrad"] is impostor


@pytest.mark.parametrize("version", ["5.17.0", "5.20.1", "5.24.0", transformers.__version__])
def test_supported_versions_pass(version: str) -> None:
    ggt.check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.16.2", "4.57.0", "5.25.0", "5.25.0.dev0", "6.0.0"])
def test_other_versions_fail_with_the_range(version: str) -> None:
    with pytest.raises(RuntimeError, match=f"transformers {re.escape(version)} is installed"):
        ggt.check_transformers_version(version)


def _tiny_jetmoe() -> transformers.PreTrainedModel:
    """A model whose experts lack transformers' @use_experts_implementation (JetMoE)."""
    config = transformers.JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, kv_channels=8,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.JetMoeForCausalLM(config)


def test_experts_route_says_when_transformers_will_not_dispatch() -> None:
    model = _tiny_jetmoe()
    experts = model.model.layers[0].mlp.input_linear
    route = ggt.experts_route(experts)
    assert route.dispatched is False
    assert not route.fused
    assert "not decorated with transformers' @use_experts_implementation" in route.reason
    qwen = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[],
        )
    )  # fmt: skip
    assert ggt.experts_route(qwen.model.layers[0].mlp.experts).dispatched is True


def test_setting_groupgrad_on_a_model_it_cannot_serve_warns_once() -> None:
    model = _tiny_jetmoe()
    with pytest.warns(UserWarning, match=r"changes nothing on JetMoeForCausalLM"):
        model.set_experts_implementation("groupgrad")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call stays quiet
        _tiny_jetmoe().set_experts_implementation("groupgrad")
