"""The DistributedWeight protocol and its dispatchers."""

from __future__ import annotations

import pytest
import torch

from groupgrad.protocol import (
    DistributedWeight,
    finalize_weight_grads,
    is_distributed_weight,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
    weight_grad_buffers,
    weight_grad_dtype,
)
from groupgrad.protocol.testing import FakeDistributedWeight, make_fake_group


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _Claimer:
    is_distributed_weight = True


class _BareClaimer(torch.Tensor):
    """A tensor that claims the capability but implements none of it."""

    is_distributed_weight = True


# ---------------------------------------------------------------- is_distributed_weight


def test_plain_tensors_and_parameters_are_not_distributed() -> None:
    assert is_distributed_weight(torch.zeros(2)) is False
    assert is_distributed_weight(torch.nn.Parameter(torch.zeros(2))) is False
    assert is_distributed_weight(object()) is False


def test_fake_leader_is_distributed_and_satisfies_the_protocol() -> None:
    leader = FakeDistributedWeight(_randn(3, 2))
    assert is_distributed_weight(leader) is True
    assert isinstance(leader, DistributedWeight)
    assert not isinstance(torch.zeros(2), DistributedWeight)


def test_non_tensor_claiming_the_capability_is_a_type_error() -> None:
    with pytest.raises(
        TypeError,
        match=r"_Claimer object claims is_distributed_weight=True but is not a torch\.Tensor",
    ):
        is_distributed_weight(_Claimer())


def test_attribute_set_on_a_parameter_counts_as_a_claim() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    param.is_distributed_weight = False  # type: ignore[attr-defined]
    assert is_distributed_weight(param) is False
    param.is_distributed_weight = True  # type: ignore[attr-defined]
    assert is_distributed_weight(param) is True


# ---------------------------------------------------------------- materialize


@pytest.mark.parametrize(
    "materialize", [materialize_weight_for_forward, materialize_weight_for_backward]
)
def test_plain_weights_pass_through_as_the_same_objects(materialize) -> None:
    weights = [torch.nn.Parameter(_randn(3, 2, seed=i)) for i in range(3)]
    out = materialize(weights)
    assert isinstance(out, list)
    assert len(out) == 3
    assert all(a is b for a, b in zip(out, weights, strict=True))
    bare = torch.nn.Parameter(_randn(3, 2))
    assert materialize(bare)[0] is bare
    assert materialize(tuple(weights))[1] is weights[1]


@pytest.mark.parametrize("leader_only", [False, True])
def test_leader_materializes_the_whole_group_once(leader_only: bool) -> None:
    values = [_randn(3, 2, seed=i) for i in range(4)]
    group = make_fake_group(values, leader_only=leader_only)
    leader = group[0]
    assert isinstance(leader, FakeDistributedWeight)

    forward = materialize_weight_for_forward(group)
    backward = materialize_weight_for_backward(group)

    assert leader.calls["materialize_group_for_forward"] == 1
    assert leader.calls["materialize_group_for_backward"] == 1
    for follower in group[1:]:
        if isinstance(follower, FakeDistributedWeight):
            assert follower.calls["materialize_group_for_forward"] == 0
    assert len(forward) == len(backward) == 4
    for value, fwd, bwd in zip(values, forward, backward, strict=True):
        torch.testing.assert_close(fwd, 2 * value)
        torch.testing.assert_close(bwd, 4 * value)


def test_one_member_group_may_materialize_a_bare_tensor() -> None:
    class BareLeader(FakeDistributedWeight):
        def materialize_group_for_forward(self) -> torch.Tensor:  # type: ignore[override]
            return self.detach() * 3

    leader = BareLeader(_randn(2, 2))
    out = materialize_weight_for_forward(leader)
    assert len(out) == 1
    torch.testing.assert_close(out[0], 3 * leader.detach())


def test_materialization_of_the_wrong_length_is_rejected() -> None:
    group = make_fake_group([_randn(2, 2, seed=i) for i in range(3)])
    leader = group[0]
    assert isinstance(leader, FakeDistributedWeight)
    leader.group = group[:2]
    with pytest.raises(RuntimeError, match=r"returned 2 entries for a group of 3 weights"):
        materialize_weight_for_forward(group)


def test_claiming_leader_without_methods_is_a_type_error() -> None:
    leader = torch.zeros(2, 2).as_subclass(_BareClaimer)
    with pytest.raises(TypeError, match=r"has no callable materialize_group_for_forward\(\)"):
        materialize_weight_for_forward([leader, torch.zeros(2, 2)])


