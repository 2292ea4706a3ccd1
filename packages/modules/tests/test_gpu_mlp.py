"""GroupedMLP on a CUDA device (CUTLASS GEMMs, Triton SwiGLU) against an fp64 reference.

Run on the H200 with ``nox -s tests-gpu`` or
``pytest -m gpu packages/modules/tests/test_gpu_mlp.py``.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn import functional as F

from groupgrad.modules import GroupedMLP
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

E, H, FFN = 8, 128, 96
SPLITS = STEP_SPLITS


def _weights(module: GroupedMLP, layer: str) -> list[torch.Tensor]:
    linear = getattr(module, layer)
    return [getattr(linear, n) for n in linear.weight_names]


def _experts(module: GroupedMLP, layer: str) -> list[torch.Tensor]:
    ws = _weights(module, layer)
    return (
        list(ws[0].detach().double().unbind(0))
        if len(ws) == 1
        else [w.detach().double() for w in ws]
    )


def _reference(module, x, probs, dy, splits, fwd=1.0, bwd=1.0):
    """fp64 per-expert reference with PyTorch's SwiGLU: y, dx, dprobs, per-expert dw1 and dw2."""
    w1s, w2s = _experts(module, "fc1"), _experts(module, "fc2")
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("y", "dx", "dp", "dw1", "dw2")}
    p_all = torch.ones(x.shape[0], dtype=torch.float64, device=x.device)
    p_all = p_all if probs is None else probs.detach().double()
    for e, (x_e, dy_e, p_e) in enumerate(
        zip(x.double().split(splits), dy.double().split(splits), p_all.split(splits), strict=True)
    ):
        h = (x_e @ (fwd * w1s[e]).T).requires_grad_()
        p_e = p_e.clone().requires_grad_()
        gate, up = h.chunk(2, dim=1)
        a = F.silu(gate) * up * p_e[:, None]
        out["y"].append(a.detach() @ (fwd * w2s[e]).T)
        dh, dp = torch.autograd.grad(a, [h, p_e], dy_e @ (bwd * w2s[e]))
        out["dx"].append(dh @ (bwd * w1s[e]))
        out["dp"].append(dp)
        out["dw1"].append(dh.T @ x_e)
        out["dw2"].append(dy_e.T @ a.detach())
    return {k: torch.cat(v) if k in ("y", "dx", "dp") else v for k, v in out.items()}


def _assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_within_scale(actual, expected, rel=2e-2, atol=1e-3, what=what)


@pytest.mark.parametrize(
    ("single", "kind", "main_grad", "delay", "device_splits"),
    list(
        itertools.product(
            [False, True],
            ["plain", "distributed"],
            ["none", "accumulate", "overwrite"],
            [False, True],
            [False, True],
        )
    ),
)
def test_grouped_mlp_on_cuda(single, kind, main_grad, delay, device_splits) -> None:
    torch.manual_seed(0)
    module = GroupedMLP(
        E,
        H,
        FFN,
        dtype=torch.bfloat16,
        device="cuda",
        single_grouped_weight=single,
        accumulate_into_main_grad=main_grad != "none",
        delay_wgrad_compute=delay,
    )
    if kind == "distributed":
        distribute_fake(module.fc1, main_grad)
        distribute_fake(module.fc2, main_grad)
    params = _weights(module, "fc1") + _weights(module, "fc2")
    attach_main_grads(params, main_grad)
    initial = [p.main_grad.clone() for p in params] if main_grad == "accumulate" else None
    fwd, bwd = (2.0, 4.0) if kind == "distributed" else (1.0, 1.0)
    layer_sizes = {"dw1": (2 * FFN, H), "dw2": (H, FFN)}
    total = {
        k: [torch.zeros(s, dtype=torch.float64, device="cuda")] * E for k, s in layer_sizes.items()
    }

    for step, splits in enumerate(SPLITS):
        tokens = sum(splits)
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(tokens, device="cuda", requires_grad=True) if step != 1 else None
        dy = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        arg = torch.tensor(splits, device="cuda") if device_splits else splits
        ref = _reference(module, x.detach(), probs, dy, splits, fwd, bwd)
        y = module(x, arg, probs)
        y.backward(dy)
        module.backward_dw()
        torch.cuda.synchronize()
        _assert_bf16_close(y, ref["y"], "y")
        _assert_bf16_close(x.grad, ref["dx"], "dx")
        if probs is not None:
            _assert_bf16_close(probs.grad, ref["dp"], "dprobs")
        for key in ("dw1", "dw2"):
            total[key] = [t + d for t, d in zip(total[key], ref[key], strict=True)]
        expected_latest = []
        expected_total = []
        for key in ("dw1", "dw2"):
            if single:
                expected_latest.append(torch.stack(ref[key]))
                expected_total.append(torch.stack(total[key]))
            else:
                expected_latest += ref[key]
                expected_total += total[key]
        for index, p in enumerate(params):
            label = f"parameter {index} at step {step}"
            if main_grad == "none":
                _assert_bf16_close(p.grad, expected_total[index], f".grad of {label}")
                continue
            if main_grad == "overwrite":
                _assert_bf16_close(p.main_grad, expected_latest[index], f"main_grad of {label}")
            else:
                want = initial[index].double() + expected_total[index]
                _assert_bf16_close(p.main_grad, want, f"main_grad of {label}")
            assert p.grad_added_to_main_grad is True
            assert p.grad is not None
            assert not p.grad.any()
    if kind == "distributed" and main_grad != "none":
        for layer in ("fc1", "fc2"):
            leader = _weights(module, layer)[0]
            assert isinstance(leader, FakeDistributedWeight)
            assert all(g.dtype == torch.float32 for g in leader.finalized[0])


