"""shard_expert_weights in one process: which rows each rank keeps, the attributes, the errors.

Sharding itself communicates nothing, so these tests pretend to be rank 1 of
2 (``torch.distributed``'s rank queries patched); everything that runs a
collective is tested with real processes in ``test_sharded_training.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from groupgrad.integrations.torch_distributed import (
    ExpertShardGroup,
    ShardedExpertWeight,
    gather_full_weights,
    shard_expert_weights,
)
from groupgrad.modules import GroupedLinear, GroupedMLP
from groupgrad.protocol import DistributedWeight, is_distributed_weight

E, K, N = 3, 4, 6


@pytest.fixture
def rank_1_of_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)


@pytest.mark.usefixtures("rank_1_of_2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_expert_keeps_its_lower_rows_on_rank_1(dtype: torch.dtype) -> None:
    layer = GroupedLinear(E, K, N, bias=True, dtype=dtype)
    full = {f"weight{e}": getattr(layer, f"weight{e}").detach().clone() for e in range(E)}
    bias0 = layer.bias0
    (group,) = shard_expert_weights(layer)
    assert isinstance(group, ExpertShardGroup)
    assert group.full_shape == (N, K)
    assert group.shard_shape == (N // 2, K)
    assert group.members == [getattr(layer, f"weight{e}") for e in range(E)]
    for e in range(E):
        shard = getattr(layer, f"weight{e}")
        assert isinstance(shard, ShardedExpertWeight)
        assert isinstance(shard, DistributedWeight)
        assert is_distributed_weight(shard)
        assert shard.shard_group is group
        assert shard.dtype == dtype
        assert shard.requires_grad
        assert torch.equal(shard.detach(), full[f"weight{e}"][N // 2 :])
        assert shard.main_grad is not None
        assert shard.main_grad.dtype == torch.float32
        assert shard.main_grad.shape == (N // 2, K)
        assert not shard.main_grad.any()
        assert shard.grad_added_to_main_grad is False
        assert not hasattr(shard, "overwrite_main_grad")
    assert layer.bias0 is bias0  # biases are not sharded
    assert dict(layer.named_parameters()).keys() >= {f"weight{e}" for e in range(E)}


@pytest.mark.usefixtures("rank_1_of_2")
def test_packed_weight_keeps_every_experts_lower_rows() -> None:
    layer = GroupedLinear(E, K, N, bias=False, single_grouped_weight=True)
    full = layer.weight.detach().clone()
    (group,) = shard_expert_weights(layer, grad_reduction="sum", main_grad_dtype=torch.float16)
    assert group.grad_reduction == "sum"
    assert isinstance(layer.weight, ShardedExpertWeight)
    assert layer.weight.shape == (E, N // 2, K)
    assert torch.equal(layer.weight.detach(), full[:, N // 2 :])
    assert layer.weight.main_grad is not None
    assert layer.weight.main_grad.dtype == torch.float16
    assert layer.weight.grad_buffer().shape == (E, N, K)
    assert layer.weight.grad_buffer().dtype == torch.float16


@pytest.mark.usefixtures("rank_1_of_2")
def test_mlp_fc1_and_fc2_each_become_a_group_and_leader_only_followers_are_plain() -> None:
    mlp = GroupedMLP(E, hidden_size=4, ffn_hidden_size=3)
    fc1, fc2 = shard_expert_weights(mlp, leader_only=True)
    assert fc1.names == ("fc1.weight0", "fc1.weight1", "fc1.weight2")
    assert fc2.names == ("fc2.weight0", "fc2.weight1", "fc2.weight2")
    assert fc1.full_shape == (6, 4)
    assert fc2.full_shape == (4, 3)
    for layer in (mlp.fc1, mlp.fc2):
        assert isinstance(layer.weight0, ShardedExpertWeight)
        for follower in (layer.weight1, layer.weight2):
            assert type(follower) is nn.Parameter
            assert not is_distributed_weight(follower)
            attributes = vars(follower)
            assert attributes["main_grad"].dtype == torch.float32
            assert attributes["grad_added_to_main_grad"] is False


@pytest.mark.usefixtures("rank_1_of_2")
def test_grad_buffer_is_fresh_full_size_and_typed_like_main_grad() -> None:
    layer = GroupedLinear(E, K, N, bias=False, dtype=torch.bfloat16)
    shard_expert_weights(layer)
    leader = layer.weight0
    assert isinstance(leader, ShardedExpertWeight)
    first, second = leader.grad_buffer(), leader.grad_buffer()
    assert first.shape == (N, K)
    assert first.dtype == torch.float32
    assert first.data_ptr() != second.data_ptr()
    leader.main_grad = None
    assert leader.grad_buffer().dtype == torch.bfloat16


@pytest.mark.usefixtures("rank_1_of_2")
def test_errors_name_the_parameter_and_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"'fc2.weight0' has 5 rows .* world size 2"):
        shard_expert_weights(GroupedMLP(E, hidden_size=5, ffn_hidden_size=2))
    layer = GroupedLinear(E, K, N, bias=False)
    layer.weight2 = nn.Parameter(torch.zeros(N, K + 1))
    with pytest.raises(
        ValueError, match=r"'weight2' is \(6, 5\) torch.float32 on cpu, expected \(6, 4\)"
    ):
        shard_expert_weights(layer)
    fsdp = GroupedLinear(E, K, N, bias=False)
    vars(fsdp.weight1)["__fsdp_param__"] = True
    with pytest.raises(ValueError, match=r"'weight1' is a Megatron-FSDP parameter"):
        shard_expert_weights(fsdp)
    sharded = GroupedLinear(E, K, N, bias=False)
    shard_expert_weights(sharded)
    with pytest.raises(ValueError, match=r"'weight0' is already a DistributedWeight"):
        shard_expert_weights(sharded)
    with pytest.raises(RuntimeError, match=r"ShardedExpertWeight cannot be deep-copied"):
        copy.deepcopy(sharded)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: -1)
    with pytest.raises(ValueError, match=r"not a member of process_group"):
        shard_expert_weights(GroupedLinear(E, K, N, bias=False), object())  # type: ignore[arg-type]


def test_arguments_are_checked_before_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = GroupedLinear(2, 4, 4, bias=False)
    with pytest.raises(TypeError, match=r"module is a list, expected a torch.nn.Module"):
        shard_expert_weights([layer])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"grad_reduction is 'avg', expected 'sum' or 'mean'"):
        shard_expert_weights(layer, grad_reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"main_grad_dtype is torch.int32, expected one of"):
        shard_expert_weights(layer, main_grad_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"module \(Linear\) contains no GroupedLinear"):
        shard_expert_weights(nn.Linear(4, 4))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized"):
        shard_expert_weights(layer)
    assert type(layer.weight0) is nn.Parameter  # nothing was replaced
    assert gather_full_weights(layer) == {}  # nothing sharded: no collective