def test_bad_weights_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="weights is empty"):
        materialize_weight_for_forward([])
    with pytest.raises(TypeError, match=r"weights\[1\] is a str, expected a torch\.Tensor"):
        materialize_weight_for_forward([torch.zeros(1), "w"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"weights must be a torch\.Tensor or a sequence"):
        materialize_weight_for_forward(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- finalize


def test_plain_group_gets_its_wgrads_back_unchanged() -> None:
    weights = [torch.nn.Parameter(_randn(2, 2, seed=i)) for i in range(2)]
    wgrads = [_randn(2, 2, seed=5), _randn(2, 2, seed=6)]
    assert finalize_weight_grads(weights, wgrads) is wgrads


def test_one_member_group_finalizes_a_bare_tensor() -> None:
    leader = FakeDistributedWeight(_randn(2, 3))
    received: list[object] = []
    leader.finalize_group_grads = lambda wgrads: received.append(wgrads)  # type: ignore[method-assign]
    grad = _randn(2, 3, seed=1)
    out = finalize_weight_grads([leader], [grad])
    assert len(received) == 1
    assert received[0] is grad
    assert out == [None]


def test_multi_member_group_finalizes_a_list() -> None:
    group = make_fake_group([_randn(2, 3, seed=i) for i in range(3)], leader_only=True)
    received: list[object] = []
    leader = group[0]
    leader.finalize_group_grads = lambda wgrads: received.append(wgrads) or wgrads  # type: ignore[method-assign,union-attr]
    grads = tuple(_randn(2, 3, seed=10 + i) for i in range(3))
    out = finalize_weight_grads(group, grads)
    assert isinstance(received[0], list)
    assert len(received[0]) == 3
    assert all(a is b for a, b in zip(out, grads, strict=True))


@pytest.mark.parametrize("members", [1, 3])
def test_async_none_expands_to_one_none_per_member(members: int) -> None:
    group = make_fake_group([_randn(2, 2, seed=i) for i in range(members)])
    leader = group[0]
    assert isinstance(leader, FakeDistributedWeight)
    leader.finalize_returns = "none"
    grads = [_randn(2, 2, seed=7 + i) for i in range(members)]
    assert finalize_weight_grads(group, grads) == [None] * members


@pytest.mark.parametrize("members", [1, 4])
def test_dummies_come_back_one_per_member(members: int) -> None:
    group = make_fake_group([_randn(2, 2, seed=i) for i in range(members)])
    out = finalize_weight_grads(group, [torch.ones(2, 2)] * members)
    assert len(out) == members
    assert all(isinstance(t, torch.Tensor) and not t.any() for t in out)


def test_finalize_answer_of_the_wrong_length_is_rejected() -> None:
    group = make_fake_group([_randn(2, 2, seed=i) for i in range(3)])
    group[0].finalize_group_grads = lambda wgrads: wgrads[:2]  # type: ignore[union-attr,method-assign]
    with pytest.raises(
        RuntimeError, match=r"finalize_group_grads\(\) returned 2 entries for a group of 3"
    ):
        finalize_weight_grads(group, [torch.ones(2, 2)] * 3)


def test_finalize_with_the_wrong_number_of_wgrads_is_rejected() -> None:
    group = make_fake_group([_randn(2, 2, seed=i) for i in range(3)])
    with pytest.raises(ValueError, match="wgrads has 2 entries but the group has 3 weights"):
        finalize_weight_grads(group, [torch.ones(2, 2)] * 2)


# ---------------------------------------------------------------- weight_grad_dtype


def test_weight_grad_dtype_follows_the_leaders_main_grad() -> None:
    group = make_fake_group([_randn(2, 2)], main_grad_dtype=torch.float32)
    assert weight_grad_dtype(group, torch.bfloat16) is torch.float32
    group[0].main_grad = None  # type: ignore[attr-defined]
    assert weight_grad_dtype(group, torch.bfloat16) is torch.bfloat16
    assert weight_grad_dtype(make_fake_group([_randn(2, 2)]), torch.float16) is torch.float16


def test_weight_grad_dtype_of_a_plain_group_is_the_compute_dtype() -> None:
    param = torch.nn.Parameter(_randn(2, 2))
    param.main_grad = torch.zeros(2, 2)  # type: ignore[attr-defined]
    assert weight_grad_dtype([param], torch.bfloat16) is torch.bfloat16


# ---------------------------------------------------------------- weight_grad_buffers


def test_plain_group_gets_one_packed_buffer_as_views() -> None:
    weights = [torch.nn.Parameter(_randn(4, 3, seed=i)) for i in range(5)]
    buffers = weight_grad_buffers(weights, (4, 3), torch.bfloat16, "cpu")
    assert len(buffers) == 5
    base = buffers[0]._base
    assert base is not None
    assert tuple(base.shape) == (5, 4, 3)
    for index, buffer in enumerate(buffers):
        assert buffer.dtype is torch.bfloat16
        assert tuple(buffer.shape) == (4, 3)
        assert buffer._base is base
        assert buffer.data_ptr() == base[index].data_ptr()


def test_distributed_members_give_their_own_buffers() -> None:
    group = make_fake_group([_randn(4, 3, seed=i) for i in range(3)], main_grad_dtype=torch.float32)
    buffers = weight_grad_buffers(group, (4, 3), torch.bfloat16, torch.device("cpu"))
    assert [b.dtype for b in buffers] == [torch.float32] * 3
    for member in group:
        assert isinstance(member, FakeDistributedWeight)
        assert member.calls["grad_buffer"] == 1


def test_leader_only_group_gives_followers_scratch_of_the_wgrad_dtype() -> None:
    group = make_fake_group(
        [_randn(4, 3, seed=i).bfloat16() for i in range(4)],
        leader_only=True,
        main_grad_dtype=torch.float32,
    )
    buffers = weight_grad_buffers(group, (4, 3), torch.bfloat16, "cpu")
    assert len(buffers) == 4
    assert all(b.dtype is torch.float32 for b in buffers)
    assert all(tuple(b.shape) == (4, 3) for b in buffers)
    # followers' scratch does not alias the leader's buffer or each other
    ptrs = {b.data_ptr() for b in buffers}
    assert len(ptrs) == 4


def test_members_without_a_buffer_get_scratch() -> None:
    group = make_fake_group([_randn(4, 3, seed=i) for i in range(2)])
    follower = group[1]
    assert isinstance(follower, FakeDistributedWeight)
    follower.provides_grad_buffer = False
    buffers = weight_grad_buffers(group, (4, 3), torch.float32, "cpu")
    assert len(buffers) == 2


def test_buffer_of_the_wrong_shape_names_the_member() -> None:
    group = make_fake_group([_randn(4, 3, seed=i) for i in range(3)])
    group[2].grad_buffer = lambda: torch.empty(3, 4)  # type: ignore[union-attr,method-assign]
    with pytest.raises(RuntimeError, match=r"member 2 has shape \(3, 4\), expected \(4, 3\)"):
        weight_grad_buffers(group, (4, 3), torch.float32, "cpu")


def test_buffer_on_the_wrong_device_names_the_member() -> None:
    group = make_fake_group([_randn(4, 3, seed=i) for i in range(2)])
    group[1].grad_buffer = lambda: torch.empty(4, 3, device="meta")  # type: ignore[union-attr,method-assign]
    with pytest.raises(RuntimeError, match=r"member 1 is on device meta, expected cpu"):
        weight_grad_buffers(group, (4, 3), torch.float32, "cpu")


def test_buffers_of_different_dtypes_are_rejected() -> None:
    # The leader's buffer is fp32 but it has no main_grad, so scratch for the
    # plain follower is typed by the compute dtype: the group would mix dtypes.
    group = make_fake_group([_randn(4, 3, seed=i) for i in range(2)], leader_only=True)
    group[0].grad_buffer = lambda: torch.empty(4, 3, dtype=torch.float32)  # type: ignore[union-attr,method-assign]
    with pytest.raises(
        RuntimeError,
        match=r"member 1 has dtype torch\.bfloat16, expected torch\.float32 like member 0",
    ):
        weight_grad_buffers(group, (4, 3), torch.bfloat16, "cpu")


def test_members_sharing_storage_are_rejected() -> None:
    shared = torch.empty(4, 3)
    group = make_fake_group([_randn(4, 3, seed=i) for i in range(3)])
    group[0].grad_buffer = lambda: shared  # type: ignore[union-attr,method-assign]
    group[2].grad_buffer = lambda: shared  # type: ignore[union-attr,method-assign]
    with pytest.raises(RuntimeError, match=r"member 0 and member 2 overlap in memory"):
        weight_grad_buffers(group, (4, 3), torch.float32, "cpu")


def test_partially_overlapping_views_are_rejected() -> None:
    storage = torch.empty(20)
    group = make_fake_group([_randn(4, 3, seed=i) for i in range(2)])
    group[0].grad_buffer = lambda: storage[0:12].view(4, 3)  # type: ignore[union-attr,method-assign]
    group[1].grad_buffer = lambda: storage[8:20].view(4, 3)  # type: ignore[union-attr,method-assign]
    with pytest.raises(RuntimeError, match=r"member 0 and member 1 overlap"):
        weight_grad_buffers(group, (4, 3), torch.float32, "cpu")
    # adjacent, non-overlapping views of one storage are fine
    big = torch.empty(24)
    group[0].grad_buffer = lambda: big[0:12].view(4, 3)  # type: ignore[union-attr,method-assign]
    group[1].grad_buffer = lambda: big[12:24].view(4, 3)  # type: ignore[union-attr,method-assign]
    assert len(weight_grad_buffers(group, (4, 3), torch.float32, "cpu")) == 2
