"""In-process checks: the spec helpers build what they say, unsupported setups fail at construction.

No process group is needed: the configuration is checked before any process
group is read (the process-group checks run in the multi-rank suite).
"""

from __future__ import annotations

import importlib.util
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn import functional as F

import groupgrad.integrations.megatron_core as megatron_core
from groupgrad.integrations.megatron_core import (
    GroupgradColumnParallelGroupedLinear,
    GroupgradFusedExperts,
    GroupgradRowParallelGroupedLinear,
    GroupgradSpecProvider,
    get_gpt_layer_groupgrad_spec,
    get_groupgrad_experts_spec,
    get_moe_module_groupgrad_spec,
)
from groupgrad.integrations.megatron_core._compat import check_supported
from groupgrad.integrations.megatron_core._hooks import WgradHooks


def _config(**overrides: Any) -> Any:
    options: dict[str, Any] = {
        "num_layers": 1,
        "hidden_size": 8,
        "ffn_hidden_size": 6,
        "num_attention_heads": 2,
        "num_moe_experts": 4,
        "moe_ffn_hidden_size": 6,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "use_cpu_initialization": True,
    }
    options.update(overrides)
    return TransformerConfig(**options)


def _module_and_submodules(entry: Any) -> tuple[type, Any]:
    """(class, submodules) of a spec entry: a ModuleSpec (0.16), a partial or a class (0.19)."""
    if isinstance(entry, ModuleSpec):
        return entry.module, entry.submodules
    if isinstance(entry, partial):
        return entry.func, entry.keywords.get("submodules")
    return entry, None


def _moe_experts(moe_spec: Any) -> tuple[type, Any]:
    module, submodules = _module_and_submodules(moe_spec)
    assert issubclass(module, MoELayer)
    return _module_and_submodules(submodules.experts)


@pytest.mark.parametrize("layer_numbers", [False, True])
def test_the_moe_layer_is_megatrons_own_unless_layer_numbers_are_asked_for(
    layer_numbers: bool,
) -> None:
    """Megatron 0.16's TransformerLayer hands its pg_collection only to MoELayer itself."""
    module, _ = _module_and_submodules(
        megatron_core.get_moe_module_groupgrad_spec(4, layer_numbers=layer_numbers)
    )
    assert module is (megatron_core.GroupgradMoELayer if layer_numbers else MoELayer)
    gpt = megatron_core.get_gpt_layer_groupgrad_spec(4, layer_numbers=layer_numbers)
    assert _module_and_submodules(gpt.submodules.mlp)[0] is module


# ---------------------------------------------------------------- versions


def test_installed_release_is_supported() -> None:
    assert megatron_core.MEGATRON_CORE_VERSION in megatron_core.SUPPORTED_RELEASES


@pytest.mark.parametrize(("major", "minor"), [(0, 15), (0, 17), (0, 18), (0, 20), (1, 0)])
def test_other_releases_are_refused_naming_both_versions(major: int, minor: int) -> None:
    with pytest.raises(
        ImportError,
        match=rf"supports megatron-core 0\.16\.x .*0\.19\.x .*installed megatron-core is {major}\.{minor}\.3",
    ):
        check_supported(major, minor, f"{major}.{minor}.3")


# ---------------------------------------------------------------- specs


@pytest.mark.parametrize("fused", [True, False])
def test_gpt_layer_spec_puts_groupgrad_experts_in_megatrons_moe_layer(fused: bool) -> None:
    spec = get_gpt_layer_groupgrad_spec(8, fused=fused)
    module, submodules = _moe_experts(spec.submodules.mlp)
    if fused:  # the classes, bound to the spec's num_experts
        assert issubclass(module, GroupgradFusedExperts)
        assert module.spec_num_experts == 8
        assert submodules is None
    else:
        assert module is TEGroupedMLP
        assert issubclass(submodules.linear_fc1, GroupgradColumnParallelGroupedLinear)
        assert issubclass(submodules.linear_fc2, GroupgradRowParallelGroupedLinear)
        assert submodules.linear_fc1.spec_num_experts == 8
    # the rest of the layer is Megatron's local spec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    local = get_gpt_layer_local_spec(num_experts=8)
    assert spec.module is local.module
    assert _module_and_submodules(spec.submodules.self_attention) == _module_and_submodules(
        local.submodules.self_attention
    )


