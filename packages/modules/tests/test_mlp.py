"""GroupedMLP beyond the matrix: the unfused reference, dtypes, empty experts, saving, errors.

The unfused reference is per-expert ``F.linear`` + PyTorch's SwiGLU under
autograd (fp64 for the truth; in bf16 for PyTorch's own bf16 error).

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from groupgrad.modules import GroupedLinear, GroupedMLP
from groupgrad.protocol.testing import FakeDistributedWeight, make_fake_group
from groupgrad_testsupport import (
    assert_group_backward_ran_once,
    attach_main_grads,
    backward_allocations,
)
from groupgrad_testsupport.offload import offloaded_saved_tensors

E, H, FFN = 4, 16, 8


def _params(module: GroupedMLP) -> dict[str, list[torch.Tensor]]:
    """Each layer's weights and biases as per-expert tensors (views of packed parameters)."""
    out: dict[str, list[torch.Tensor]] = {}
    for layer in ("fc1", "fc2"):
        linear: GroupedLinear = getattr(module, layer)
        if linear.single_grouped_weight:
            out[f"{layer}.w"] = list(linear.weight.unbind(0))
            out[f"{layer}.b"] = list(linear.bias.unbind(0)) if linear.use_bias else []
        else:
            out[f"{layer}.w"] = [getattr(linear, n) for n in linear.weight_names]
            out[f"{layer}.b"] = [getattr(linear, n) for n in linear.bias_names]
    return out


def _unfused(x, probs, w1s, b1s, w2s, b2s, splits) -> torch.Tensor:
    """Two per-expert linears and PyTorch's SwiGLU, differentiable by autograd."""
    ys = []
    for e, x_e in enumerate(x.split(list(splits))):
        h = F.linear(x_e, w1s[e], b1s[e] if b1s else None)
        gate, up = h.chunk(2, dim=1)
        a = F.silu(gate) * up
        if probs is not None:
            a = a * probs.split(list(splits))[e][:, None]
        ys.append(F.linear(a, w2s[e], b2s[e] if b2s else None))
    return torch.cat(ys)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """fp32 against the fp64 reference: tight."""
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5, msg=what or None)


