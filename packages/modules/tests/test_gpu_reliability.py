"""The reliability scenarios on CUDA with the CUTLASS kernels: each exact against fp64 or an error.

The CPU twins live in ``test_silent_wrong_gradients.py``; here the GEMMs run
in bf16 on the GPU, so fp32 wgrads come from the CUTLASS epilogue. With an
fp32 output, a wgrad is the fp32 sum of exact bf16 products: it matches the
fp64 product of the same bf16 operands to about 1e-5 relative, while a wgrad
rounded to bf16 on the way errs by about 4e-3 — the tolerance separates the
two.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from groupgrad.modules import GroupedLinear, GroupedMLP, grouped_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

E, K, N = 8, 128, 64
SPLITS = [0, 17, 33, 1, 0, 64, 9, 4]
REFILLED = [64, 0, 0, 40, 1, 17, 6, 0]  # same sum
CUDA = "cuda"


def _randn(*shape: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(CUDA)


def _wgrads_fp64(x, dy, splits):
    return [
        dy_e.double().T @ x_e.double()
        for x_e, dy_e in zip(x.detach().split(splits), dy.split(splits), strict=True)
    ]


def _close_fp32(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float32, f"{what} has dtype {got.dtype}"
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-4, msg=what)


def _fp32_grad_module(**options) -> GroupedLinear:
    torch.manual_seed(0)
    module = GroupedLinear(E, K, N, bias=False, dtype=torch.bfloat16, device=CUDA, **options)
    for p in module.parameters():
        p.grad_dtype = torch.float32
    return module


def _weight_grads(module: GroupedLinear) -> list[torch.Tensor]:
    if module.single_grouped_weight:
        return list(module.weight.grad.unbind(0))
    return [getattr(module, f"weight{e}").grad for e in range(E)]


@pytest.mark.parametrize("single", [False, True])
def test_fp32_grad_dtype_wgrads_come_unrounded_from_the_cutlass_epilogue(single: bool) -> None:
    module = _fp32_grad_module(single_grouped_weight=single)
    T = sum(SPLITS)
    x, dy = _randn(T, K, seed=1), _randn(T, N, seed=2)
    module(x, SPLITS).backward(dy)
    grads = _weight_grads(module)
    for e, (got, want) in enumerate(zip(grads, _wgrads_fp64(x, dy, SPLITS), strict=True)):
        _close_fp32(got, want, f"wgrad of expert {e}")
    values = torch.cat([g.flatten() for g in grads])
    values = values[values != 0]
    representable = (values == values.bfloat16().float()).float().mean().item()
    assert representable < 0.05, f"{representable:.1%} of the fp32 wgrad is bf16-representable"


BIAS_SPLITS = [0, 1700, 3300, 1, 0, 6400, 900, 400]  # N = 4096: the CUTLASS bias GEMM


def _bias_sums_fp64(dy: torch.Tensor) -> torch.Tensor:
    """Every expert's fp64 sum of its rows of ``dy``, experts one after another."""
    return torch.cat([dy_e.double().sum(0) for dy_e in dy.split(BIAS_SPLITS)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("single", [False, True])
def test_bias_gradients_are_the_fp32_sums_and_bitwise_reproducible(
    single: bool, dtype: torch.dtype
) -> None:
    # Catches: bias gradients summed by CUDA's index_add_, whose atomic adds land in an order
    # that changes from run to run (every run of a backward gave other bits); fp16 and fp32
    # dy summed so until DEVICE_RUNS 204.
    torch.manual_seed(0)
    module = GroupedLinear(E, K, 4096, dtype=dtype, device=CUDA, single_grouped_weight=single)
    for p in module.parameters():
        p.grad_dtype = torch.float32
    x = _randn(sum(BIAS_SPLITS), K, seed=7, dtype=dtype)
    dy = _randn(sum(BIAS_SPLITS), 4096, seed=8, dtype=dtype)
    runs = []
    for _ in range(4):
        module.zero_grad(set_to_none=True)
        module(x, BIAS_SPLITS).backward(dy)
        biases = [module.bias] if single else [getattr(module, f"bias{e}") for e in range(E)]
        runs.append(torch.cat([b.grad.flatten() for b in biases]))
    _close_fp32(runs[0], _bias_sums_fp64(dy), "bias gradients")
    assert all(torch.equal(run, runs[0]) for run in runs[1:]), "bias gradients differ between runs"


def test_fp32_bias_gradients_stay_fp32_sums_with_tf32_allowed(monkeypatch) -> None:
    # Catches: fp32 dy handed whole to the bias GEMM, whose reference path's cuBLAS then rounds
    # it to TF32 (10 bits) where the user allowed TF32 (about 5e-4 relative per value).
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    torch.manual_seed(0)
    module = GroupedLinear(E, K, 4096, device=CUDA, single_grouped_weight=True)
    x = _randn(sum(BIAS_SPLITS), K, seed=9, dtype=torch.float32)
    dy = _randn(sum(BIAS_SPLITS), 4096, seed=10, dtype=torch.float32)
    module(x, BIAS_SPLITS).backward(dy)
    _close_fp32(module.bias.grad.flatten(), _bias_sums_fp64(dy), "bias gradients")


@pytest.mark.parametrize("delay", [False, True])
def test_refilling_device_splits_after_forward_changes_nothing(delay: bool) -> None:
    module = _fp32_grad_module(delay_wgrad_compute=delay)
    splits = torch.tensor(SPLITS, device=CUDA)
    T = sum(SPLITS)
    x, dy = _randn(T, K, seed=3), _randn(T, N, seed=4)
    y = module(x, splits)
    splits.copy_(torch.tensor(REFILLED, device=CUDA))
    y.backward(dy)
    module.backward_dw()
    for e, (got, want) in enumerate(
        zip(_weight_grads(module), _wgrads_fp64(x, dy, SPLITS), strict=True)
    ):
        _close_fp32(got, want, f"wgrad of expert {e}")


def test_changed_input_before_backward_dw_is_an_error_on_cuda() -> None:
    module = _fp32_grad_module(delay_wgrad_compute=True)
    T = sum(SPLITS)
    x, dy = _randn(T, K, seed=5), _randn(T, N, seed=6)
    module(x, SPLITS).backward(dy)
    x.mul_(2)
    with pytest.raises(RuntimeError, match=r"x, which the deferred weight gradient"):
        module.backward_dw()
    assert all(g is None for g in (p.grad for p in module.parameters()))


def test_frozen_member_of_a_main_grad_group_is_untouched_on_cuda() -> None:
    torch.manual_seed(0)
    module = GroupedLinear(
        E, K, N, bias=False, dtype=torch.bfloat16, device=CUDA, accumulate_into_main_grad=True
    )
    weights = [getattr(module, f"weight{e}") for e in range(E)]
    weights[5].requires_grad_(False)
    for e, w in enumerate(weights):
        w.grad_added_to_main_grad = False
        if e != 5:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=CUDA)
    T = sum(SPLITS)
    x, dy = _randn(T, K, seed=7), _randn(T, N, seed=8)
    module(x, SPLITS).backward(dy)
    want = _wgrads_fp64(x, dy, SPLITS)
    assert weights[5].grad_added_to_main_grad is False
    assert weights[5].grad is None
    for e, w in enumerate(weights):
        if e != 5:
            _close_fp32(w.main_grad, want[e], f"main_grad of weight{e}")


def test_shared_dummy_is_rezeroed_on_cuda() -> None:
    def layer() -> GroupedLinear:
        module = GroupedLinear(
            2, K, N, bias=False, dtype=torch.bfloat16, device=CUDA, accumulate_into_main_grad=True
        )
        for p in module.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=CUDA)
            p.grad_added_to_main_grad = False
        return module

    x = _randn(40, K, seed=9)
    a = layer()
    a(x, [16, 24]).sum().backward()
    a.weight0.grad.add_(1.0)
    b = layer()
    b(x, [16, 24]).sum().backward()
    assert not b.weight0.grad.any()
    assert not b.weight1.grad.any()


