"""GroupedLinear on a CUDA device (CUTLASS kernels), against the per-expert fp64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from groupgrad.modules import GroupedLinear
from groupgrad.protocol.testing import FakeDistributedWeight
from groupgrad_testsupport import (
    assert_compiled_matches_eager,
    assert_within_scale,
    attach_main_grads,
    cuda_peak_growth,
    distribute_fake,
)
from groupgrad_testsupport.cuda_graphs import STEP_SPLITS, capture, replay_with_new_splits

pytestmark = pytest.mark.gpu

E, K, N = 8, 128, 64
SPLITS = STEP_SPLITS


def _reference(x, dy, weights, splits, fwd_scale, bwd_scale):
    ys, dxs, dws = [], [], []
    for x_e, dy_e, w_e in zip(
        x.double().split(splits), dy.double().split(splits), weights, strict=True
    ):
        w64 = w_e.detach().double()
        ys.append(x_e @ (fwd_scale * w64).T)
        dxs.append(dy_e @ (bwd_scale * w64))
        dws.append(dy_e.T @ x_e)
    return torch.cat(ys), torch.cat(dxs), dws


def _assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_within_scale(actual, expected, rel=2e-2, atol=1e-3, what=what)


@pytest.mark.parametrize(
    ("single", "kind", "main_grad", "delay", "device_splits", "zero_out", "bias"),
    list(
        itertools.product(
            [False, True],
            ["plain", "distributed"],
            ["none", "accumulate", "overwrite"],
            [False, True],
            [False, True],
            [False, True],
            [False, True],
        )
    ),
)
def test_grouped_linear_on_cuda(
    single, kind, main_grad, delay, device_splits, zero_out, bias
) -> None:
    torch.manual_seed(0)
    module = GroupedLinear(
        E,
        K,
        N,
        bias=bias,
        dtype=torch.bfloat16,
        device="cuda",
        single_grouped_weight=single,
        accumulate_into_main_grad=main_grad != "none",
        delay_wgrad_compute=delay,
    )
    if kind == "distributed":
        distribute_fake(module, main_grad)
    params = [getattr(module, n) for n in module.weight_names]
    attach_main_grads(params, main_grad, zero_out=zero_out)
    initial = [p.main_grad.clone() for p in params] if main_grad == "accumulate" else None
    fwd, bwd = (2.0, 4.0) if kind == "distributed" else (1.0, 1.0)
    expert_weights = list(params[0].unbind(0)) if single else params
    total = [torch.zeros(N, K, dtype=torch.float64, device="cuda") for _ in range(E)]
    biases = [getattr(module, n) for n in module.bias_names]
    bias_E = list(biases[0].unbind(0)) if single and bias else biases if bias else [None] * E
    total_db = torch.zeros(E, N, dtype=torch.float64, device="cuda")

    for splits in SPLITS:
        x = torch.randn(sum(splits), K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(sum(splits), N, device="cuda", dtype=torch.bfloat16)
        arg = torch.tensor(splits, device="cuda") if device_splits else splits
        y_ref, dx_ref, dw_ref = _reference(x.detach(), dy, expert_weights, splits, fwd, bwd)
        if bias:
            rows = torch.repeat_interleave(
                torch.arange(E, device="cuda"), torch.tensor(splits, device="cuda")
            )
            y_ref = y_ref + torch.stack([b.detach().double() for b in bias_E])[rows]
            total_db.index_add_(0, rows, dy.double())
        y = module(x, arg)
        y.backward(dy)
        module.backward_dw()
        torch.cuda.synchronize()
        _assert_bf16_close(y, y_ref, "y")
        _assert_bf16_close(x.grad, dx_ref, "dx")
        for e in range(E):
            total[e] += dw_ref[e]
        latest = [torch.stack(dw_ref)] if single else dw_ref  # one entry per parameter
        summed = [torch.stack(total)] if single else total
        for index, p in enumerate(params):
            if main_grad == "none":
                _assert_bf16_close(p.grad, summed[index], f".grad {index}")
            elif main_grad == "overwrite":
                _assert_bf16_close(p.main_grad, latest[index], f"main_grad {index}")
            else:
                expected = initial[index].double() + summed[index]
                _assert_bf16_close(p.main_grad, expected, f"main_grad {index}")
            if main_grad != "none":
                assert p.grad_added_to_main_grad is True
                assert p.grad is not None
                assert not p.grad.any()
        if bias:
            db = [biases[0].grad] if single else [b.grad for b in biases]
            want = [total_db] if single else list(total_db.unbind(0))
            for index, (got, expected) in enumerate(zip(db, want, strict=True)):
                _assert_bf16_close(got, expected, f"bias grad {index}")
    if kind == "distributed":
        leader = params[0]
        assert isinstance(leader, FakeDistributedWeight)
        if main_grad != "none":
            assert all(g.dtype == torch.float32 for g in leader.finalized[0])


def _main_grad_module(single: bool, overwrite: bool) -> GroupedLinear:
    module = GroupedLinear(
        E,
        1024,
        1024,
        bias=False,
        dtype=torch.bfloat16,
        device="cuda",
        single_grouped_weight=single,
        accumulate_into_main_grad=True,
    )
    for p in (getattr(module, n) for n in module.weight_names):
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        p.overwrite_main_grad = overwrite
        p.grad_added_to_main_grad = False
    return module


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("overwrite", [False, True])
def test_main_grad_backward_allocates_nothing_weight_sized_on_cuda(single, overwrite) -> None:
    module = _main_grad_module(single, overwrite)
    splits = [32] * E  # activations (256 x 1024) are far smaller than one weight (1024 x 1024)
    x = torch.randn(sum(splits), 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), 1024, device="cuda", dtype=torch.bfloat16)
    module(x, splits).backward(dy)  # warm-up: workspace, cached dummy
    x.grad = None
    y = module(x, splits)
    grown = cuda_peak_growth(lambda: y.backward(dy))
    one_weight = 1024 * 1024 * 2
    assert grown < one_weight, f"backward allocated {grown} bytes (one bf16 weight: {one_weight})"


def test_cuda_graph_capture_of_forward_and_backward_with_device_splits() -> None:
    module = _main_grad_module(single=False, overwrite=True)
    params = [getattr(module, n) for n in module.weight_names]
    tokens = 512
    static_x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    static_splits = torch.tensor([64] * E, device="cuda")

    def step() -> None:
        module(static_x, static_splits).backward(static_dy)

    graph = capture(step, grads_of=[static_x])
    main_grads = [p.main_grad for p in params]
    refill = [static_x, static_dy]
    for splits in replay_with_new_splits(
        graph, static_splits, refill=refill, main_grads=main_grads
    ):
        _, dx_ref, dw_ref = _reference(static_x.detach(), static_dy, params, splits, 1.0, 1.0)
        _assert_bf16_close(static_x.grad, dx_ref, f"dx for splits {splits}")
        for e, p in enumerate(params):
            _assert_bf16_close(p.main_grad, dw_ref[e], f"main_grad {e} for splits {splits}")


@pytest.mark.parametrize("bias", [False, True])
def test_torch_compile_on_cuda_matches_eager(bias: bool) -> None:
    torch.manual_seed(2)
    module = GroupedLinear(E, K, N, bias=bias, dtype=torch.bfloat16, device="cuda")
    splits = SPLITS[0]
    x = torch.randn(sum(splits), K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), N, device="cuda", dtype=torch.bfloat16)

    def step(inp: torch.Tensor) -> torch.Tensor:
        return (module(inp, splits).float() * dy.float()).sum()

    assert_compiled_matches_eager(step, [x], module)
    # the (equal) gradients against the independent fp64 oracle, not only compiled vs eager
    weights = [getattr(module, f"weight{e}") for e in range(E)]
    _, dx64, dw64 = _reference(x.detach(), dy, weights, splits, 1.0, 1.0)
    _assert_bf16_close(x.grad, dx64, "dx")
    for e in range(E):
        _assert_bf16_close(weights[e].grad, dw64[e], f"wgrad {e}")
        if bias:
            db64 = dy.double().split(splits)[e].sum(0)
            _assert_bf16_close(getattr(module, f"bias{e}").grad, db64, f"bias grad {e}")
