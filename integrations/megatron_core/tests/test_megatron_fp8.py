"""FP8 in Megatron-Core: the config mapping and its errors, first/last layers in bf16, the cache epoch.

In-process: which ``TransformerConfig`` FP8 settings the fused experts run
(``fp8="e4m3"`` + ``fp8_recipe="blockwise"``) and which are refused at
construction, naming the setting; the grouped-linear experts refuse FP8
naming the fused backend; ``first_last_layers_bf16`` follows Megatron's rule.
One gloo rank (``fp8_worker.py``): Megatron's ``DistributedOptimizer``
writes the new bf16 weights through its buffers (no version bump: Megatron's
``is_first_microbatch`` flag tells the experts, and so does the cache's count
of ``torch.optim`` steps where Megatron's optimizer wraps one), and the first
micro-batch after each ``step()`` must use the new weights quantized
afresh; the ``first_last_layers_bf16`` layers' experts run bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn import functional as F

from groupgrad.integrations.megatron_core import (
    GroupgradColumnParallelGroupedLinear,
    GroupgradFusedExperts,
    GroupgradRowParallelGroupedLinear,
)
from groupgrad.integrations.megatron_core import _fp8 as fp8_settings
from groupgrad.integrations.megatron_core._fp8 import runs_in_bf16
from groupgrad_testsupport import Launches, load_sibling

WORKER = Path(__file__).with_name("fp8_worker.py")
checks = load_sibling(__file__, "checks")
SCENARIOS = [{"name": "step", "kind": "step"}, {"name": "bf16-layers", "kind": "bf16_layers"}]


def _config(**fp8: Any) -> Any:
    config = TransformerConfig(
        num_layers=4,
        hidden_size=128,
        ffn_hidden_size=128,
        num_attention_heads=2,
        num_moe_experts=2,
        moe_ffn_hidden_size=128,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    for name, value in fp8.items():  # Megatron's own FP8 checks need Transformer Engine
        setattr(config, name, value)
    return config


# ---------------------------------------------------------------- the config mapping


@pytest.mark.parametrize(
    ("fp8", "message"),
    [
        ({"fp8": "hybrid", "fp8_recipe": "blockwise"}, r"fp8 is 'hybrid'; "),
        ({"fp8": "e4m3", "fp8_recipe": "delayed"}, r"fp8_recipe is 'delayed' with fp8='e4m3'; "),
        ({"fp8": "e4m3", "fp8_recipe": "tensorwise"}, r"fp8_recipe is 'tensorwise' with fp8"),
        ({"fp8": "e4m3", "fp8_recipe": "mxfp8"}, r"fp8_recipe is 'mxfp8' with fp8='e4m3'; "),
        (
            {"fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": True},
            r"fp8_param is True \(--fp8-param-gather\); ",
        ),
        ({"fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_wgrad": False}, r"fp8_wgrad is False; "),
    ],
)
def test_fused_experts_refuse_other_fp8_settings(fp8: dict[str, Any], message: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"GroupgradFusedExperts: {message}.*support fp8='e4m3' with fp8_recipe='blockwise'",
    ):
        GroupgradFusedExperts(2, _config(**fp8))


@pytest.mark.parametrize(
    ("setting", "sizes"),
    [
        ("moe_ffn_hidden_size", {"moe_ffn_hidden_size": 192}),
        ("hidden_size", {"hidden_size": 192, "ffn_hidden_size": 192}),
    ],
)
def test_fused_experts_name_megatrons_size_that_fp8_cannot_take(
    setting: str, sizes: dict[str, int]
) -> None:
    # Catches: the FP8 size rule named in GroupedMLP's words (ffn_hidden_size is 192, where the
    # config's ffn_hidden_size was 128 and its moe_ffn_hidden_size 192), without the owner.
    config = _config(fp8="e4m3", fp8_recipe="blockwise")
    for name, value in sizes.items():
        setattr(config, name, value)
    with pytest.raises(
        ValueError,
        match=rf"^GroupgradFusedExperts: {setting} is 192 with fp8='e4m3'.* expected a multiple of 128",
    ):
        GroupgradFusedExperts(2, config)


def test_fused_experts_name_the_recipe_enum_by_its_value() -> None:
    from megatron.core.enums import Fp8Recipe

    with pytest.raises(ValueError, match=r"fp8_recipe is 'delayed' with fp8='e4m3'"):
        GroupgradFusedExperts(2, _config(fp8="e4m3", fp8_recipe=Fp8Recipe.delayed))


@pytest.mark.parametrize(
    ("recompute", "message"),
    [
        ({"recompute_granularity": "full"}, r"recompute_granularity is 'full'"),
        (
            {"recompute_granularity": "selective", "recompute_modules": ["moe", "layernorm"]},
            r"recompute_modules holds \['moe'\] \(recompute_granularity='selective'\)",
        ),
        (
            {
                "recompute_granularity": "selective",
                "recompute_modules": ["shared_experts"],
                "moe_shared_expert_intermediate_size": 128,
            },
            r"recompute_modules holds \['shared_experts'\] \(recompute_granularity='selective'\)",
        ),
    ],
)
def test_fp8_recompute_without_transformer_engine_is_refused_at_construction(
    monkeypatch: pytest.MonkeyPatch, recompute: dict[str, Any], message: str
) -> None:
    # Catches: accepted, and the first forward stopped inside Megatron with "NameError:
    # te_checkpoint" ('NoneType' object is not callable for "full"): with fp8 set, Megatron
    # recomputes only through Transformer Engine's checkpoint.
    config = _config(fp8="e4m3", fp8_recipe="blockwise", **recompute)
    monkeypatch.setattr(fp8_settings, "_te_installed", lambda: False)
    with pytest.raises(
        ValueError,
        match=rf"^GroupgradFusedExperts: {message} under fp8='e4m3' .*Transformer Engine is not",
    ):
        GroupgradFusedExperts(2, config)
    monkeypatch.setattr(fp8_settings, "_te_installed", lambda: True)  # then Megatron runs it
    assert fp8_settings.fused_experts_fp8_recipe(config, "GroupgradFusedExperts") == "blockwise"


def test_fp8_recompute_megatron_runs_without_te_checkpoint_is_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "shared_experts" goes through te_checkpoint only where there is a shared expert computed
    # apart from the token dispatch.
    monkeypatch.setattr(fp8_settings, "_te_installed", lambda: False)
    recipe = fp8_settings.fused_experts_fp8_recipe
    shared_overlapped = {
        "moe_shared_expert_intermediate_size": 128,
        "moe_shared_expert_overlap": True,
    }
    for modules, more in (
        (["moe_act"], {}), (["shared_experts"], {}), (["shared_experts"], shared_overlapped)
    ):  # fmt: skip
        config = _config(
            fp8="e4m3", fp8_recipe="blockwise", recompute_granularity="selective",
            recompute_modules=modules, **more,
        )  # fmt: skip
        assert recipe(config, "GroupgradFusedExperts") == "blockwise", (modules, more)
    assert recipe(_config(recompute_granularity="full"), "GroupgradFusedExperts") is None  # bf16


@pytest.mark.parametrize(
    "cls", [GroupgradColumnParallelGroupedLinear, GroupgradRowParallelGroupedLinear]
)
@pytest.mark.parametrize("fp8", ["e4m3", "hybrid"])
def test_grouped_linear_experts_refuse_fp8_naming_the_fused_backend(cls: type, fp8: str) -> None:
    config = _config(fp8=fp8, fp8_recipe="blockwise")
    with pytest.raises(
        ValueError,
        match=rf"fp8 is '{fp8}'; the grouped-linear experts \(fused=False.*FP8 route is the "
        r"fused experts: build the spec with fused=True",
    ):
        cls(
            2,
            128,
            256,
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=False,
            skip_bias_add=False,
        )


def test_first_last_layers_bf16_follows_megatrons_rule() -> None:
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    for start, end in [(1, 1), (2, 0), (0, 3)]:
        config = _config(
            first_last_layers_bf16=True,
            num_layers_at_start_in_bf16=start,
            num_layers_at_end_in_bf16=end,
        )
        ours = [runs_in_bf16(config, n) for n in range(1, 5)]
        assert ours == [is_first_last_bf16_layer(config, n - 1) for n in range(1, 5)]
        assert ours == [n <= start or n > 4 - end for n in range(1, 5)]
    assert not any(runs_in_bf16(_config(), n) for n in range(1, 5))


# ---------------------------------------------------------------- one gloo rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory, WORKER, {1: SCENARIOS}, timeout_s=300)


def test_first_microbatch_after_each_optimizer_step_requantizes(runs: Launches) -> None:
    (result,) = runs(1)["step"]
    checks.assert_fp8_step_requantizes(result)


def test_first_and_last_layers_run_bf16(runs: Launches) -> None:
    (result,) = runs(1)["bf16-layers"]
    checks.assert_first_and_last_layers_bf16(result)