@pytest.mark.parametrize("single", [False, True])
def test_autocast_on_cuda_gives_bf16_outputs_and_unrounded_fp32_wgrads(single: bool) -> None:
    torch.manual_seed(0)
    module = GroupedLinear(E, K, N, bias=False, device=CUDA, single_grouped_weight=single)
    T = sum(SPLITS)
    x = _randn(T, K, seed=10, dtype=torch.float32).requires_grad_()
    dy = _randn(T, N, seed=11)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x, SPLITS)
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    assert x.grad.dtype == torch.float32
    for e, (got, want) in enumerate(
        zip(_weight_grads(module), _wgrads_fp64(x.bfloat16(), dy, SPLITS), strict=True)
    ):
        _close_fp32(got, want, f"wgrad of expert {e} under autocast")


def test_grouped_mlp_with_fp32_grad_dtype_on_cuda() -> None:
    torch.manual_seed(0)
    H, Fh = 128, 64
    T = sum(SPLITS)
    w1 = _randn(E, 2 * Fh, H, seed=12).requires_grad_()
    w2 = _randn(E, H, Fh, seed=13).requires_grad_()
    for w in (w1, w2):
        w.grad_dtype = torch.float32
    x, dy = _randn(T, H, seed=14), _randn(T, H, seed=15)
    probs = torch.rand(T, device=CUDA)
    grouped_mlp(x, w1, w2, SPLITS, probs).backward(dy)
    assert w1.grad.dtype == w2.grad.dtype == torch.float32
    # fc2's wgrad is dy.T @ a with the bf16 activation the op fed fc2; rebuild a as the op
    # rounds it (h once, a once), then compare against the fp64 product
    h = torch.cat(
        [
            (x_e.double() @ w.double().T).bfloat16()
            for x_e, w in zip(x.split(SPLITS), w1.detach(), strict=True)
        ]
    )
    g, u = h.double().chunk(2, dim=1)
    a = (F.silu(g) * u * probs.double()[:, None]).bfloat16()
    for e, (got, want) in enumerate(
        zip(w2.grad.unbind(0), _wgrads_fp64(a, dy, SPLITS), strict=True)
    ):
        # one bf16 ulp of a's rounding may differ from the Triton kernel's: loose rtol on a few
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2, msg=f"fc2 expert {e}")
    values = w2.grad.flatten()[w2.grad.flatten() != 0]
    assert (values == values.bfloat16().float()).float().mean().item() < 0.05


