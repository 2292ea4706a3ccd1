"""Unsupported setups are clear errors when ``fully_shard`` is called, before FSDP2 touches the module.

One process, a one-rank gloo group (FSDP2 needs a default process group to
shard at all). Every rejected call leaves the module unsharded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from groupgrad.integrations.fsdp2 import fully_shard
from groupgrad.modules import GroupedLinear, GroupedMLP
from groupgrad.protocol.testing import FakeDistributedWeight

BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.fixture(autouse=True)
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Block(nn.Module):
    """A router ``nn.Linear`` and a groupgrad ``GroupedMLP``: the usual MoE block."""

    def __init__(self, **mlp_options: Any) -> None:
        super().__init__()
        self.router = nn.Linear(8, 3)
        self.mlp = GroupedMLP(3, 8, 4, **mlp_options)

    def forward(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)[:, 0]
        return self.mlp(x, splits, probs)


def _unsharded(module: nn.Module) -> bool:
    return not isinstance(module, FSDPModule) and not any(
        type(p).__name__ == "DTensor" for p in module.parameters()
    )


def test_a_supported_block_is_sharded_and_marked() -> None:
    block = Block(bias=True)
    sharded = fully_shard(block, mp_policy=BF16_FP32)
    assert sharded is block
    assert isinstance(block, FSDPModule)
    assert all(type(p).__name__ == "DTensor" for p in block.parameters())


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"accumulate_into_main_grad": True},
            r"GroupedMLP 'mlp' has accumulate_into_main_grad=True, expected False under FSDP2",
        ),
        (
            {"delay_wgrad_compute": True},
            r"GroupedMLP 'mlp' has delay_wgrad_compute=True, expected False under FSDP2",
        ),
    ],
)
def test_layer_options_fsdp2_cannot_serve(options: dict[str, Any], match: str) -> None:
    block = Block(**options)
    with pytest.raises(ValueError, match=match):
        fully_shard(block, mp_policy=BF16_FP32)
    assert _unsharded(block)


@pytest.mark.parametrize(
    ("flag", "match"),
    [
        ("accumulate_into_main_grad", r"GroupedMLP 'mlp' has accumulate_into_main_grad=True"),
        ("delay_wgrad_compute", r"GroupedMLP 'mlp' has delay_wgrad_compute=True, expected False"),
    ],
)
def test_a_layer_flag_switched_on_after_sharding_is_refused_at_the_next_forward(
    flag: str, match: str
) -> None:
    # Catches: delay_wgrad_compute switched on after fully_shard: backward_dw() wrote the
    # unsharded weights' gradient after FSDP2's reduce-scatter, the sharded .grad stayed None.
    block = Block()
    fully_shard(block, mp_policy=BF16_FP32)
    x, splits = torch.randn(6, 8), [2, 0, 4]
    block(x, splits).float().sum().backward()  # the setup as sharded trains
    setattr(block.mlp, flag, True)
    with pytest.raises(ValueError, match=match):
        block(x, splits)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_unit_compiled_after_sharding_runs_its_hooks_outside_the_graph(fp8: bool) -> None:
    # Catches: the unit's forward pre-hooks (grad_dtype of the unsharded parameters, the layer
    # flags, the FP8 caches) traced by Dynamo when the sharded unit is compiled in place:
    # "torch.* op returned non-Tensor" at grad_dtype, with fullgraph=True.
    size = 128 if fp8 else 8  # FP8 blocks are 128 wide
    options = {"fp8_recipe": "blockwise"} if fp8 else {}
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        mlp = GroupedMLP(3, size, size, **options)
        fully_shard(mlp, mp_policy=BF16_FP32)
        if compiled:
            mlp.compile(fullgraph=True, backend="aot_eager")
        x, probs = torch.randn(6, size), torch.rand(6)
        mlp(x, torch.tensor([2, 0, 4]), probs).float().square().sum().backward()
        grads.append([p.grad.to_local() for p in mlp.parameters()])
    for eager, compiled in zip(*grads, strict=True):
        assert compiled.dtype == torch.float32
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def _fc2_switched_to_main_grad_later() -> nn.Module:
    block = Block()
    block.mlp.fc2.accumulate_into_main_grad = True
    return block


def _distributed_weight() -> nn.Module:
    layer = GroupedLinear(2, 4, 6, bias=False)
    layer.weight0 = FakeDistributedWeight(layer.weight0.detach().clone())
    return layer


def _dtensor_parameter() -> nn.Module:
    layer = GroupedLinear(2, 4, 6, bias=False, single_grouped_weight=True)
    mesh = init_device_mesh("cpu", (1,))
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    return layer


def _mlp_halves_as_units() -> nn.Module:
    block = Block()  # the fused MLP never calls fc1's or fc2's forward: FSDP2 never gathers them
    fully_shard(block.mlp.fc1, mp_policy=BF16_FP32)
    fully_shard(block.mlp.fc2, mp_policy=BF16_FP32)
    return block


def _sub_unit_sharded_by_plain_fsdp2() -> nn.Module:
    block = Block()
    torch_fully_shard(block.mlp, mp_policy=BF16_FP32)
    return block


def _mixed_dtypes() -> nn.Module:
    block = Block()
    block.mlp.to(torch.bfloat16)  # the router stays fp32: FSDP2 would fail at the first forward
    return block


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            _mixed_dtypes,
            r"parameter 'mlp.fc1.weight0' has dtype torch.bfloat16 but 'router.weight' has "
            r"torch.float32; FSDP2 expects one original dtype per unit",
        ),
        (
            _fc2_switched_to_main_grad_later,
            r"GroupedLinear 'mlp.fc2' has accumulate_into_main_grad",
        ),
        (  # a DistributedWeight would have two owners
            _distributed_weight,
            r"parameter 'weight0' is a DistributedWeight",
        ),
        (
            _dtensor_parameter,
            r"parameter 'weight' of GroupedLinear '<module>' is already a DTensor",
        ),
        (
            _mlp_halves_as_units,
            r"'mlp\.fc1' inside GroupedMLP 'mlp' is an FSDP unit of its own; expected GroupedMLP "
            r"'mlp' sharded whole",
        ),
        (
            _sub_unit_sharded_by_plain_fsdp2,
            r"submodule 'mlp' holds groupgrad layers .* sharded by torch",
        ),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_a_setup_fsdp2_cannot_serve_is_named(build: Callable[[], nn.Module], match: str) -> None:
    module = build()
    with pytest.raises(ValueError, match=match):
        fully_shard(module, mp_policy=BF16_FP32)


def test_a_sub_unit_sharded_by_the_integration_is_accepted() -> None:
    block = Block()
    fully_shard(block.mlp, mp_policy=BF16_FP32)
    fully_shard(block, mp_policy=BF16_FP32)
    assert isinstance(block, FSDPModule)


def test_sharding_a_unit_twice_is_rejected() -> None:
    block = Block()
    fully_shard(block, mp_policy=BF16_FP32)
    with pytest.raises(ValueError, match=r"module \(FSDPBlock\) is an FSDP unit already"):
        fully_shard(block, mp_policy=BF16_FP32)


@pytest.mark.parametrize(
    ("module", "error", "match"),
    [
        ("a string", TypeError, r"module is a str, expected an nn.Module"),
        ([], TypeError, r"module is an empty list"),
        ([nn.Linear(2, 2), 3], TypeError, r"module\[1\] is a int, expected an nn.Module"),
    ],
)
def test_what_is_not_a_module_is_named(module: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fully_shard(module, mp_policy=BF16_FP32)


def test_mp_policy_must_be_a_policy() -> None:
    with pytest.raises(TypeError, match=r"mp_policy is a dict, expected a .*MixedPrecisionPolicy"):
        fully_shard(Block(), mp_policy={"param_dtype": torch.bfloat16})


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float64),
            r"mp_policy.reduce_dtype is torch.float64, expected None or one of torch.float32",
        ),
        (
            MixedPrecisionPolicy(param_dtype=torch.float64),
            r"mp_policy.param_dtype is torch.float64, expected None or one of",
        ),
    ],
)
def test_dtypes_the_epilogue_cannot_write(policy: MixedPrecisionPolicy, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fully_shard(Block(), mp_policy=policy)


@pytest.mark.parametrize(
    ("block", "policy"),
    [
        (lambda: Block(), MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        (lambda: Block().to(torch.bfloat16), MixedPrecisionPolicy()),
        (lambda: Block().to(torch.bfloat16), None),
    ],
)
def test_sixteen_bit_compute_needs_an_explicit_reduce_dtype(
    block: Any, policy: MixedPrecisionPolicy | None
) -> None:
    module = block()
    kwargs = {} if policy is None else {"mp_policy": policy}
    with pytest.raises(
        ValueError,
        match=r"parameter 'router.weight' is computed in torch.bfloat16 and mp_policy.reduce_dtype is None",
    ):
        fully_shard(module, **kwargs)
    assert _unsharded(module)


@pytest.mark.parametrize(
    ("block", "policy"),
    [
        (lambda: Block(), None),  # fp32 throughout: nothing to route
        (
            lambda: Block().to(torch.bfloat16),
            MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),  # bf16 reduction on purpose
        ),
    ],
)
def test_setups_without_a_route_are_passed_through(block: Any, policy: Any) -> None:
    module = block()
    kwargs = {} if policy is None else {"mp_policy": policy}
    fully_shard(module, **kwargs)
    assert isinstance(module, FSDPModule)


def test_dp_mesh_dims_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"dp_mesh_dims is 'shard', expected None"):
        fully_shard(Block(), mp_policy=BF16_FP32, dp_mesh_dims="shard")


def _representable_in_bf16(t: torch.Tensor) -> float:
    return float((t.to(torch.bfloat16).to(t.dtype) == t).double().mean())


@pytest.mark.parametrize("integrated", [True, False], ids=["groupgrad", "plain_fsdp2"])
def test_one_rank_gradients_reach_the_shard_unrounded(integrated: bool) -> None:
    torch.manual_seed(0)
    block = Block(bias=True)
    (fully_shard if integrated else torch_fully_shard)(block, mp_policy=BF16_FP32)
    x = torch.randn(96, 8)
    block(x, [40, 24, 32]).float().square().sum().backward()
    grads = [param.grad.to_local() for param in block.mlp.parameters()]
    assert all(grad.dtype == torch.float32 for grad in grads)
    fraction = _representable_in_bf16(torch.cat([grad.flatten() for grad in grads]))
    assert (fraction < 0.01) if integrated else (fraction == 1.0), fraction


def test_the_grouped_list_form_routes_every_module_of_the_unit() -> None:
    torch.manual_seed(0)
    block = Block(bias=True)
    fully_shard([block.router, block.mlp], mp_policy=BF16_FP32)
    fully_shard(block, mp_policy=BF16_FP32)  # FSDP2 needs one root
    x = torch.randn(96, 8)
    block(x, [40, 24, 32]).float().square().sum().backward()
    grads = [param.grad.to_local() for param in block.mlp.parameters()]
    assert all(grad.dtype == torch.float32 for grad in grads)
    assert _representable_in_bf16(torch.cat([grad.flatten() for grad in grads])) < 0.01
