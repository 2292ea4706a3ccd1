"""The main_grad contract as resolved by plan_weight_grads."""

from __future__ import annotations

import pytest
import torch

from groupgrad.protocol import (
    WgradRoute,
    accumulate_grads_like_autograd,
    defer_weight_grads,
    dummy_wgrad,
    hold_post_accumulate_grad_hooks,
    plan_weight_grads,
    weight_grad_buffers,
    wgrad_route,
)
from groupgrad.protocol.testing import FakeDistributedWeight, make_fake_group

NAMES = ["weight0", "weight1", "weight2"]


def _params(count: int = 3, shape: tuple[int, ...] = (4, 3), dtype=torch.bfloat16, **attrs):
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(count):
        param = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
        for name, value in attrs.items():
            if name == "main_grad":
                value = torch.randn(shape, generator=gen).to(value)
            setattr(param, name, value)
        params.append(param)
    return params


def _plan(params, *, into_main_grad: bool = True, shape=(4, 3), **kwargs):
    return plan_weight_grads(
        params,
        shape=shape,
        compute_dtype=torch.bfloat16,
        device="cpu",
        wgrad_into_main_grad=into_main_grad,
        names=NAMES[: len(params)] if len(params) <= 3 else None,
        **kwargs,
    )


# ---------------------------------------------------------------- routes


def test_routes() -> None:
    assert wgrad_route(_params(), wgrad_into_main_grad=False) is WgradRoute.AUTOGRAD
    assert wgrad_route(_params(), wgrad_into_main_grad=True) is WgradRoute.MAIN_GRAD
    group = make_fake_group([torch.zeros(2, 2)] * 2, leader_only=True)
    assert wgrad_route(group, wgrad_into_main_grad=True) is WgradRoute.DISTRIBUTED
    assert wgrad_route(group, wgrad_into_main_grad=False) is WgradRoute.DISTRIBUTED


def test_fsdp_parameter_that_is_also_distributed_is_rejected() -> None:
    group = make_fake_group([torch.zeros(4, 3)] * 2)
    group[1].__fsdp_param__ = True  # type: ignore[union-attr]
    with pytest.raises(
        RuntimeError,
        match=r"'weight1' is both a Megatron-FSDP parameter .* and a DistributedWeight",
    ):
        _plan(group)


# ---------------------------------------------------------------- autograd route


def test_autograd_route_returns_fresh_buffers_in_the_parameter_dtype() -> None:
    params = _params(dtype=torch.float16)
    plan = _plan(params, into_main_grad=False)
    assert plan.route is WgradRoute.AUTOGRAD
    assert plan.accumulate is False
    assert plan.dtype is torch.float16
    for buffer in plan.buffers:
        buffer.fill_(1.0)
    out = plan.finish()
    assert all(o is b for o, b in zip(out, plan.buffers, strict=True))


@pytest.mark.parametrize("odd", ["none", "frozen", "fp32 grad", "non-leaf", "attribute", "shape"])
def test_the_autograd_route_reads_every_member_of_a_large_group(odd: str) -> None:
    """The one-pass reading of a uniform group still sees one odd member among 128."""
    params: list[torch.Tensor] = _params(count=128, dtype=torch.bfloat16)
    if odd == "frozen":
        params[77].requires_grad_(False)
    elif odd == "fp32 grad":
        params[77].grad_dtype = torch.float32  # type: ignore[attr-defined]
    elif odd == "non-leaf":
        params[77] = params[77] * 1
    elif odd == "attribute":
        params[77].overwrite_main_grad = True  # type: ignore[attr-defined]
    elif odd == "shape":
        params[77] = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"'weights\[77\]' has shape \(3, 4\), but the wgrad"):
            _plan(params, into_main_grad=False)
        return
    plan = _plan(params, into_main_grad=False)
    assert plan.route is WgradRoute.AUTOGRAD
    assert plan.dtype is (torch.float32 if odd == "fp32 grad" else torch.bfloat16)
    assert plan.packed is not None
    assert plan.gemm_out is plan.packed
    assert plan.packed.shape == (128, 4, 3)
    out = plan.finish()
    assert [o is None for o in out] == [odd == "frozen" and i == 77 for i in range(128)]
    assert all(o is b for o, b in zip(out, plan.buffers, strict=True) if o is not None)


def test_a_plain_parameter_of_another_shape_is_rejected() -> None:
    with pytest.raises(
        ValueError,
        match=r"parameter 'weight0' has shape \(4, 3\), but the wgrad GEMM produces \(3, 4\)",
    ):
        _plan(_params(), into_main_grad=False, shape=(3, 4))