def test_spec_helpers_agree() -> None:
    bound, _ = _moe_experts(get_moe_module_groupgrad_spec(4))
    plain, submodules = _module_and_submodules(get_groupgrad_experts_spec())
    assert bound.__mro__[1] is plain
    assert submodules is None
    entry = GroupgradSpecProvider(fused=False).grouped_mlp_modules(True)
    # 0.16: (module, submodules); 0.19: the builder
    module = entry[0] if isinstance(entry, tuple) else _module_and_submodules(entry)[0]
    assert module is TEGroupedMLP


@pytest.mark.parametrize("bad", [0, -2, True, "4", None])
def test_spec_needs_a_positive_number_of_experts(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"num_experts is {bad!r}, expected a positive int"):
        get_gpt_layer_groupgrad_spec(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("fused", [True, False])
def test_a_spec_built_on_another_number_of_experts_is_refused(fused: bool) -> None:
    # Catches: the spec's num_experts validated and then ignored (8 experts asked, 4 built).
    experts, submodules = _moe_experts(get_moe_module_groupgrad_spec(8, fused=fused))
    config = _config()  # num_moe_experts=4
    match = r"the spec was made for num_experts=8 but config\.num_moe_experts is 4"
    build = (
        (lambda: experts(4, config)) if fused else (lambda: _linear(submodules.linear_fc1, config))
    )
    with pytest.raises(ValueError, match=match):
        build()


def test_fused_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="fused is a str, expected a bool"):
        get_groupgrad_experts_spec(fused="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------- refused setups


def _linear(cls: type, config: Any, **overrides: Any) -> Any:
    options = {
        "config": config,
        "init_method": torch.nn.init.zeros_,
        "bias": False,
        "skip_bias_add": False,
    }
    options.update(overrides)
    return cls(4, 8, 12, **options)


@pytest.mark.parametrize(
    "build",
    [
        lambda c: GroupgradFusedExperts(4, c),
        lambda c: _linear(GroupgradColumnParallelGroupedLinear, c),
        lambda c: _linear(GroupgradRowParallelGroupedLinear, c),
    ],
    ids=["fused", "fc1", "fc2"],
)
def test_expert_tensor_parallelism_is_refused_at_construction(build: Any) -> None:
    with pytest.raises(
        ValueError, match="expert_tensor_parallel_size is 2; groupgrad experts do not implement"
    ):
        build(_config(expert_tensor_parallel_size=2))


def test_fp4_is_refused() -> None:
    config = _config()
    config.fp4 = "nvfp4"  # Megatron's own check needs Transformer Engine
    with pytest.raises(ValueError, match=r"fp4 is 'nvfp4'; groupgrad experts compute"):
        GroupgradFusedExperts(4, config)
    with pytest.raises(ValueError, match=r"fp4 is 'nvfp4'"):
        _linear(GroupgradColumnParallelGroupedLinear, config)


def test_moe_act_recompute_without_transformer_engine_is_refused_for_megatrons_layer() -> None:
    # Catches: TEGroupedMLP with groupgrad linears built with 'moe_act' recompute and no
    # Transformer Engine, failing at the first forward with NameError: FP8GlobalStateManager.
    config = _config(
        recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True
    )
    with pytest.raises(
        ValueError,
        match=r"^GroupgradColumnParallelGroupedLinear: recompute_modules holds 'moe_act' .*"
        r"without Transformer Engine installed .*Use the fused groupgrad experts",
    ):
        _linear(GroupgradColumnParallelGroupedLinear, config)


@pytest.mark.parametrize(
    ("build", "module"),
    [
        (lambda c: GroupgradFusedExperts(4, c), "expert_fc1"),
        (lambda c: GroupgradFusedExperts(4, c), "moe_act"),
        (lambda c: _linear(GroupgradColumnParallelGroupedLinear, c), "expert_fc1"),
    ],
    ids=["fused-expert_fc1", "fused-moe_act", "fc1-expert_fc1"],
)
def test_offloading_what_the_experts_keep_is_refused_at_construction(
    build: Any, module: str
) -> None:
    # Catches: the fused experts silently not offloading, and Megatron's TEGroupedMLP stopping
    # in set_save_original_input with a message about Transformer Engine's version.
    # ('moe_act' with the grouped linears offloads: Megatron's TEGroupedMLP does it.)
    config = _config(fine_grained_activation_offloading=True, offload_modules=[module])
    with pytest.raises(
        ValueError,
        match=rf": fine_grained_activation_offloading is on and offload_modules holds "
        rf"\['{module}'\], expected none of ",
    ):
        build(config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gated_linear_unit": False}, "gated_linear_unit is False, expected True"),
        ({"activation_func": F.gelu}, "activation_func is gelu, expected silu"),
        ({"add_bias_linear": True}, "add_bias_linear is True, expected False"),
        ({"activation_func_clamp_value": 7.0}, "activation_func_clamp_value is 7.0, expected None"),
        ({"glu_linear_offset": 1.0}, "glu_linear_offset is 1.0, expected 0.0"),
    ],
)
def test_fused_experts_refuse_what_the_fused_op_does_not_compute(
    overrides: dict, message: str
) -> None:
    config = _config(**overrides)
    with pytest.raises(ValueError, match=rf"GroupgradFusedExperts: {message}: the fused experts"):
        GroupgradFusedExperts(4, config)