def test_grouped_mlp_module_under_autocast_on_cuda() -> None:
    torch.manual_seed(0)
    module = GroupedMLP(E, 128, 64, device=CUDA, single_grouped_weight=True)
    T = sum(SPLITS)
    x = _randn(T, 128, seed=16, dtype=torch.float32).requires_grad_()
    dy = _randn(T, 128, seed=17)  # random: sums of ones over a few tokens stay bf16-exact
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x, SPLITS, torch.rand(T, device=CUDA))
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    for name, p in module.named_parameters():
        assert p.grad.dtype == torch.float32, name
        assert not p.grad.isnan().any(), name
        values = p.grad.flatten()[p.grad.flatten() != 0]
        representable = (values == values.bfloat16().float()).float().mean().item()
        assert representable < 0.05, f"{name}: {representable:.1%} bf16-representable (rounded?)"


@pytest.mark.parametrize("form", ["list", "cpu-tensor"])
def test_later_gemms_reuse_one_device_copy_of_host_splits(monkeypatch, form: str) -> None:
    """fc1's fprop checks the host counts; fc2's fprop and every backward GEMM reuse one
    int64 device copy made at forward (no per-GEMM conversion, no host sync)."""
    import groupgrad.modules._linear_fn as linear_fn
    import groupgrad.modules._wgrad as wgrad_module

    seen: list[object] = []
    real_fprop, real_dgrad, real_wgrad = (
        linear_fn.grouped_fprop,
        linear_fn.grouped_dgrad,
        wgrad_module.prepare_wgrad,
    )

    def spy(real):
        def call(a, b, splits, **kwargs):
            seen.append(splits)
            return real(a, b, splits, **kwargs)

        return call

    monkeypatch.setattr(linear_fn, "grouped_fprop", spy(real_fprop))
    monkeypatch.setattr(linear_fn, "grouped_dgrad", spy(real_dgrad))
    monkeypatch.setattr(wgrad_module, "prepare_wgrad", spy(real_wgrad))
    torch.manual_seed(0)
    mlp = GroupedMLP(E, K, N, dtype=torch.bfloat16, device=CUDA)
    x = _randn(sum(SPLITS), K, seed=41).requires_grad_()
    splits = list(SPLITS) if form == "list" else torch.tensor(SPLITS)
    mlp(x, splits).float().square().sum().backward()
    assert len(seen) == 6  # fc1, fc2 fprop; fc2, fc1 dgrad; fc2, fc1 wgrad
    assert not isinstance(seen[0], torch.Tensor) or seen[0].device.type == "cpu"
    copy = seen[1]
    assert isinstance(copy, torch.Tensor)
    assert copy.is_cuda
    assert copy.dtype == torch.int64
    assert all(s is copy for s in seen[1:])
    assert copy.tolist() == SPLITS
