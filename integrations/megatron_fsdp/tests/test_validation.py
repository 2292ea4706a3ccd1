"""Single-process checks of shard_model / shard_optimizer's validation and the overwrite fix.

Every rejection happens before Megatron-FSDP is called, so no process group
is needed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from megatron_fsdp import MixedPrecisionPolicy
from torch import nn

from groupgrad.integrations.megatron_fsdp import (
    fp32_grad_policy,
    gather_full_grads,
    gather_full_weights,
    shard_model,
    shard_optimizer,
)
from groupgrad.integrations.megatron_fsdp._overwrite import (
    groupgrad_weight_names,
    keep_unsharded_grads_accumulating,
)
from groupgrad.modules import GroupedLinear, GroupedMLP
from groupgrad.protocol.testing import FakeDistributedWeight


class Block(nn.Module):
    def __init__(self, *, linear_into_main_grad: bool = True, mlp_into_main_grad: bool = True):
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.proj = GroupedLinear(2, 4, 4, accumulate_into_main_grad=linear_into_main_grad)
        self.mlp = GroupedMLP(2, 4, 3, accumulate_into_main_grad=mlp_into_main_grad)


UNITS = [GroupedLinear, GroupedMLP]


class ExpertHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Module()
        self.layer.experts = GroupedMLP(2, 4, 3, accumulate_into_main_grad=True)


def test_default_policy_is_fp32_grads_and_fp32_communication() -> None:
    policy = fp32_grad_policy()
    assert policy.main_grads_dtype == torch.float32
    assert policy.grad_comm_dtype == torch.float32
    assert policy.main_params_dtype == torch.float32


def test_rejects_a_parameter_that_is_also_a_distributed_weight() -> None:
    block = Block()
    block.proj.weight1 = FakeDistributedWeight(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"parameter 'proj\.weight1' is a DistributedWeight"):
        shard_model(block)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"linear_into_main_grad": False}, r"GroupedLinear 'proj' has accumulate_into_main_grad"),
        ({"mlp_into_main_grad": False}, r"GroupedMLP 'mlp' has accumulate_into_main_grad=False"),
    ],
)
def test_requires_wgrad_into_main_grad(options: dict[str, bool], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        shard_model(Block(**options))


@pytest.mark.parametrize(
    "layer",
    [
        GroupedLinear(2, 4, 4, accumulate_into_main_grad=True, delay_wgrad_compute=True),
        GroupedMLP(2, 4, 3, accumulate_into_main_grad=True, delay_wgrad_compute=True),
    ],
    ids=["linear", "mlp"],
)
def test_rejects_delayed_wgrad(layer: nn.Module) -> None:
    block = Block()
    block.extra = layer
    with pytest.raises(ValueError, match=r"'extra' has delay_wgrad_compute=True, expected False"):
        shard_model(block)


def test_rejects_a_root_layer_without_wgrad_into_main_grad() -> None:
    with pytest.raises(ValueError, match=r"GroupedLinear '<root>'.*expected True"):
        shard_model(GroupedLinear(2, 4, 4))


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16),
            r"main_grads_dtype is torch\.bfloat16, expected torch\.float32",
        ),
        (MixedPrecisionPolicy(), r"main_grads_dtype is None, expected torch\.float32"),
        (
            MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=torch.bfloat16),
            r"grad_comm_dtype is torch\.bfloat16, expected torch\.float32 or None",
        ),
    ],
)
def test_requires_fp32_gradients_and_reduction(policy: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shard_model(Block(), mixed_precision_policy=policy)


def test_rejects_a_policy_of_another_type() -> None:
    with pytest.raises(TypeError, match=r"mixed_precision_policy is a dict, expected"):
        shard_model(Block(), mixed_precision_policy={"main_grads_dtype": torch.float32})


def test_rejects_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"module is a Tensor, expected a torch\.nn\.Module"):
        shard_model(torch.zeros(2))  # type: ignore[arg-type]


def test_expert_parameters_need_an_expert_mesh() -> None:
    with pytest.raises(
        ValueError,
        match=r"expt_device_mesh is None, but 4 parameter\(s\) are expert.*"
        r"'layer\.experts\.fc1\.weight0'",
    ):
        shard_model(ExpertHolder())


def test_expert_mesh_needs_the_sharding_dimension() -> None:
    mesh = SimpleNamespace(mesh_dim_names=("ep", "tp"))
    with pytest.raises(
        ValueError, match=r"dimensions \('ep', 'tp'\), expected one named dp_shard_dim='fsdp'"
    ):
        shard_model(ExpertHolder(), expt_device_mesh=mesh)


@pytest.mark.parametrize("units", [[GroupedLinear], ["groupgrad.modules.GroupedLinear"]])
def test_zero3_units_must_include_grouped_mlp(units: list[Any]) -> None:
    with pytest.raises(ValueError, match=r"names GroupedLinear but not GroupedMLP.*'mlp'"):
        shard_model(Block(), fsdp_unit_modules=units)


@pytest.mark.parametrize(
    ("units", "shown"),
    [
        (None, "None"),
        ([nn.Conv1d], r"\[Conv1d\]"),
        (["torch.nn.Conv1d"], r"\['torch\.nn\.Conv1d'\]"),  # a path, imported as Megatron-FSDP does
    ],
)
def test_zero3_needs_an_fsdp_unit_in_the_model(units: Any, shown: str) -> None:
    # Catches: Megatron-FSDP's ZeroDivisionError (it divides by the number of FSDP units in the
    # model) all that a user of the default fsdp_unit_modules=None saw under the default ZeRO-3.
    with pytest.raises(
        ValueError,
        match=rf"^fsdp_unit_modules is {shown} under zero_dp_strategy='optim_grads_params', "
        "and no module of the model is one: .*expected the classes of the model's blocks",
    ):
        shard_model(Block(), fsdp_unit_modules=units)


def test_shard_optimizer_rejects_plain_parameters() -> None:
    optimizer = torch.optim.SGD(Block().parameters(), lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(2, 4\)\) is not a "
        "Megatron-FSDP parameter",
    ):
        shard_optimizer(optimizer)


def test_shard_optimizer_rejects_parameters_of_two_models() -> None:
    first, second = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    first._megatron_fsdp_model = object()  # type: ignore[attr-defined]
    second._megatron_fsdp_model = object()  # type: ignore[attr-defined]
    optimizer = torch.optim.SGD([first, second], lr=0.1)
    with pytest.raises(ValueError, match=r"\[0\]\['params'\]\[1\] belongs to another"):
        shard_optimizer(optimizer)


def test_groupgrad_weight_names_cover_linear_and_mlp_weights() -> None:
    assert groupgrad_weight_names(Block()) == [
        "proj.weight0",
        "proj.weight1",
        "mlp.fc1.weight0",
        "mlp.fc1.weight1",
        "mlp.fc2.weight0",
        "mlp.fc2.weight1",
    ]


class FakeMegatronFSDP:
    """The few members of MegatronFSDP the overwrite fix reads, with one sharded buffer."""

    def __init__(self, params: dict[str, nn.Parameter], sharded: set[str]) -> None:
        self.raw_param = params
        groups, index = [], {}
        for i, (name, param) in enumerate(params.items()):
            gbuf = SimpleNamespace(is_data_distributed=name in sharded)
            groups.append(SimpleNamespace(hfsdp_helper_gbuf=None, main_grad_buffer=gbuf))
            index[param] = i
        self.param_and_grad_buffer = SimpleNamespace(
            parameter_groups=groups, param_to_param_group=index
        )
        self.gathers = 0

    def all_gather_and_wait_parameters_ready(self, params: Any, **kwargs: Any) -> None:
        self.gathers += 1
        for param in params:
            param.overwrite_main_grad = True


def test_overwrite_fix_keeps_only_unsharded_groupgrad_weights_accumulating() -> None:
    params = {n: nn.Parameter(torch.zeros(2)) for n in ("a", "b", "other")}
    model = FakeMegatronFSDP(params, sharded={"b"})
    fixed = keep_unsharded_grads_accumulating(model, ["a", "b"])
    assert fixed == [params["a"]]
    assert keep_unsharded_grads_accumulating(model, ["a", "b"]) == fixed  # idempotent
    for _ in range(2):
        model.all_gather_and_wait_parameters_ready(params=list(params.values()), bwd=True)
        assert params["a"].overwrite_main_grad is False  # type: ignore[attr-defined]
        assert params["b"].overwrite_main_grad is True  # type: ignore[attr-defined]
        assert params["other"].overwrite_main_grad is True  # type: ignore[attr-defined]
    assert model.gathers == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_shard_model_says_megatron_fsdp_needs_it() -> None:
    """Checked after the module (whose errors come first), before Megatron-FSDP runs."""
    with pytest.raises(RuntimeError, match=r"shard_model needs CUDA: Megatron-FSDP runs its"):
        shard_model(Block(), fsdp_unit_modules=UNITS)
    for strategy in ("optim", "optim_grads"):  # no units needed below ZeRO-3
        with pytest.raises(RuntimeError, match=r"shard_model needs CUDA"):
            shard_model(Block(), zero_dp_strategy=strategy)
    with pytest.raises(RuntimeError, match=r"shard_model needs CUDA"):  # a path, imported
        shard_model(Block(), fsdp_unit_modules=["groupgrad.modules.GroupedMLP"])


@pytest.mark.parametrize("gather", [gather_full_weights, gather_full_grads])
def test_gathering_rejects_what_is_not_a_megatron_fsdp_model(gather: Any) -> None:
    with pytest.raises(TypeError, match=r"model is a Block, expected the megatron_fsdp"):
        gather(Block())


def test_a_megatron_core_that_does_not_fit_megatron_fsdp_is_named_before_sharding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # megatron-fsdp takes megatron.core's config class whenever megatron-core is importable;
    # stand in for an older megatron-core (0.16.x) whose class lacks a field megatron-fsdp sets
    import dataclasses
    import importlib

    own = importlib.import_module("megatron_fsdp.distributed_data_parallel_config")
    fields = list(dataclasses.fields(own.DistributedDataParallelConfig))
    older = dataclasses.make_dataclass(
        "DistributedDataParallelConfig",
        [(f.name, f.type, f) for f in fields if f.name != "fsdp_db_use_persist_buf_on_alloc_fail"],
    )
    chosen = importlib.import_module("megatron_fsdp.fully_shard")
    monkeypatch.setattr(chosen, "DistributedDataParallelConfig", older)
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: {"megatron-fsdp": "0.6.1"}.get(name, "0.16.1")
    )
    module = GroupedMLP(2, 8, 8, accumulate_into_main_grad=True)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(
        RuntimeError,
        match=r"megatron-fsdp 0\.6\.1 uses megatron-core 0\.16\.1's .*fsdp_db_use_persist_buf_on_alloc_fail",
    ):
        shard_model(module, fsdp_unit_modules=UNITS)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