# ---------------------------------------------------------------- main_grad route


def test_main_grad_is_the_gemm_output_and_accumulates_by_default() -> None:
    params = _params(main_grad=torch.float32)
    plan = _plan(params)
    assert plan.route is WgradRoute.MAIN_GRAD
    assert plan.accumulate is True
    assert plan.dtype is torch.float32
    assert all(b is p.main_grad for b, p in zip(plan.buffers, params, strict=True))
    assert plan.gemm_out == plan.buffers


def test_overwrite_flag_is_read_when_the_plan_is_made() -> None:
    params = _params(main_grad=torch.float32)
    for param in params:
        param.overwrite_main_grad = False
    first = _plan(params)
    for param in params:
        param.overwrite_main_grad = True
    second = _plan(params)
    assert first.accumulate is True
    assert second.accumulate is False


def test_mixed_overwrite_flags_in_one_group_are_rejected() -> None:
    params = _params(main_grad=torch.float32)
    params[1].overwrite_main_grad = True
    with pytest.raises(
        RuntimeError,
        match=r"overwrite_main_grad differs within one group \(weight0=False, weight1=True, weight2=False\)",
    ):
        _plan(params)


def test_missing_main_grad_names_the_parameter() -> None:
    params = _params(main_grad=torch.float32)
    del params[2].main_grad
    with pytest.raises(RuntimeError, match=r"parameter 'weight2' has no main_grad"):
        _plan(params)
    params[2].main_grad = None
    with pytest.raises(RuntimeError, match=r"parameter 'weight2' has no main_grad"):
        _plan(params)
    params[2].main_grad = 0.0  # not a buffer: said so, not "missing"
    with pytest.raises(
        RuntimeError,
        match=r"parameter 'weight2' has main_grad 0\.0 \(float\), expected a torch\.Tensor",
    ):
        _plan(params)


def test_main_grad_buffers_are_left_to_the_gemm_and_named_for_it() -> None:
    """Shape, dtype mix and overlap are the GEMM's checks (once, named by ``gemm_names``)."""
    params = _params(main_grad=torch.float32)
    params[1].main_grad = torch.zeros(3, 4)
    params[2].main_grad = params[0].main_grad
    plan = _plan(params)
    assert plan.buffers[1] is params[1].main_grad
    assert plan.buffers[2] is params[0].main_grad
    assert plan.gemm_names == ["weight0.main_grad", "weight1.main_grad", "weight2.main_grad"]
    for param in params:
        param.main_grad = torch.zeros(4, 3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"main_grad of 'weight0' has dtype torch\.int32"):
        _plan(params)


def test_a_plan_leaves_its_buffers_to_the_gemm_and_weight_grad_buffers_checks_its_own(
    monkeypatch,
) -> None:
    """The buffer rules run once per GEMM: by the kernels, not by the plan too.

    ``weight_grad_buffers`` (called by implementers without a GEMM) checks its
    buffers; a plan (whose GEMM checks them) does not, on any route.
    """
    import groupgrad.protocol._buffers as buffers_module

    runs = []
    real = buffers_module.check_grad_buffers
    monkeypatch.setattr(
        buffers_module, "check_grad_buffers", lambda *a, **k: runs.append(1) or real(*a, **k)
    )
    _plan(_params(main_grad=torch.float32))
    _plan(make_fake_group([torch.zeros(4, 3) for _ in range(3)]))
    _plan(_params(), into_main_grad=False)
    assert runs == []
    weight_grad_buffers(
        make_fake_group([torch.zeros(4, 3) for _ in range(3)]), (4, 3), torch.bfloat16, "cpu"
    )
    assert runs == [1]


def test_get_main_grad_is_preferred_on_fsdp_parameters_and_called_once() -> None:
    params = _params(main_grad=torch.float32)
    calls = [0] * 3
    fresh = [torch.empty(4, 3) for _ in range(3)]

    def getter(index: int):
        def get_main_grad() -> torch.Tensor:
            calls[index] += 1
            return fresh[index]

        return get_main_grad

    for index, param in enumerate(params):
        param.__fsdp_param__ = True
        param.get_main_grad = getter(index)
        param.overwrite_main_grad = True
    plan = _plan(params)
    assert calls == [1, 1, 1]
    assert all(b is f for b, f in zip(plan.buffers, fresh, strict=True))
    assert plan.accumulate is False
    plan.finish()
    assert calls == [1, 1, 1]


