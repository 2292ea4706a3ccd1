"""shard_expert_weights in one process: which rows each rank keeps, and the attributes.

Sharding itself communicates nothing, so these tests pretend to be rank 1 of
2 (``torch.distributed``'s rank queries patched); everything that runs a
collective is tested with real processes in ``test_sharded_training.py`` and
``test_training_loop.py``; bad inputs in ``test_bad_inputs.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from groupgrad.integrations.torch_distributed import (
    ExpertShardGroup,
    ShardedExpertWeight,
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
def test_grad_buffer_is_fresh_full_size_and_typed_like_the_groups_main_grad() -> None:
    layer = GroupedLinear(E, K, N, bias=False, dtype=torch.bfloat16)
    (group,) = shard_expert_weights(layer, main_grad_dtype=torch.float16)
    leader = layer.weight0
    assert isinstance(leader, ShardedExpertWeight)
    first, second = leader.grad_buffer(), leader.grad_buffer()
    assert first.shape == (N, K)
    assert first.dtype == group.main_grad_dtype == torch.float16
    assert first.data_ptr() != second.data_ptr()
    leader.main_grad = None  # e.g. a frozen leader that needs none: one dtype across the group
    assert leader.grad_buffer().dtype == layer.weight1.grad_buffer().dtype == torch.float16