def _leaf_copies(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def _inputs(splits, dtype=torch.float32, seed=0, probs=True):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(splits)
    x = torch.randn(tokens, H, generator=gen).to(dtype).requires_grad_()
    p = torch.rand(tokens, generator=gen).requires_grad_() if probs else None
    dy = torch.randn(tokens, H, generator=gen).to(dtype)
    return x, p, dy


def _unfused_grads(module, x, probs, dy, splits, dtype):
    """Output and gradients (x, probs, fc1/fc2 per-expert w and b) of the unfused MLP in ``dtype``."""
    params = _params(module)
    leaves = {k: _leaf_copies(v, dtype) for k, v in params.items()}
    x_ref = x.detach().to(dtype).requires_grad_()
    p_ref = None if probs is None else probs.detach().to(dtype).requires_grad_()
    y = _unfused(
        x_ref, p_ref, leaves["fc1.w"], leaves["fc1.b"], leaves["fc2.w"], leaves["fc2.b"], splits
    )
    y.backward(dy.to(dtype))
    grads = {k: [t.grad for t in v] for k, v in leaves.items()}
    return y.detach(), x_ref.grad, None if p_ref is None else p_ref.grad, grads


def _module_grads(module: GroupedMLP) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for layer in ("fc1", "fc2"):
        linear: GroupedLinear = getattr(module, layer)
        if linear.single_grouped_weight:
            out[f"{layer}.w"] = list(linear.weight.grad.unbind(0))
            out[f"{layer}.b"] = list(linear.bias.grad.unbind(0)) if linear.use_bias else []
        else:
            out[f"{layer}.w"] = [getattr(linear, n).grad for n in linear.weight_names]
            out[f"{layer}.b"] = [getattr(linear, n).grad for n in linear.bias_names]
    return out


# ---------------------------------------------------------------- module basics


def test_parameter_names_and_layouts() -> None:
    module = GroupedMLP(E, H, FFN)
    names = [n for n, _ in module.named_parameters()]
    assert names == [f"fc1.weight{e}" for e in range(E)] + [f"fc2.weight{e}" for e in range(E)]
    assert module.fc1.weight0.shape == (2 * FFN, H)
    assert module.fc2.weight3.shape == (H, FFN)
    packed = GroupedMLP(E, H, FFN, single_grouped_weight=True, bias=True)
    assert [n for n, _ in packed.named_parameters()] == [
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    assert packed.fc1.weight.shape == (E, 2 * FFN, H)
    assert packed.fc1.bias.shape == (E, 2 * FFN)
    assert packed.fc2.weight.shape == (E, H, FFN)
    assert packed.fc2.bias.shape == (E, H)


def test_extra_repr_state_dict_and_options_reach_the_layers() -> None:
    module = GroupedMLP(
        E, H, FFN, bias=True, accumulate_into_main_grad=True, delay_wgrad_compute=True
    )
    text = repr(module)
    assert "num_groups=4, hidden_size=16, ffn_hidden_size=8, activation='swiglu', bias=True" in text
    assert "accumulate_into_main_grad=True, delay_wgrad_compute=True" in text
    assert module.fc1.accumulate_into_main_grad
    assert module.fc2.delay_wgrad_compute
    clone = GroupedMLP(E, H, FFN, bias=True)
    clone.load_state_dict(module.state_dict())
    for (name, a), (_, b) in zip(module.named_parameters(), clone.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(
        ValueError, match=r"activation is 'gelu'; GroupedMLP supports only 'swiglu'"
    ):
        GroupedMLP(E, H, FFN, activation="gelu")
    with pytest.raises(ValueError, match=r"ffn_hidden_size is 0, expected a positive int"):
        GroupedMLP(E, H, 0)
    with pytest.raises(ValueError, match=r"hidden_size is True, expected a positive int"):
        GroupedMLP(E, True, FFN)  # type: ignore[arg-type]


# ---------------------------------------------------------------- against the unfused reference


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("splits_kind", ["list", "cpu_tensor"])
def test_fp32_matches_the_unfused_fp64_reference(single, bias, with_probs, splits_kind) -> None:
    torch.manual_seed(1)
    module = GroupedMLP(E, H, FFN, bias=bias, single_grouped_weight=single)
    splits = [3, 0, 6, 2]
    arg = splits if splits_kind == "list" else torch.tensor(splits)
    x, probs, dy = _inputs(splits, probs=with_probs)
    y = module(x, arg, probs)
    y.backward(dy)
    y64, dx64, dp64, grads64 = _unfused_grads(module, x, probs, dy, splits, torch.float64)
    tight = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y.double(), y64, **tight)
    torch.testing.assert_close(x.grad.double(), dx64, **tight)
    if with_probs:
        torch.testing.assert_close(probs.grad.double(), dp64, **tight)
    for key, ours in _module_grads(module).items():
        assert len(ours) == len(grads64[key])
        for e, (got, want) in enumerate(zip(ours, grads64[key], strict=True)):
            torch.testing.assert_close(got.double(), want, **tight, msg=f"{key}[{e}]")


def _max_err(t: torch.Tensor, truth: torch.Tensor) -> float:
    return float((t.detach().double() - truth).abs().max())


@pytest.mark.parametrize("main_grad", [False, True])
def test_bf16_within_twice_pytorchs_own_error(main_grad: bool) -> None:
    torch.manual_seed(2)
    splits = [40, 0, 64, 24]
    hidden, ffn = 64, 48
    module = GroupedMLP(E, hidden, ffn, dtype=torch.bfloat16, accumulate_into_main_grad=main_grad)
    if main_grad:  # a bf16 model with fp32 main_grad: the wgrads land in fp32
        for layer in (module.fc1, module.fc2):
            for name in layer.weight_names:
                w = getattr(layer, name)
                w.main_grad = torch.full(w.shape, float("nan"))
                w.overwrite_main_grad = True
                w.grad_added_to_main_grad = False
    gen = torch.Generator().manual_seed(3)
    tokens = sum(splits)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().requires_grad_()
    probs = torch.rand(tokens, generator=gen).requires_grad_()
    dy = torch.randn(tokens, hidden, generator=gen).bfloat16()
    y = module(x, splits, probs)
    y.backward(dy)

    truth = _unfused_grads(module, x, probs, dy, splits, torch.float64)
    # PyTorch's own bf16 computation of the same thing (probs in bf16, as the activation is)
    torch_bf16 = _unfused_grads(module, x, probs, dy, splits, torch.bfloat16)
    pairs = [("y", y, torch_bf16[0], truth[0]), ("dx", x.grad, torch_bf16[1], truth[1])]
    pairs.append(("dprobs", probs.grad, torch_bf16[2], truth[2]))
    for layer in ("fc1", "fc2"):
        linear = getattr(module, layer)
        for e, name in enumerate(linear.weight_names):
            w = getattr(linear, name)
            ours = w.main_grad if main_grad else w.grad
            expected_dtype = torch.float32 if main_grad else torch.bfloat16
            assert ours.dtype == expected_dtype
            pairs.append(
                (f"{layer}.{name}", ours, torch_bf16[3][f"{layer}.w"][e], truth[3][f"{layer}.w"][e])
            )
    for what, ours, theirs, want in pairs:
        assert not ours.isnan().any(), what
        assert _max_err(ours, want) <= 2 * _max_err(theirs, want) + 1e-2, what


@pytest.mark.parametrize(
    "splits",
    [[0, 6, 0, 5], [4, 0, 0, 7], [3, 5, 2, 0], [0, 0, 0, 9], [9, 0, 0, 0], [0, 0, 0, 0]],
    ids=lambda s: "-".join(map(str, s)),
)
@pytest.mark.parametrize("single", [False, True])
def test_empty_experts_overwrite_main_grad_with_exact_zeros(splits, single) -> None:
    torch.manual_seed(4)
    module = GroupedMLP(
        E, H, FFN, bias=True, single_grouped_weight=single, accumulate_into_main_grad=True
    )
    weights = [getattr(module.fc1, n) for n in module.fc1.weight_names]
    weights += [getattr(module.fc2, n) for n in module.fc2.weight_names]
    for w in weights:
        w.main_grad = torch.full(w.shape, float("nan"))
        w.overwrite_main_grad = True
        w.grad_added_to_main_grad = False
    x, probs, dy = _inputs(splits, seed=5)
    y = module(x, splits, probs)
    y.backward(dy)
    _, dx64, dp64, grads64 = _unfused_grads(module, x, probs, dy, splits, torch.float64)
    torch.testing.assert_close(x.grad.double(), dx64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs.grad.double(), dp64, rtol=1e-5, atol=1e-5)
    for layer in ("fc1", "fc2"):
        linear = getattr(module, layer)
        main_grads = [getattr(linear, n).main_grad for n in linear.weight_names]
        per_expert = list(main_grads[0].unbind(0)) if single else main_grads
        for e, got in enumerate(per_expert):
            want = grads64[f"{layer}.w"][e]
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
            if splits[e] == 0:
                assert not got.any(), f"{layer} expert {e} has no tokens: main_grad must be 0"
        assert all(getattr(linear, n).grad_added_to_main_grad for n in linear.weight_names)


def test_probs_none_equals_probs_ones_and_gives_no_dprobs() -> None:
    module = GroupedMLP(E, H, FFN)
    splits = [2, 3, 1, 4]
    x, _, dy = _inputs(splits, probs=False)
    y_none = module(x, splits)
    ones = torch.ones(sum(splits), requires_grad=True)
    y_ones = module(x, splits, ones)
    torch.testing.assert_close(y_none, y_ones, rtol=0, atol=0)
    (dx_none,) = torch.autograd.grad(y_none, [x], dy)
    dx_ones, dprobs = torch.autograd.grad(y_ones, [x, ones], dy)
    torch.testing.assert_close(dx_none, dx_ones, rtol=0, atol=0)
    _, _, dprobs_ref, _ = _unfused_grads(module, x, ones, dy, splits, torch.float64)
    _close(dprobs, dprobs_ref, "dprobs")


def test_fp32_probs_with_a_bf16_model_get_an_fp32_gradient() -> None:
    module = GroupedMLP(E, H, FFN, dtype=torch.bfloat16)
    splits = [2, 3, 1, 4]
    x, probs, dy = _inputs(splits, dtype=torch.bfloat16)
    module(x, splits, probs).backward(dy)
    assert probs.grad.dtype == torch.float32
    assert probs.grad.shape == probs.shape


def test_frozen_fc1_runs_no_fc1_wgrad_but_still_gives_dx() -> None:
    module = GroupedMLP(E, H, FFN, accumulate_into_main_grad=True)
    for layer, fill in ((module.fc1, 7.0), (module.fc2, 0.0)):
        for name in layer.weight_names:
            w = getattr(layer, name)
            w.main_grad = torch.full(w.shape, fill)
    for name in module.fc1.weight_names:
        getattr(module.fc1, name).requires_grad_(False)
    splits = [2, 3, 1, 4]
    x, probs, dy = _inputs(splits)
    module(x, splits, probs).backward(dy)
    _, dx_ref, _, grads_ref = _unfused_grads(module, x, probs, dy, splits, torch.float64)
    _close(x.grad, dx_ref, "dx")
    for layer in (module.fc1, module.fc2):
        assert all(getattr(layer, n).grad is None for n in layer.weight_names)
    assert all(
        bool((getattr(module.fc1, n).main_grad == 7.0).all()) for n in module.fc1.weight_names
    )
    for e, name in enumerate(module.fc2.weight_names):
        _close(getattr(module.fc2, name).main_grad, grads_ref["fc2.w"][e], f"fc2.{name}.main_grad")


# ---------------------------------------------------------------- delayed wgrad


def test_backward_dw_is_fifo_one_backward_per_call_with_both_layers() -> None:
    module = GroupedMLP(E, H, FFN, delay_wgrad_compute=True)
    splits = [2, 2, 2, 2]
    batches = [_inputs(splits, seed=s) for s in range(2)]
    refs = []
    for x, probs, dy in batches:
        refs.append(_unfused_grads(module, x, probs, dy, splits, torch.float64)[3])
        module(x, splits, probs).backward(dy)
    assert module.fc1.weight1.grad is None
    assert module.fc2.weight1.grad is None
    module.backward_dw()
    _close(module.fc1.weight1.grad, refs[0]["fc1.w"][1])
    _close(module.fc2.weight1.grad, refs[0]["fc2.w"][1])
    module.backward_dw()
    for key, name in (("fc1.w", "fc1"), ("fc2.w", "fc2")):
        _close(getattr(module, name).weight1.grad, refs[0][key][1] + refs[1][key][1])
    with pytest.raises(RuntimeError, match=r"GroupedMLP\.backward_dw\(\) was called but no"):
        module.backward_dw()


def test_backward_dw_without_delay_is_a_no_op() -> None:
    module = GroupedMLP(E, H, FFN)
    splits = [3, 1, 0, 4]
    x, probs, dy = _inputs(splits)
    module(x, splits, probs).backward(dy)
    before = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.backward_dw()  # nothing was deferred: no error, nothing written
    module.backward_dw()
    for name, p in module.named_parameters():
        assert torch.equal(p.grad, before[name]), name


def test_the_fused_ops_settings_are_the_mlps_and_a_loop_over_modules_runs_backward_dw() -> None:
    # Catches: fc1 / fc2 given delay_wgrad_compute or fp8_recipe of their own, silently ignored
    # by the fused op; the MLP's set after construction not reaching them; and a loop calling
    # backward_dw() on every module stopping at fc1 ("no backward has queued ...").
    module = GroupedMLP(E, H, FFN)
    module.delay_wgrad_compute = True  # after construction: both layers follow
    assert module.fc1.delay_wgrad_compute
    assert module.fc2.delay_wgrad_compute
    splits = [3, 1, 0, 4]
    x, probs, dy = _inputs(splits)
    module(x, splits, probs).backward(dy)
    assert module.fc1.weight0.grad is None  # deferred
    for sub in module.modules():  # the MLP first; fc1's and fc2's own queues are empty
        sub.backward_dw()
    assert module.fc1.weight0.grad is not None
    with pytest.raises(RuntimeError, match=r"GroupedMLP\.backward_dw\(\) was called but no"):
        module.backward_dw()
    for fc, name, value in (
        ("fc1", "delay_wgrad_compute", True),
        ("fc2", "fp8_recipe", "blockwise"),
    ):
        module = GroupedMLP(E, H, FFN)
        setattr(getattr(module, fc), name, value)
        with pytest.raises(
            ValueError, match=rf"^{fc}\.{name} is {value!r} but the GroupedMLP's is "
        ):
            module(x, splits, probs)


# ---------------------------------------------------------------- distributed


def _distribute(linear: GroupedLinear) -> list[torch.Tensor]:
    group = make_fake_group(
        [getattr(linear, n) for n in linear.weight_names], main_grad_dtype=torch.float32
    )
    for name, param in zip(linear.weight_names, group, strict=True):
        setattr(linear, name, param)
    return group


@pytest.mark.parametrize("distributed_layer", ["fc1", "fc2"])
def test_mixed_distributed_and_plain_layers_are_rejected(distributed_layer: str) -> None:
    module = GroupedMLP(E, H, FFN, accumulate_into_main_grad=True)
    _distribute(getattr(module, distributed_layer))
    plain = "fc2" if distributed_layer == "fc1" else "fc1"
    x, probs, _ = _inputs([1, 1, 1, 1])
    with pytest.raises(
        ValueError,
        match=rf"{distributed_layer}\.weight0 is a DistributedWeight but {plain}\.weight0 is a "
        r"plain tensor; GroupedMLP needs fc1 and fc2 both distributed or both plain",
    ):
        module(x, [1, 1, 1, 1], probs)


@pytest.mark.parametrize("delay", [False, True])
def test_leader_only_groups_for_both_layers(delay: bool) -> None:
    module = GroupedMLP(
        E, H, FFN, bias=False, accumulate_into_main_grad=True, delay_wgrad_compute=delay
    )
    ref_module = GroupedMLP(E, H, FFN, bias=False)
    ref_module.load_state_dict(module.state_dict())
    leaders = []
    for linear in (module.fc1, module.fc2):
        followers = [getattr(linear, f"weight{e}") for e in range(1, E)]
        leader = FakeDistributedWeight(linear.weight0.detach().clone())
        leader.forward_scale = leader.backward_scale = 1.0
        leader.group = [leader, *followers]
        for member in leader.group:
            member.main_grad = torch.zeros(member.shape)
            member.grad_added_to_main_grad = False
        linear.weight0 = leader
        leaders.append(leader)
    splits = [2, 3, 1, 2]
    x, probs, dy = _inputs(splits)
    y = module(x, splits, probs)
    y.backward(dy)
    module.backward_dw()
    y_ref, dx_ref, dp_ref, grads_ref = _unfused_grads(
        ref_module, x, probs, dy, splits, torch.float64
    )
    _close(y, y_ref)
    _close(x.grad, dx_ref)
    _close(probs.grad, dp_ref)
    for layer, leader in zip(("fc1", "fc2"), leaders, strict=True):
        assert [g.dtype for g in leader.finalized[0]] == [torch.float32] * E
        for e, member in enumerate(leader.group):
            _close(member.main_grad, grads_ref[f"{layer}.w"][e])
            assert member.grad_added_to_main_grad is True


def test_saved_tensors_are_x_h_and_probs_and_never_the_distributed_weights() -> None:
    module = GroupedMLP(E, H, FFN, accumulate_into_main_grad=True)
    groups = [_distribute(module.fc1), _distribute(module.fc2)]
    splits = [2, 0, 3, 3]
    tokens = sum(splits)
    x, probs, dy = _inputs(splits)
    with offloaded_saved_tensors() as packed:
        y = module(x, splits, probs)
    assert not any(isinstance(t, FakeDistributedWeight) for t in packed)
    # exactly what the docs promise: x (T, H), h (T, 2F), probs (T,) — no activation, no weights
    assert [tuple(t.shape) for t in packed] == [(tokens, H), (tokens, 2 * FFN), (tokens,)]
    assert packed[0] is x
    assert packed[2] is probs
    y.backward(dy)
    for group in groups:
        assert_group_backward_ran_once(group)


# ---------------------------------------------------------------- allocations


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("overwrite", [False, True])
def test_main_grad_backward_allocates_nothing_weight_sized(single: bool, overwrite: bool) -> None:
    # Activations (16 tokens) are far smaller than one expert's weight (96 x 64), so a
    # weight-sized allocation in backward would be a scratch wgrad buffer.
    hidden, ffn, splits = 64, 48, [5, 0, 8, 3]
    module = GroupedMLP(
        E,
        hidden,
        ffn,
        dtype=torch.bfloat16,
        single_grouped_weight=single,
        accumulate_into_main_grad=True,
    )
    weights = [
        getattr(linear, n) for linear in (module.fc1, module.fc2) for n in linear.weight_names
    ]
    attach_main_grads(weights, "overwrite" if overwrite else "accumulate")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(splits), hidden, generator=gen).bfloat16().requires_grad_()
    probs = torch.rand(sum(splits), generator=gen).requires_grad_()
    dy = torch.randn(sum(splits), hidden, generator=gen).bfloat16()
    module(x, splits, probs).backward(dy)  # warm-up: the cached dummies are allocated once
    smallest_weight = hidden * ffn
    assert backward_allocations(module(x, splits, probs), dy, numel=smallest_weight) == []

    module.accumulate_into_main_grad = False  # control: autograd owns the gradient
    assert backward_allocations(module(x, splits, probs), dy, numel=smallest_weight)


# ---------------------------------------------------------------- errors


def test_bad_inputs_are_rejected_with_names() -> None:
    module = GroupedMLP(E, H, FFN)
    x = torch.randn(4, H)
    with pytest.raises(ValueError, match=r"x has shape \(4, 5\), expected \(tokens, 16\)"):
        module(torch.randn(4, 5), [1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"probs has shape \(4, 1\), expected \(T,\) = \(4,\)"):
        module(x, [1, 1, 1, 1], torch.rand(4, 1))
    with pytest.raises(ValueError, match=r"probs has shape \(3,\), expected \(T,\) = \(4,\)"):
        module(x, [1, 1, 1, 1], torch.rand(3))
    with pytest.raises(TypeError, match=r"probs has dtype torch\.int64, expected a floating"):
        module(x, [1, 1, 1, 1], torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"probs is a list, expected a Tensor or None"):
        module(x, [1, 1, 1, 1], [0.5] * 4)
    with pytest.raises(ValueError, match=r"splits sums to 3 but x has 4 rows"):
        module(x, [1, 1, 1, 0])
    with pytest.raises(TypeError, match=r"dtype"):
        module(x.double(), [1, 1, 1, 1])


def test_missing_main_grad_names_the_parameter() -> None:
    module = GroupedMLP(E, H, FFN, accumulate_into_main_grad=True)
    for linear in (module.fc1, module.fc2):
        for name in linear.weight_names:
            getattr(linear, name).main_grad = torch.zeros(getattr(linear, name).shape)
    del module.fc2.weight2.main_grad
    x, probs, dy = _inputs([1, 2, 3, 4])
    y = module(x, [1, 2, 3, 4], probs)
    with pytest.raises(RuntimeError, match=r"parameter 'fc2\.weight2' has no main_grad"):
        y.backward(dy)


# ---------------------------------------------------------------- torch.compile, import


@pytest.mark.parametrize("bias", [False, True])
def test_torch_compile_of_forward_and_backward_matches_eager(bias: bool) -> None:
    torch.manual_seed(6)
    module = GroupedMLP(E, H, FFN, bias=bias)
    splits = [3, 1, 0, 4]
    x, probs, dy = _inputs(splits)

    def step(inp: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return (module(inp, splits, p) * dy).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(x, probs)
    loss.backward()
    params = [p for _, p in module.named_parameters()]
    got = [loss.detach(), x.grad.clone(), probs.grad.clone(), *(p.grad.clone() for p in params)]
    x.grad = probs.grad = None
    module.zero_grad()
    loss = step(x, probs)
    loss.backward()
    want = [loss.detach(), x.grad, probs.grad, *(p.grad for p in params)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_importing_and_running_on_cpu_needs_neither_triton_nor_cuda() -> None:
    # triton is made unimportable; torch itself may probe for it, our code must not need it
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "from groupgrad.modules import GroupedMLP\n"
        "m = GroupedMLP(2, 8, 8)\n"
        "m(torch.randn(3, 8), [1, 2], torch.rand(3)).sum().backward()\n"
        "assert 'groupgrad.kernels._swiglu_triton' not in sys.modules, 'kernels imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_steps_bf16_weights_on_their_fp32_grads_and_adamw_refuses(momentum: float) -> None:
    """What the transformers README says of optimizers for ``grad_dtype = float32`` on bf16 weights."""
    torch.manual_seed(40)
    mlp = GroupedMLP(4, 16, 8, dtype=torch.bfloat16, single_grouped_weight=True)
    for p in mlp.parameters():
        p.grad_dtype = torch.float32
    splits = [5, 0, 7, 4]
    mlp(torch.randn(16, 16, dtype=torch.bfloat16), splits).float().square().sum().backward()
    weight = mlp.fc1.weight
    before, grad = weight.detach().clone(), weight.grad.clone()
    assert grad.dtype == torch.float32
    torch.optim.SGD(mlp.parameters(), lr=0.1, momentum=momentum).step()
    assert weight.dtype == torch.bfloat16
    torch.testing.assert_close(weight.detach(), (before.float() - 0.1 * grad).bfloat16())
    with pytest.raises(
        RuntimeError, match=r"expected dtype c10::BFloat16 for `end` but got dtype float"
    ):
        torch.optim.AdamW(mlp.parameters()).step()