def test_finish_sets_the_flag_and_hands_out_a_zero_dummy_alias() -> None:
    params = _params(main_grad=torch.float32, grad_added_to_main_grad=False)
    plan = _plan(params)
    out = plan.finish()
    for param, dummy in zip(params, out, strict=True):
        assert param.grad_added_to_main_grad is True
        assert isinstance(dummy, torch.Tensor)
        assert dummy.shape == param.shape
        assert dummy.dtype == param.dtype
        assert dummy.grad_fn is None
        assert not dummy.requires_grad
        assert dummy._is_view() or dummy._base is None
        assert not dummy.any()
    # one cached buffer behind every dummy of the same shape and dtype
    assert len({d.data_ptr() for d in out if d is not None}) == 1


def test_without_the_flag_attribute_autograd_receives_none() -> None:
    params = _params(main_grad=torch.float32)
    assert _plan(params).finish() == [None, None, None]
    assert not hasattr(params[0], "grad_added_to_main_grad")


def test_a_dummy_written_through_an_alias_is_rezeroed_before_the_next_hand_out() -> None:
    params = _params(count=1, shape=(5, 7), main_grad=torch.float32, grad_added_to_main_grad=False)
    first = _plan(params, shape=(5, 7)).finish()[0]
    assert first is not None
    first.add_(3.0)  # a hook or weight decay adding into the .grad alias in place
    kept = _plan(params, shape=(5, 7)).finish()[0]
    assert kept is not None
    assert kept.data_ptr() == first.data_ptr()  # still one shared buffer, no new memory
    assert not kept.any()  # its version counter moved, so it was zeroed before the hand-out
    untouched_version = kept._version
    again = _plan(params, shape=(5, 7)).finish()[0]
    assert again is not None
    assert again._version == untouched_version  # nothing wrote: no needless re-zeroing


def test_zero_out_wgrad_rezeroes_even_writes_the_version_counter_cannot_see() -> None:
    params = _params(count=1, shape=(5, 9), main_grad=torch.float32, grad_added_to_main_grad=False)
    first = _plan(params, shape=(5, 9)).finish()[0]
    assert first is not None
    first.data.add_(3.0)  # e.g. a framework kernel writing through the storage, unversioned
    kept = _plan(params, shape=(5, 9)).finish()[0]
    assert kept is not None
    assert bool((kept == 3.0).all())  # unseen without zero_out_wgrad
    params[0].zero_out_wgrad = True
    again = _plan(params, shape=(5, 9)).finish()[0]
    assert again is not None
    assert not again.any()
    # its own buffer: writes the version counter cannot see never reach the others' dummy
    assert again.data_ptr() != first.data_ptr()
    again.data.add_(3.0)
    last = _plan(params, shape=(5, 9)).finish()[0]
    assert last is not None
    assert last.data_ptr() == again.data_ptr()
    assert not last.any()


def test_a_zero_out_dummy_shares_no_storage_with_the_others() -> None:
    # Catches: one buffer for parameters with and without zero_out_wgrad: a framework's
    # unversioned write into the former's dummy reached the latter's next hand-out. (A shape
    # of its own: the tests before leave the shared (5, 9) dummy written, as documented.)
    keep = _params(count=1, shape=(7, 11), main_grad=torch.float32, grad_added_to_main_grad=False)
    zero_out = _params(
        count=1, shape=(7, 11), main_grad=torch.float32, grad_added_to_main_grad=False
    )
    zero_out[0].zero_out_wgrad = True
    for step in range(2):
        written = _plan(zero_out, shape=(7, 11)).finish()[0]
        assert written is not None
        written.data.add_(1.0)  # unversioned, as a fused kernel writes
        handed = _plan(keep, shape=(7, 11)).finish()[0]
        assert handed is not None
        assert not handed.any(), step


def test_finish_twice_is_an_error() -> None:
    plan = _plan(_params(main_grad=torch.float32))
    plan.finish()
    with pytest.raises(RuntimeError, match=r"finish\(\) was called twice"):
        plan.finish()


def test_packed_parameter_writes_into_its_whole_main_grad() -> None:
    params = _params(count=1, shape=(6, 4, 3), main_grad=torch.float32)
    plan = _plan(params, shape=(6, 4, 3))
    assert plan.gemm_out is params[0].main_grad


@pytest.mark.parametrize("into_main_grad", [True, False], ids=["main_grad", "autograd"])
def test_a_group_of_one_expert_gives_the_gemm_its_expert_axis(into_main_grad: bool) -> None:
    # Catches: a one-member group's single (N, K) buffer handed over as the GEMM's packed
    # (E, N, K) out, as a packed weight's is: every one-expert layer failed its backward.
    params = _params(count=1, **({"main_grad": torch.float32} if into_main_grad else {}))
    out = _plan(params, into_main_grad=into_main_grad).gemm_out
    if into_main_grad:
        assert isinstance(out, list)
        assert len(out) == 1
        assert out[0] is params[0].main_grad
    else:
        assert isinstance(out, torch.Tensor)
        assert out.shape == (1, 4, 3)