def _main_grad_mlp(hidden: int, ffn: int, overwrite: bool, single: bool = False) -> GroupedMLP:
    module = GroupedMLP(
        E,
        hidden,
        ffn,
        dtype=torch.bfloat16,
        device="cuda",
        single_grouped_weight=single,
        accumulate_into_main_grad=True,
    )
    for p in _weights(module, "fc1") + _weights(module, "fc2"):
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        p.overwrite_main_grad = overwrite
        p.grad_added_to_main_grad = False
    return module


def test_forward_keeps_exactly_h_beside_its_output_and_inputs() -> None:
    hidden, ffn, tokens = 1024, 1536, 4096
    module = _main_grad_mlp(hidden, ffn, overwrite=True)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, device="cuda", requires_grad=True)
    splits = [tokens // E] * E
    module(x, splits, probs).backward(torch.randn(tokens, hidden, device="cuda").bfloat16())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = module(x, splits, probs)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    h_bytes, y_bytes = tokens * 2 * ffn * 2, tokens * hidden * 2
    slack = 1 << 20
    assert h_bytes + y_bytes <= kept <= h_bytes + y_bytes + slack, (
        f"forward kept {kept} bytes; expected h ({h_bytes}) + y ({y_bytes}) and nothing else"
    )
    del y


def _backward_peak_growth(module: GroupedMLP, hidden: int, splits: list[int]) -> int:
    """Bytes one backward's peak adds over what forward left, after a warm-up step."""
    tokens = sum(splits)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    module(x, splits, probs).backward(dy)  # warm-up: workspace, cached dummies, Triton compile
    x.grad = probs.grad = None
    y = module(x, splits, probs)
    return cuda_peak_growth(lambda: y.backward(dy))


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("overwrite", [False, True])
def test_main_grad_backward_allocates_nothing_weight_sized_on_cuda(single, overwrite) -> None:
    hidden, ffn = 2048, 2048
    module = _main_grad_mlp(hidden, ffn, overwrite, single)
    splits = [32] * E  # activations (256 rows) are far smaller than one expert's weight
    grown = _backward_peak_growth(module, hidden, splits)
    one_weight = hidden * ffn * 2
    assert grown < one_weight, (
        f"backward allocated {grown} bytes (one bf16 expert weight: {one_weight})"
    )


def test_backward_peak_is_bounded_by_its_activation_gradients() -> None:
    # Backward needs da (T, F), dh (T, 2F), the recomputed a (T, F) and dx (T, H)
    # in bf16 at most at once; any wgrad scratch (one fp32 expert weight of fc1
    # alone is 2F*H*4 bytes) or a second copy of an activation would exceed it.
    hidden, ffn, tokens = 1024, 2048, 8192
    module = _main_grad_mlp(hidden, ffn, overwrite=False)
    splits = [tokens // E] * E
    grown = _backward_peak_growth(module, hidden, splits)
    bound = tokens * (ffn + 2 * ffn + ffn + hidden) * 2 + tokens * 4 + (1 << 20)
    assert grown <= bound, f"backward grew by {grown} bytes; its activation gradients need {bound}"


def test_torch_compile_on_cuda_matches_eager() -> None:
    torch.manual_seed(1)
    module = GroupedMLP(E, H, FFN, dtype=torch.bfloat16, device="cuda", bias=True)
    with torch.no_grad():  # zero biases keep the fp64 oracle below bias-free
        for name, p in module.named_parameters():
            if "bias" in name:
                p.zero_()
    splits = SPLITS[0]
    tokens = sum(splits)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)

    def step(inp: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return (module(inp, splits, p).float() * dy.float()).sum()

    assert_compiled_matches_eager(step, [x, probs], module)
    # the (equal) gradients against the independent fp64 oracle, not only compiled vs eager
    ref = _reference(module, x.detach(), probs, dy, splits)
    _assert_bf16_close(x.grad, ref["dx"], "dx")
    _assert_bf16_close(probs.grad, ref["dp"], "dprobs")
    for e in range(E):
        _assert_bf16_close(getattr(module.fc1, f"weight{e}").grad, ref["dw1"][e], f"fc1 wgrad {e}")
        _assert_bf16_close(getattr(module.fc2, f"weight{e}").grad, ref["dw2"][e], f"fc2 wgrad {e}")
        db2 = dy.double().split(splits)[e].sum(0)
        _assert_bf16_close(getattr(module.fc2, f"bias{e}").grad, db2, f"fc2 bias grad {e}")


def test_cuda_graph_capture_of_forward_and_backward_with_device_splits() -> None:
    module = _main_grad_mlp(256, 512, overwrite=True)
    params = _weights(module, "fc1") + _weights(module, "fc2")
    tokens = 512
    static_x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_probs = torch.rand(tokens, device="cuda", requires_grad=True)
    static_dy = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    static_splits = torch.tensor([64] * E, device="cuda")

    def step() -> None:
        module(static_x, static_splits, static_probs).backward(static_dy)

    graph = capture(step, grads_of=[static_x, static_probs])
    main_grads = [p.main_grad for p in params]
    refill = [static_x, static_probs, static_dy]
    for splits in replay_with_new_splits(
        graph, static_splits, refill=refill, main_grads=main_grads
    ):
        ref = _reference(module, static_x.detach(), static_probs, static_dy, splits)
        _assert_bf16_close(static_x.grad, ref["dx"], f"dx for splits {splits}")
        _assert_bf16_close(static_probs.grad, ref["dp"], f"dprobs for splits {splits}")
        for e in range(E):
            _assert_bf16_close(main_grads[e], ref["dw1"][e], f"fc1 main_grad {e}, {splits}")
            _assert_bf16_close(main_grads[E + e], ref["dw2"][e], f"fc2 main_grad {e}, {splits}")
