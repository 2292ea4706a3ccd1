"""GroupedLinear and grouped_linear beyond the matrix: dtypes, distributed corner cases, errors."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from groupgrad.modules import GroupedLinear, grouped_linear
from groupgrad.protocol.testing import FakeDistributedWeight, make_fake_group
from groupgrad_testsupport import (
    assert_group_backward_ran_once,
    attach_main_grads,
    backward_allocations,
)
from groupgrad_testsupport.offload import offloaded_saved_tensors

E, K, N = 4, 16, 8


def _inputs(splits, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(splits), K, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(sum(splits), N, generator=gen).to(dtype)
    return x, dy


def _per_expert_reference(x, weights, splits, biases=None):
    outs = []
    for e, x_e in enumerate(x.split(list(splits))):
        outs.append(F.linear(x_e, weights[e], None if biases is None else biases[e]))
    return torch.cat(outs)


# ---------------------------------------------------------------- module basics


def test_parameter_names_and_layouts() -> None:
    per_expert = GroupedLinear(E, K, N)
    names = [n for n, _ in per_expert.named_parameters()]
    assert names == [f"{kind}{e}" for e in range(E) for kind in ("weight", "bias")]
    assert not hasattr(per_expert, "weight")
    assert per_expert.weight3.shape == (N, K)
    packed = GroupedLinear(E, K, N, single_grouped_weight=True)
    assert [n for n, _ in packed.named_parameters()] == ["weight", "bias"]
    assert packed.weight.shape == (E, N, K)
    assert packed.bias.shape == (E, N)
    assert not hasattr(packed, "weight0")
    assert [n for n, _ in GroupedLinear(E, K, N, bias=False).named_parameters()] == [
        f"weight{e}" for e in range(E)
    ]


def test_default_init_matches_nn_linear_bounds() -> None:
    module = GroupedLinear(E, 256, N, single_grouped_weight=True)
    bound = 1 / 256**0.5
    assert float(module.weight.detach().abs().max()) <= bound
    assert float(module.weight.detach().abs().max()) > 0.9 * bound
    assert float(module.bias.detach().abs().max()) <= bound


def test_extra_repr_and_state_dict_round_trip() -> None:
    module = GroupedLinear(E, K, N, accumulate_into_main_grad=True)
    assert "num_groups=4, in_features=16, out_features=8, bias=True" in repr(module)
    assert "accumulate_into_main_grad=True" in repr(module)
    clone = GroupedLinear(E, K, N)
    clone.load_state_dict(module.state_dict())
    for (name, a), (_, b) in zip(module.named_parameters(), clone.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_constructor_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match=r"num_groups is 0, expected a positive int"):
        GroupedLinear(0, K, N)
    with pytest.raises(ValueError, match=r"in_features is -3, expected a positive int"):
        GroupedLinear(E, -3, N)


@pytest.mark.parametrize("splits_kind", ["list", "tuple", "cpu_int64", "cpu_int32"])
def test_forward_and_backward_match_per_expert_linear(splits_kind: str) -> None:
    raw = [3, 0, 6, 2]
    splits = {
        "list": raw,
        "tuple": tuple(raw),
        "cpu_int64": torch.tensor(raw),
        "cpu_int32": torch.tensor(raw, dtype=torch.int32),
    }[splits_kind]
    module = GroupedLinear(E, K, N)
    x, dy = _inputs(raw)
    y = module(x, splits)
    weights = [getattr(module, f"weight{e}") for e in range(E)]
    biases = [getattr(module, f"bias{e}") for e in range(E)]
    x_ref = x.detach().clone().requires_grad_()
    y_ref = _per_expert_reference(x_ref, weights, raw, biases)
    torch.testing.assert_close(y, y_ref)
    grads = torch.autograd.grad(y, [x, *weights, *biases], dy)
    grads_ref = torch.autograd.grad(y_ref, [x_ref, *weights, *biases], dy)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want)


def test_functional_op_matches_the_module() -> None:
    module = GroupedLinear(E, K, N, single_grouped_weight=True)
    x, dy = _inputs([2, 5, 0, 4])
    y = grouped_linear(x, module.weight, [2, 5, 0, 4], module.bias)
    y.backward(dy)
    grads = (x.grad.clone(), module.weight.grad.clone(), module.bias.grad.clone())
    x.grad = None
    module.zero_grad()
    module(x, [2, 5, 0, 4]).backward(dy)
    for got, want in zip(grads, (x.grad, module.weight.grad, module.bias.grad), strict=True):
        torch.testing.assert_close(got, want)


def test_bf16_within_twice_pytorchs_own_error() -> None:
    splits = [40, 0, 64, 24]
    module = GroupedLinear(E, 64, 32, dtype=torch.bfloat16, bias=False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(splits), 64, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), 32, generator=gen).bfloat16()
    weights = [getattr(module, f"weight{e}") for e in range(E)]
    y = module(x, splits)
    y.backward(dy)
    # fp64 truth and PyTorch's own bf16 computation of the same thing
    x64 = x.detach().double().requires_grad_()
    w64 = [w.detach().double().requires_grad_() for w in weights]
    y64 = _per_expert_reference(x64, w64, splits)
    y64.backward(dy.double())
    xb = x.detach().clone().requires_grad_()
    wb = [w.detach().clone().requires_grad_() for w in weights]
    yb = _per_expert_reference(xb, wb, splits)
    yb.backward(dy)
    pairs = [(y, yb, y64), (x.grad, xb.grad, x64.grad)]
    pairs += [(w.grad, b.grad, t.grad) for w, b, t in zip(weights, wb, w64, strict=True)]
    for ours, torch_bf16, truth in pairs:
        assert not ours.isnan().any()
        ours_err = (ours.double() - truth).abs().max()
        torch_err = (torch_bf16.double() - truth).abs().max()
        assert ours_err <= 2 * torch_err + 1e-2


def test_fp32_bias_gradients_are_exact_sums_and_keep_non_finite_values() -> None:
    # Catches: fp32 dy summed as one bf16 GEMM operand (its low 16 bits lost), a part of
    # its exact bf16 split dropped, the split rounding instead of truncating (a finite dy
    # near the fp32 maximum became inf), or a non-finite dy split into NaN parts.
    splits = [3, 0, 2, 1]
    module = GroupedLinear(E, K, N, single_grouped_weight=True)
    x = torch.randn(sum(splits), K)
    tiny = 1 + 2**-22  # needs fp32's last bits: 8 and 16 bits below the leading one too
    dy = torch.full((sum(splits), N), tiny)
    dy[:, 1] = torch.tensor([1 + 2**-10 + 2**-20, 2**-3 + 2**-19, -1.0, 3.0, 0.5, 2**-18])
    dy[:, 2] = torch.finfo(torch.float32).max / 4
    dy[5, 2] = torch.finfo(torch.float32).max  # alone in its expert: rounded to bf16, inf
    dy[0, 3], dy[4, 4], dy[5, 5] = float("inf"), float("-inf"), float("nan")
    module(x, splits).backward(dy)
    want = torch.stack([rows.double().sum(0) for rows in dy.split(splits)]).float()
    got = module.bias.grad
    assert got.dtype == torch.float32
    finite = want.isfinite()
    assert torch.equal(got[finite], want[finite]), (got - want)[finite].abs().max()
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[want.isinf()], want[want.isinf()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bias_gemm_takes_dy_exactly_as_bf16_or_fp16(dtype: torch.dtype, monkeypatch) -> None:
    # Catches: fp32 dy handed to the bias GEMM whole (on the GPU's reference path with TF32
    # allowed, cuBLAS rounds it to 10 bits); fp16 dy rounded to bf16 on its way (3 bits lost).
    import groupgrad.modules._grads as grads_module

    seen: list[torch.dtype] = []
    real = grads_module.grouped_wgrad

    def spy(dy, x, splits, **kwargs):
        if x.shape[1] == 8:  # the ones: the bias GEMM (the weights' x has K = 16 columns)
            seen.append(dy.dtype)
        return real(dy, x, splits, **kwargs)

    monkeypatch.setattr(grads_module, "grouped_wgrad", spy)
    module = GroupedLinear(E, K, N, dtype=dtype, single_grouped_weight=True)
    for p in module.parameters():
        p.grad_dtype = torch.float32
    splits = [3, 0, 2, 1]
    dy = torch.full((sum(splits), N), 1 + 2**-10, dtype=dtype)  # 11 significant bits
    module(torch.randn(sum(splits), K).to(dtype), splits).backward(dy)
    assert seen == [torch.float16 if dtype == torch.float16 else torch.bfloat16]
    want = torch.tensor(splits, dtype=torch.float32)[:, None] * (1 + 2**-10)
    assert torch.equal(module.bias.grad, want.expand(E, N))


# ---------------------------------------------------------------- main_grad details


def test_without_the_flag_attribute_autograd_receives_none() -> None:
    module = GroupedLinear(E, K, N, bias=False, accumulate_into_main_grad=True)
    for e in range(E):
        getattr(module, f"weight{e}").main_grad = torch.zeros(N, K)
    x, dy = _inputs([1, 2, 3, 4])
    module(x, [1, 2, 3, 4]).backward(dy)
    assert module.weight0.grad is None
    splits, x64, dy64 = [1, 2, 3, 4], x.detach().double(), dy.double()
    for e, (x_e, dy_e) in enumerate(zip(x64.split(splits), dy64.split(splits), strict=True)):
        torch.testing.assert_close(getattr(module, f"weight{e}").main_grad.double(), dy_e.T @ x_e)


def test_missing_main_grad_names_the_parameter() -> None:
    module = GroupedLinear(E, K, N, bias=False, accumulate_into_main_grad=True)
    for e in range(E):
        if e != 2:
            getattr(module, f"weight{e}").main_grad = torch.zeros(N, K)
    x, dy = _inputs([1, 2, 3, 4])
    y = module(x, [1, 2, 3, 4])
    with pytest.raises(RuntimeError, match=r"parameter 'weight2' has no main_grad"):
        y.backward(dy)
    assert not module.weight0.main_grad.any()  # nothing half-written


def test_overwrite_flag_is_read_at_backward_not_forward() -> None:
    module = GroupedLinear(E, K, N, bias=False, accumulate_into_main_grad=True)
    weights = [getattr(module, f"weight{e}") for e in range(E)]
    for w in weights:
        w.main_grad = torch.full((N, K), 5.0)
        w.overwrite_main_grad = False
    x, dy = _inputs([4, 4, 0, 4])
    y = module(x, [4, 4, 0, 4])
    for w in weights:
        w.overwrite_main_grad = True  # flipped between forward and backward
    y.backward(dy)
    expected = dy[8:12].T @ x.detach()[8:12]
    torch.testing.assert_close(weights[3].main_grad, expected)
    assert not weights[2].main_grad.any()  # zero tokens + overwrite: exactly zero


def test_frozen_weights_run_no_wgrad() -> None:
    module = GroupedLinear(E, K, N, bias=False, accumulate_into_main_grad=True)
    for e in range(E):
        w = getattr(module, f"weight{e}")
        w.requires_grad_(False)
        w.main_grad = torch.full((N, K), 7.0)
    x, dy = _inputs([1, 2, 3, 4])
    module(x, [1, 2, 3, 4]).backward(dy)
    assert x.grad is not None
    assert bool((module.weight1.main_grad == 7.0).all())


def test_delayed_wgrad_fires_post_accumulate_hooks_at_backward_dw() -> None:
    module = GroupedLinear(E, K, N, bias=False, delay_wgrad_compute=True)
    seen: list[tuple[str, torch.Tensor | None]] = []
    for e in range(E):
        getattr(module, f"weight{e}").register_post_accumulate_grad_hook(
            lambda p, e=e: seen.append((f"weight{e}", None if p.grad is None else p.grad.clone()))
        )
    x, dy = _inputs([1, 2, 3, 4])
    module(x, [1, 2, 3, 4]).backward(dy)
    # backward holds the hooks back from autograd (nothing has landed yet) ...
    assert seen == []
    assert module.weight0.grad is None
    module.backward_dw()
    # ... and backward_dw() runs them, once, when the gradient has landed
    assert [name for name, _ in seen] == [f"weight{e}" for e in range(E)]
    torch.testing.assert_close(seen[0][1], dy[:1].T @ x.detach()[:1])
    torch.testing.assert_close(module.weight0.grad, dy[:1].T @ x.detach()[:1])


def test_backward_dw_is_fifo_one_backward_per_call() -> None:
    module = GroupedLinear(E, K, N, bias=False, delay_wgrad_compute=True)
    batches = [_inputs([2, 2, 2, 2], seed=s) for s in range(2)]
    for x, dy in batches:
        module(x, [2, 2, 2, 2]).backward(dy)
    module.backward_dw()
    x0, dy0 = batches[0]
    torch.testing.assert_close(module.weight1.grad, dy0[2:4].T @ x0.detach()[2:4])
    module.backward_dw()
    x1, dy1 = batches[1]
    torch.testing.assert_close(
        module.weight1.grad, dy0[2:4].T @ x0.detach()[2:4] + dy1[2:4].T @ x1.detach()[2:4]
    )


def test_backward_dw_without_delay_is_a_no_op() -> None:
    module = GroupedLinear(E, K, N)
    x, dy = _inputs([3, 1, 0, 4])
    module(x, [3, 1, 0, 4]).backward(dy)
    before = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.backward_dw()  # nothing was deferred: no error, nothing written
    module.backward_dw()
    for name, p in module.named_parameters():
        assert torch.equal(p.grad, before[name]), name


# ---------------------------------------------------------------- distributed


@pytest.mark.parametrize("delay", [False, True])
def test_bf16_model_fp32_main_grad_distributed_wgrads_reach_finalize_in_fp32(delay: bool) -> None:
    module = GroupedLinear(
        E,
        K,
        N,
        bias=False,
        dtype=torch.bfloat16,
        accumulate_into_main_grad=True,
        delay_wgrad_compute=delay,
    )
    names = module.weight_names
    group = make_fake_group([getattr(module, n) for n in names], main_grad_dtype=torch.float32)
    for name, param in zip(names, group, strict=True):
        setattr(module, name, param)
    x, dy = _inputs([3, 1, 0, 4], dtype=torch.bfloat16)
    module(x, [3, 1, 0, 4]).backward(dy)
    module.backward_dw()
    leader = group[0]
    assert isinstance(leader, FakeDistributedWeight)
    assert len(leader.finalized) == 1
    assert [g.dtype for g in leader.finalized[0]] == [torch.float32] * E
    expected = dy[:3].double().T @ x.detach()[:3].double()
    torch.testing.assert_close(leader.finalized[0][0].double(), expected, rtol=1e-6, atol=1e-6)
    assert group[1].main_grad.dtype == torch.float32


@pytest.mark.parametrize("delay", [False, True])
def test_leader_only_group_end_to_end(delay: bool) -> None:
    module = GroupedLinear(
        E, K, N, bias=False, accumulate_into_main_grad=True, delay_wgrad_compute=delay
    )
    followers = [getattr(module, f"weight{e}") for e in range(1, E)]
    leader = FakeDistributedWeight(module.weight0.detach().clone())
    leader.group = [leader, *followers]
    for member in leader.group:
        member.main_grad = torch.zeros(N, K)
        member.grad_added_to_main_grad = False
    module.weight0 = leader
    x, dy = _inputs([2, 3, 1, 2])
    y = module(x, [2, 3, 1, 2])
    weights = [leader, *followers]
    torch.testing.assert_close(y, _per_expert_reference(x, [2 * w for w in weights], [2, 3, 1, 2]))
    y.backward(dy)
    module.backward_dw()
    torch.testing.assert_close(
        x.grad, _per_expert_reference(dy, [4 * w.T for w in weights], [2, 3, 1, 2])
    )
    assert [g.dtype for g in leader.finalized[0]] == [torch.float32] * E
    for e, member in enumerate(weights):
        rows = slice(sum([2, 3, 1, 2][:e]), sum([2, 3, 1, 2][: e + 1]))
        torch.testing.assert_close(member.main_grad, dy[rows].T @ x.detach()[rows])
        assert member.grad_added_to_main_grad is True


def test_saved_tensors_hooks_cannot_strip_the_distributed_leader() -> None:
    module = GroupedLinear(E, K, N, bias=False, accumulate_into_main_grad=True)
    group = make_fake_group(
        [getattr(module, n) for n in module.weight_names], main_grad_dtype=torch.float32
    )
    for name, param in zip(module.weight_names, group, strict=True):
        setattr(module, name, param)
    x, dy = _inputs([2, 2, 2, 2])
    with offloaded_saved_tensors() as packed:
        y = module(x, [2, 2, 2, 2])
    assert not any(isinstance(t, FakeDistributedWeight) for t in packed)
    y.backward(dy)
    assert_group_backward_ran_once(group)


# ---------------------------------------------------------------- allocations


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("overwrite", [False, True])
def test_main_grad_backward_allocates_nothing_weight_sized(single: bool, overwrite: bool) -> None:
    # Activations are smaller than one expert's weight, so any allocation of a
    # weight's size in backward would be a scratch wgrad buffer.
    e, k, n, splits = 4, 64, 48, [5, 0, 8, 3]
    module = GroupedLinear(
        e,
        k,
        n,
        bias=False,
        dtype=torch.bfloat16,
        single_grouped_weight=single,
        accumulate_into_main_grad=True,
    )
    weights = [getattr(module, name) for name in module.weight_names]
    attach_main_grads(weights, "overwrite" if overwrite else "accumulate")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(splits), k, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(sum(splits), n, generator=gen).bfloat16()
    module(x, splits).backward(dy)  # warm-up: the cached dummy is allocated once
    assert backward_allocations(module(x, splits), dy, numel=n * k) == []

    # the recorder does see a weight-sized wgrad when autograd owns the gradient
    module.accumulate_into_main_grad = False
    assert backward_allocations(module(x, splits), dy, numel=n * k)


# ---------------------------------------------------------------- errors


def test_bad_inputs_are_rejected_with_names() -> None:
    module = GroupedLinear(E, K, N)
    with pytest.raises(ValueError, match=r"x has shape \(3, 5\), expected \(tokens, 16\)"):
        module(torch.randn(3, 5), [1, 1, 1, 0])
    with pytest.raises(ValueError, match=r"x has shape \(2, 3, 16\)"):
        module(torch.randn(2, 3, 16), [1, 1, 1, 0])
    with pytest.raises(ValueError, match=r"splits sums to 3 but x has 4 rows"):
        module(torch.randn(4, K), [1, 1, 1, 0])
    with pytest.raises(ValueError, match=r"splits"):
        module(torch.randn(4, K), [1, 1, 2])
    with pytest.raises(ValueError, match=r"splits\[1\] is -1"):
        module(torch.randn(4, K), [3, -1, 2, 0])
    with pytest.raises(TypeError, match=r"dtype"):
        module(torch.randn(4, K, dtype=torch.float64), [1, 1, 1, 1])


def test_functional_rejects_mismatched_bias_layouts() -> None:
    w = torch.randn(E, N, K)
    with pytest.raises(ValueError, match=r"bias is a list; expected a packed \(E, N\) tensor"):
        grouped_linear(torch.randn(4, K), w, [1, 1, 1, 1], [torch.zeros(N)] * E)
    with pytest.raises(ValueError, match=r"bias has 3 entries, expected 4"):
        grouped_linear(torch.randn(4, K), list(w), [1, 1, 1, 1], [torch.zeros(N)] * 3)
    with pytest.raises(ValueError, match=r"weights is empty"):
        grouped_linear(torch.randn(4, K), [], [])


# ---------------------------------------------------------------- torch.compile


def test_torch_compile_of_forward_and_backward_matches_eager() -> None:
    torch.manual_seed(5)
    module = GroupedLinear(E, K, N)
    splits = [3, 1, 0, 4]  # expert 2 has no tokens; every other gradient is non-zero
    x, dy = _inputs(splits)

    def step(inp: torch.Tensor) -> torch.Tensor:
        return (module(inp, splits) * dy).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(x)
    loss.backward()
    got = {"loss": loss.detach(), "x": x.grad}
    got.update({name: p.grad for name, p in module.named_parameters()})
    # the independent oracle: an fp64 per-expert loop
    names = [*(f"weight{e}" for e in range(E)), *(f"bias{e}" for e in range(E))]
    leaves = {"x": x.detach().double().requires_grad_()}
    leaves.update({n: getattr(module, n).detach().double().requires_grad_() for n in names})
    y64 = _per_expert_reference(
        leaves["x"],
        [leaves[f"weight{e}"] for e in range(E)],
        splits,
        [leaves[f"bias{e}"] for e in range(E)],
    )
    loss64 = (y64 * dy.double()).sum()
    want = {"loss": loss64.detach()}
    want.update(zip(leaves, torch.autograd.grad(loss64, list(leaves.values())), strict=True))
    for e in (0, 1, 3):
        assert got[f"weight{e}"].abs().sum() > 0  # not a comparison of zeros against zeros
    for name, expected in want.items():
        torch.testing.assert_close(got[name].double(), expected, rtol=1e-5, atol=1e-5, msg=name)


def test_per_expert_autograd_wgrads_reach_the_kernel_as_one_packed_output(monkeypatch) -> None:
    """Fresh buffers are views of one ``(E, N, K)`` allocation: the GEMM takes its packed path."""
    import groupgrad.modules._wgrad as wgrad_module

    seen: list[object] = []
    real = wgrad_module.prepare_wgrad

    def spy(dy, x, splits, *, out, accumulate, names):
        seen.append(out)
        return real(dy, x, splits, out=out, accumulate=accumulate, names=names)

    monkeypatch.setattr(wgrad_module, "prepare_wgrad", spy)
    module = GroupedLinear(E, K, N, bias=False)
    x, dy = _inputs([3, 1, 0, 4])
    module(x, [3, 1, 0, 4]).backward(dy)
    (out,) = seen
    assert isinstance(out, torch.Tensor)
    assert out.shape == (E, N, K)
    for e in range(E):  # each parameter's .grad is its expert's slice of that one output
        assert getattr(module, f"weight{e}").grad.data_ptr() == out[e].data_ptr()