# ---------------------------------------------------------------- distributed route


@pytest.mark.parametrize("leader_only", [False, True])
def test_distributed_route_writes_fp32_buffers_and_finalizes(leader_only: bool) -> None:
    group = make_fake_group(
        [torch.randn(4, 3).bfloat16() for _ in range(3)],
        leader_only=leader_only,
        main_grad_dtype=torch.float32,
    )
    plan = _plan(group)
    assert plan.route is WgradRoute.DISTRIBUTED
    assert plan.accumulate is False
    assert plan.dtype is torch.float32
    for index, buffer in enumerate(plan.buffers):
        buffer.fill_(float(index + 1))
    out = plan.finish()
    leader = group[0]
    assert isinstance(leader, FakeDistributedWeight)
    assert leader.calls["finalize_group_grads"] == 1
    received = leader.finalized[0]
    assert [g.dtype for g in received] == [torch.float32] * 3
    assert [float(g[0, 0]) for g in received] == [1.0, 2.0, 3.0]
    assert len(out) == 3
    for member in group:
        assert bool((member.main_grad != 0).all())  # type: ignore[attr-defined]


# ---------------------------------------------------------------- deferred wgrad


def test_deferred_main_grad_hands_over_at_backward_and_writes_later() -> None:
    params = _params(main_grad=torch.float32, grad_added_to_main_grad=False)
    now = defer_weight_grads(params, wgrad_into_main_grad=True)
    assert all(p.grad_added_to_main_grad for p in params)
    assert all(isinstance(d, torch.Tensor) and not d.any() for d in now)
    plan = _plan(params, deferred=True)
    assert plan.accumulate is True
    fired: list[int] = []
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(lambda p, i=index: fired.append(i))
    grads = plan.finish()
    assert grads == [None, None, None]
    accumulate_grads_like_autograd(params, grads)
    assert fired == [0, 1, 2]
    assert all(p.grad is None for p in params)


def test_deferred_autograd_route_accumulates_into_grad_and_fires_hooks() -> None:
    params = _params(dtype=torch.float32)
    assert defer_weight_grads(params, wgrad_into_main_grad=False) == [None, None, None]
    fired: list[int] = []
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(lambda p, i=index: fired.append(i))
    params[1].grad = torch.ones(4, 3)

    plan = _plan(params, into_main_grad=False, deferred=True)
    for buffer in plan.buffers:
        buffer.fill_(2.0)
    accumulate_grads_like_autograd(params, plan.finish())

    assert fired == [0, 1, 2]
    assert bool((params[0].grad == 2.0).all())
    assert bool((params[1].grad == 3.0).all())
    with pytest.raises(ValueError, match="grads has 1 entries but the group has 3 weights"):
        accumulate_grads_like_autograd(params, [None])


def test_deferred_hooks_run_per_parameter_and_every_hold_goes_back_when_one_raises() -> None:
    # Catches: run_hooks flags applied to the wrong parameter, and a raising hook leaving the
    # holds of the parameters after it in place for good (autograd never ran their hooks again).
    params = _params(dtype=torch.float32)
    fired: list[int] = []

    def hook(p: torch.Tensor, i: int) -> None:
        fired.append(i)
        if i == 0 and fired.count(0) == 1:
            raise KeyError("hook 0 failed")

    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(lambda p, i=index: hook(p, i))
    hold_post_accumulate_grad_hooks(params)
    with pytest.raises(KeyError, match="hook 0 failed"):
        accumulate_grads_like_autograd(params, [None] * 3)
    assert fired == [0]
    for param in params:  # autograd runs the hooks again: no hold is left
        (param * 1).sum().backward()
    assert fired == [0, 0, 1, 2]
    fired.clear()
    hold_post_accumulate_grad_hooks(params)
    accumulate_grads_like_autograd(params, [None] * 3, run_hooks=[False, True, False])
    assert fired == [1]
    with pytest.raises(ValueError, match="run_hooks has 2 entries but the group has 3 weights"):
        accumulate_grads_like_autograd(params, [None] * 3, run_hooks=[True, True])


