"""Bad inputs to the protocol's dispatchers and helpers: a named error, nothing written.

Every case watches the ``main_grad`` buffers, flags and weights involved
(NaN sentinels in ``main_grad``) and checks that a rejected call changed
none of them, that the exception type is the documented one, and that the
message names the argument or member and the value.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from groupgrad.protocol import (
    accumulate_grads_like_autograd,
    deliver_to_main_grad,
    finalize_weight_grads,
    is_distributed_weight,
    materialize_weight_for_forward,
    plan_weight_grads,
    weight_grad_buffers,
)
from groupgrad.protocol.testing import FakeDistributedWeight, make_fake_group


def _param(*shape: int, main_grad: bool = True) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.randn(*shape))
    if main_grad:
        param.main_grad = torch.full(shape, float("nan"))
        param.grad_added_to_main_grad = False
    return param


def _state(tensors: list[Tensor]) -> list[tuple[Tensor, object, object]]:
    return [
        (
            t.detach().clone(),
            getattr(t, "main_grad", None) is not None and t.main_grad.clone(),
            getattr(t, "grad_added_to_main_grad", None),
        )
        for t in tensors
    ]


def _same(before, after) -> bool:
    for (w0, mg0, flag0), (w1, mg1, flag1) in zip(before, after, strict=True):
        if not torch.equal(w0, w1) or flag0 != flag1:
            return False
        if isinstance(mg0, Tensor) and not torch.equal(mg0.isnan(), mg1.isnan()):
            return False
    return True


class _NoMethods(torch.nn.Parameter):
    is_distributed_weight = True


class _Claims:
    is_distributed_weight = True


def _leader_returning(result: object) -> list[Tensor]:
    group = make_fake_group([torch.randn(4, 3) for _ in range(3)], main_grad_dtype=torch.float32)
    leader = group[0]
    assert isinstance(leader, FakeDistributedWeight)
    leader.materialize_group_for_forward = lambda: result  # type: ignore[method-assign]
    leader.finalize_group_grads = lambda wgrads: result  # type: ignore[method-assign]
    return group


def _buffer_provider(make: Callable[[], Tensor | None], member: int = 1) -> list[Tensor]:
    group = make_fake_group([torch.randn(4, 3) for _ in range(3)], main_grad_dtype=torch.float32)
    target = group[member]
    assert isinstance(target, FakeDistributedWeight)
    target.grad_buffer = make  # type: ignore[method-assign]
    return group


def _fsdp_and_distributed() -> list[Tensor]:
    group = make_fake_group([torch.randn(4, 3) for _ in range(2)])
    group[1].__fsdp_param__ = True  # type: ignore[attr-defined]
    return group


_SHARED = torch.zeros(3, 4, 3)


def _sharing() -> list[Tensor]:
    group = make_fake_group([torch.randn(4, 3) for _ in range(3)], main_grad_dtype=torch.float32)
    for member, view in zip(group, (_SHARED[0], _SHARED[0], _SHARED[2]), strict=True):
        member.grad_buffer = lambda v=view: v  # type: ignore[method-assign]
    return group


def _plan(weights: list[Tensor], **overrides: object):
    options: dict[str, object] = {
        "shape": (4, 3),
        "compute_dtype": torch.float32,
        "device": "cpu",
        "wgrad_into_main_grad": True,
    }
    options.update(overrides)
    return lambda: plan_weight_grads(weights, **options)  # type: ignore[arg-type]


CASES: list[tuple[str, Callable[[], list[Tensor]], Callable[[list[Tensor]], object], type, str]] = [
    ("claims-but-not-a-tensor", list, lambda g: is_distributed_weight(_Claims()), TypeError,
     r"_Claims object claims is_distributed_weight=True but is not a torch\.Tensor"),
    ("leader-without-methods", lambda: [_NoMethods(torch.randn(4, 3))],
     lambda g: materialize_weight_for_forward(g), TypeError,
     r"weights\[0\] \(_NoMethods\) claims is_distributed_weight=True but has no callable materialize_group_for_forward\(\)"),
    ("leader-materializes-too-few", lambda: _leader_returning([torch.randn(4, 3)] * 2),
     lambda g: materialize_weight_for_forward(g), RuntimeError,
     r"materialize_group_for_forward\(\) returned 2 entries for a group of 3 weights"),
    ("leader-materializes-none", lambda: _leader_returning(None),
     lambda g: materialize_weight_for_forward(g), RuntimeError,
     r"weights\[0\]\.materialize_group_for_forward\(\) returned None"),
    ("leader-materializes-a-string", lambda: _leader_returning("w"),
     lambda g: materialize_weight_for_forward(g), TypeError,
     r"materialize_group_for_forward\(\) returned a str; expected a tensor"),
    ("finalize-given-too-few", lambda: make_fake_group([torch.randn(4, 3) for _ in range(3)]),
     lambda g: finalize_weight_grads(g, [torch.zeros(4, 3)] * 2), ValueError,
     r"wgrads has 2 entries but the group has 3 weights"),
    ("finalize-answers-too-many", lambda: _leader_returning([torch.zeros(4, 3)] * 4),
     lambda g: finalize_weight_grads(g, [torch.zeros(4, 3)] * 3), RuntimeError,
     r"finalize_group_grads\(\) returned 4 entries for a group of 3 weights; expected exactly 3"),
    ("grad-buffer-shape", lambda: _buffer_provider(lambda: torch.zeros(3, 4)),
     lambda g: weight_grad_buffers(g, (4, 3), torch.float32, "cpu"), RuntimeError,
     r"member 1 has shape \(3, 4\), expected \(4, 3\)"),
    ("grad-buffer-device", lambda: _buffer_provider(lambda: torch.zeros(4, 3, device="meta"), 2),
     lambda g: weight_grad_buffers(g, (4, 3), torch.float32, "cpu"), RuntimeError,
     r"member 2 is on device meta, expected cpu"),
    ("grad-buffer-dtype", lambda: _buffer_provider(lambda: torch.zeros(4, 3, dtype=torch.bfloat16)),
     lambda g: weight_grad_buffers(g, (4, 3), torch.float32, "cpu"), RuntimeError,
     r"member 1 has dtype torch\.bfloat16, expected torch\.float32 like member 0"),
    ("grad-buffer-not-a-tensor", lambda: _buffer_provider(lambda: [0.0] * 12),  # type: ignore[arg-type,return-value]
     lambda g: weight_grad_buffers(g, (4, 3), torch.float32, "cpu"), RuntimeError,
     r"member 1 is a list, expected a torch\.Tensor"),
    ("grad-buffers-overlap", _sharing,
     lambda g: weight_grad_buffers(g, (4, 3), torch.float32, "cpu"), RuntimeError,
     r"member 0 and member 1 overlap in memory"),
    ("names-count", lambda: [_param(4, 3), _param(4, 3)],
     lambda g: _plan(g, names=["w0"])(), ValueError,
     r"names has 1 entries but the group has 2 weights"),
    ("plain-shape", lambda: [_param(4, 3), _param(4, 4)],
     lambda g: _plan(g, wgrad_into_main_grad=False)(), ValueError,
     r"parameter 'weights\[1\]' has shape \(4, 4\), but the wgrad GEMM produces \(4, 3\)"),
    ("two-owners", _fsdp_and_distributed, lambda g: _plan(g)(), RuntimeError,
     r"parameter 'weights\[1\]' is both a Megatron-FSDP parameter \(__fsdp_param__\) and a DistributedWeight"),
    ("get-main-grad-not-a-tensor", lambda: [_param(4, 3)],
     lambda g: (setattr(g[0], "__fsdp_param__", True), setattr(g[0], "get_main_grad", lambda: 3.0), _plan(g)()),
     RuntimeError, r"parameter 'weights\[0\]': get_main_grad\(\) returned float, expected a torch\.Tensor"),
    ("accumulate-count", lambda: [_param(4, 3, main_grad=False)],
     lambda g: accumulate_grads_like_autograd(g, []), ValueError,
     r"grads has 0 entries but the group has 1 weights"),
    ("accumulate-device", lambda: [_param(4, 3, main_grad=False)],
     lambda g: accumulate_grads_like_autograd(g, [torch.zeros(4, 3, device="meta")]), RuntimeError,
     r"grads\[0\] is on meta, expected the parameter's device cpu"),
    ("accumulate-shape", lambda: [_param(4, 3, main_grad=False), _param(4, 3, main_grad=False)],
     lambda g: accumulate_grads_like_autograd(g, [torch.ones(4, 3), torch.ones(3, 4)]), RuntimeError,
     r"grads\[1\] has shape \(3, 4\), expected the parameter's shape \(4, 3\)"),
    ("deliver-shape", lambda: [_param(4, 3)],
     lambda g: deliver_to_main_grad(g[0], torch.ones(12), "w0"), RuntimeError,
     r"gradient for 'w0' has shape \(12,\), expected its main_grad's shape \(4, 3\)"),
    ("deliver-without-main-grad", lambda: [_param(4, 3, main_grad=False)],
     lambda g: deliver_to_main_grad(g[0], torch.ones(4, 3), "w0"), RuntimeError,
     r"parameter 'w0' has no main_grad"),
    ("group-empty", list, lambda g: materialize_weight_for_forward([]), ValueError,
     r"weights is empty; expected at least one weight"),
    ("group-member-not-a-tensor", list, lambda g: materialize_weight_for_forward([torch.zeros(2), 3]),
     TypeError, r"weights\[1\] is a int, expected a torch\.Tensor"),
    ("group-is-a-string", list, lambda g: materialize_weight_for_forward("w"), TypeError,
     r"weights must be a torch\.Tensor or a sequence of tensors, got str"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "build", "call", "error", "match"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_is_named_and_writes_nothing(name, build, call, error, match) -> None:
    group = build()
    before = _state(group)
    with pytest.raises(error, match=match):
        call(group)
    assert _same(before, _state(group)), f"{name}: a rejected call wrote into the group"
    assert all(t.grad is None for t in group)