def test_fused_experts_take_no_submodules() -> None:
    with pytest.raises(ValueError, match="submodules is 'x', expected None"):
        GroupgradFusedExperts(4, _config(), submodules="x")


def test_grouped_linear_is_for_experts_only() -> None:
    with pytest.raises(ValueError, match="is_expert is False, expected True"):
        _linear(GroupgradColumnParallelGroupedLinear, _config(), is_expert=False)


# ---------------------------------------------------------------- wgrad hooks


def test_wgrad_hooks_run_in_order_and_refuse_non_callables() -> None:
    hooks, order = WgradHooks(), []
    hooks.register(lambda: order.append("a"))
    hooks.register(lambda: order.append("b"))
    hooks.check("layer", [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)])
    assert order == []
    hooks.fire()
    assert order == ["a", "b"]
    with pytest.raises(TypeError, match="hook is a int, expected a callable"):
        hooks.register(3)  # type: ignore[arg-type]


def test_wgrad_hooks_refuse_main_grad_without_a_hook() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    WgradHooks().check("layer", [weight])  # no main_grad: a plain CPU test may call backward_dw()
    weight.main_grad = torch.zeros(2)  # type: ignore[attr-defined]
    with pytest.raises(
        RuntimeError, match=r"layer\.backward_dw\(\): .*no wgrad hook was registered"
    ):
        WgradHooks().check("layer", [weight])


def test_wgrad_hooks_refuse_a_weight_frozen_after_they_were_registered() -> None:
    # Catches: backward_dw() running Megatron DDP's hook of a weight frozen after the DDP was
    # built: the hook's bare `assert param.requires_grad` was all the user saw.
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    hooks, calls = WgradHooks(), []
    for index in range(2):
        hooks.register(lambda index=index: calls.append(index))
    weights[1].requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"2 wgrad hooks .* only 1 weights require grad "
                       r"\(weight 1 among the frozen ones\)"):  # fmt: skip
        hooks.check("layer", weights)
    assert calls == []
    hooks.check("layer", [weights[0], torch.nn.Parameter(torch.zeros(2))])  # one per hook
    hooks.fire()
    assert calls == [0, 1]


def test_wgrad_hooks_refuse_a_layer_wrapped_twice() -> None:
    # Catches: a bare StopIteration from looking for a frozen weight where none is frozen.
    weights = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    hooks, calls = WgradHooks(), []
    for index in range(4):  # two DDPs, one hook per weight each
        hooks.register(lambda index=index: calls.append(index))
    with pytest.raises(RuntimeError, match=r"4 wgrad hooks were registered for 2 weights: the "
                       r"layer was wrapped in Megatron's DistributedDataParallel more than once"):  # fmt: skip
        hooks.check("layer", weights)
    assert calls == []


# ---------------------------------------------------------------- the CPU shim


def test_cpu_shim_refuses_to_load_where_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(__file__).with_name("cpu_shim.py")
    spec = importlib.util.spec_from_file_location("_groupgrad_megatron_core_tests_shim_probe", path)
    assert spec is not None
    assert spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    current_device = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="cpu_shim is for CPU-only processes; CUDA is available"):
        shim.install()
    assert torch.cuda.current_device is current_device  # nothing was patched
    sys.modules.pop("_groupgrad_megatron_core_tests_shim_probe", None)