def test_a_main_grad_an_earlier_plan_fetched_is_taken_without_calling_the_getter() -> None:
    # Catches: get_main_grad() called again for a member the caller already fetched a buffer
    # for in this backward (an owner may hand out a fresh buffer per call).
    params = _params(main_grad=torch.float32)
    calls: list[int] = []
    for index, param in enumerate(params):
        param.__fsdp_param__ = True  # type: ignore[attr-defined]
        param.get_main_grad = lambda i=index: calls.append(i) or torch.zeros(4, 3)  # type: ignore[attr-defined]
    known = torch.ones(4, 3)
    plan = plan_weight_grads(
        params, shape=(4, 3), compute_dtype=torch.bfloat16, device="cpu",
        wgrad_into_main_grad=True, fetched={1: known},
    )  # fmt: skip
    assert calls == [0, 2]
    assert plan.buffers[1] is known


def test_deferred_distributed_route_hands_autograd_nothing_at_backward() -> None:
    group = make_fake_group([torch.randn(4, 3) for _ in range(2)], main_grad_dtype=torch.float32)
    assert defer_weight_grads(group, wgrad_into_main_grad=True) == [None, None]
    leader = group[0]
    assert isinstance(leader, FakeDistributedWeight)
    assert leader.calls["finalize_group_grads"] == 0


def test_attribute_readers_for_implementers() -> None:
    from groupgrad.protocol import (
        fetch_main_grad,
        is_fsdp_param,
        main_grad_or_none,
        mark_grad_added,
        overwrites_main_grad,
        rezeroes_dummy,
        takes_grad_added_flag,
    )

    param = torch.nn.Parameter(torch.zeros(2, 3))
    assert main_grad_or_none(param) is None
    assert not overwrites_main_grad(param)
    assert not rezeroes_dummy(param)
    assert not takes_grad_added_flag(param)
    assert not is_fsdp_param(param)
    param.main_grad = torch.ones(2, 3)
    param.overwrite_main_grad = 1
    param.zero_out_wgrad = True
    param.grad_added_to_main_grad = False
    assert main_grad_or_none(param) is param.main_grad
    assert fetch_main_grad(param, "w") is param.main_grad
    assert overwrites_main_grad(param)
    assert rezeroes_dummy(param)
    assert takes_grad_added_flag(param)
    mark_grad_added(param)
    assert param.grad_added_to_main_grad is True


def test_gemm_names_follow_the_form_of_gemm_out() -> None:
    """One name per listed buffer; one for the packed tensor of fresh buffers (no per-member work)."""
    params = _params(main_grad=torch.float32)
    params[1].requires_grad_(False)
    assert _plan(params).gemm_names == [
        "weight0.main_grad",
        "weight1 (frozen: scratch)",
        "weight2.main_grad",
    ]
    plan = _plan(_params(), into_main_grad=False)
    assert isinstance(plan.gemm_out, torch.Tensor)
    assert plan.gemm_names == ["weight0…weight2 wgrad"]
    packed = _plan(_params(1, shape=(2, 4, 3)), into_main_grad=False, shape=(2, 4, 3))
    assert packed.gemm_names == ["weight0 wgrad"]


def test_a_follower_whose_main_grad_the_group_would_round_is_refused() -> None:
    # Catches: a distributed group whose leader has no main_grad (frozen: it needs none)
    # typing its plain followers' scratch bf16 (weight_grad_dtype reads the leader's), while
    # their fp32 main_grads receive the reduce: every value rounded to bf16, no error.
    group = make_fake_group(
        [torch.randn(4, 3, dtype=torch.bfloat16) for _ in range(3)],
        leader_only=True,
        main_grad_dtype=torch.float32,
    )
    group[0].requires_grad_(False)
    del group[0].main_grad
    with pytest.raises(
        RuntimeError,
        match=r"^weight1\.main_grad is torch\.float32, but the distributed group led by weight0 "
        r"types its followers' wgrads torch\.bfloat16 .*give weight0 a main_grad of torch\.float32",
    ):
        _plan(group)
    group[0].main_grad = torch.zeros(4, 3)  # fp32, never written (frozen): the scratch follows
    plan = _plan(group)
    assert [b.dtype for b in plan.gemm_out] == [torch.float32] * 3


def test_adding_like_autograd_never_writes_into_a_dummy_kept_as_grad() -> None:
    # Catches: accumulate_grads_like_autograd adding into a .grad that is an alias of the
    # shared dummy autograd kept: the gradient landed in every parameter handed that dummy.
    params = _params(2, dtype=torch.float32)
    for param in params:
        param.grad = dummy_wgrad(param)  # as AccumulateGrad keeps a handed-out dummy
    assert params[0].grad.data_ptr() == params[1].grad.data_ptr()  # the premise: one storage
    grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    accumulate_grads_like_autograd(params[:1], [grad])
    assert torch.equal(params[0].grad, grad)
    assert not params[1].grad.any()
    assert not dummy_wgrad(params[1]).any()
