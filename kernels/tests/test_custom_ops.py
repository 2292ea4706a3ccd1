"""The ``groupgrad::`` custom ops: ``torch.library.opcheck`` and ``torch.compile``.

On the CPU the ops run the reference, so their registration (schema, fake
kernels, declared mutation, functionalization) is testable without a GPU.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from groupgrad.kernels import _ops
from groupgrad_testsupport.gemms import GEMMS

KERNEL, REF = GEMMS["kernel"], GEMMS["ref"]
E, N, K = 4, 16, 24
SPLITS = [5, 0, 11, 3]
T = sum(SPLITS)


def rand(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def splits_tensor(dtype: torch.dtype = torch.int64) -> Tensor:
    return torch.tensor(SPLITS, dtype=dtype)


def fp64_per_expert(a: Tensor, group: Tensor | list[Tensor], product) -> list[Tensor]:
    """An independent oracle: ``product(a_e, w_e)`` in fp64 for each expert's rows of ``a``."""
    members = list(group.unbind(0)) if isinstance(group, Tensor) else group
    return [
        product(a_e.double(), w_e.double())
        for a_e, w_e in zip(a.split(SPLITS), members, strict=True)
    ]


def assert_near_fp64(got: Tensor, want: Tensor) -> None:
    """Within one rounding of ``got``'s dtype of the fp64 oracle (bf16: 2**-8 relative)."""
    rtol = {torch.bfloat16: 2**-7, torch.float32: 1e-5}[got.dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("weights_form", ["packed", "list"])
@pytest.mark.parametrize("splits_dtype", [torch.int32, torch.int64], ids=str)
def test_opcheck_fprop_and_dgrad(weights_form, splits_dtype):
    w_ENK = rand(E, N, K, seed=1)
    weights = [w_ENK] if weights_form == "packed" else list(rand(E, N, K, seed=2).unbind(0))
    splits = splits_tensor(splits_dtype)
    torch.library.opcheck(
        _ops.grouped_fprop_op,
        (rand(T, K), weights, splits, torch.empty(T, N, dtype=torch.bfloat16)),
    )
    torch.library.opcheck(
        _ops.grouped_dgrad_op,
        (rand(T, N), weights, splits, torch.empty(T, K, dtype=torch.bfloat16)),
    )


@pytest.mark.parametrize("out_form", ["packed", "list"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_opcheck_wgrad(out_form, accumulate):
    out = [rand(E, N, K, dtype=torch.float32)]
    if out_form == "list":
        out = [rand(N, K, dtype=torch.float32, seed=e) for e in range(E)]
    args = (rand(T, N, seed=3), rand(T, K, seed=4), splits_tensor(), out, accumulate)
    torch.library.opcheck(_ops.grouped_wgrad_op, args)


def test_ops_are_registered_for_cuda_without_touching_cuda():
    for name in ("grouped_fprop", "grouped_dgrad", "grouped_wgrad"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"groupgrad::{name}", "CUDA")
    assert not torch.cuda.is_initialized()


# --- torch.compile(fullgraph=True) ------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn):
    """The default backend (inductor): functionalizes the op's mutation, then re-inplaces it."""
    return torch.compile(fn, fullgraph=True)


@pytest.mark.parametrize("splits_form", ["list", "tensor"])
def test_compile_fprop_and_dgrad(splits_form):
    splits = SPLITS if splits_form == "list" else splits_tensor(torch.int32)
    x, dy, w_ENK = rand(T, K, seed=5), rand(T, N, seed=6), rand(E, N, K, seed=7)
    w_list = list(rand(E, N, K, seed=8).unbind(0))

    def step(x, dy, w_ENK, w_list, out_TN):
        y = KERNEL.fprop(x, w_ENK, splits, out=out_TN)
        return y * 2, KERNEL.dgrad(dy, w_list, splits)

    out_TN = torch.full((T, N), float("nan"), dtype=torch.bfloat16)
    y2, dx = compiled(step)(x, dy, w_ENK, w_list, out_TN)
    expected_y = REF.fprop(x, w_ENK, SPLITS)
    assert torch.equal(out_TN, expected_y)  # the mutation reached the caller's out
    assert torch.equal(y2, expected_y * 2)
    assert torch.equal(dx, REF.dgrad(dy, w_list, SPLITS))
    # and the reference itself against an independent fp64 loop
    assert_near_fp64(out_TN, torch.cat(fp64_per_expert(x, w_ENK, lambda a, w: a @ w.T)))
    assert_near_fp64(dx, torch.cat(fp64_per_expert(dy, w_list, lambda a, w: a @ w)))


@pytest.mark.parametrize("out_form", ["list", "views", "tensor"])
def test_compile_wgrad_into_main_grads(out_form):
    dy, x = rand(T, N, seed=9), rand(T, K, seed=10)
    main_ENK = rand(E, N, K, dtype=torch.float32, seed=11)
    initial = main_ENK.clone()
    expected = REF.wgrad(dy, x, SPLITS, out=main_ENK.clone(), accumulate=True)
    out: Tensor | list[Tensor] = main_ENK
    if out_form == "list":
        out = [t.clone() for t in main_ENK.unbind(0)]
    elif out_form == "views":
        out = list(main_ENK.unbind(0))

    def step(dy, x, out):
        fresh = KERNEL.wgrad(dy, x, SPLITS, out_dtype=torch.float32)
        return KERNEL.wgrad(dy, x, SPLITS, out=out, accumulate=True), fresh

    result, fresh = compiled(step)(dy, x, out)
    assert result is out
    got = out if isinstance(out, Tensor) else torch.stack(out)
    assert torch.equal(got, expected)
    assert torch.equal(fresh, REF.wgrad(dy, x, SPLITS, out_dtype=torch.float32))
    dw64 = torch.stack(
        [
            dy_e.double().T @ x_e.double()
            for dy_e, x_e in zip(dy.split(SPLITS), x.split(SPLITS), strict=True)
        ]
    )
    assert_near_fp64(fresh, dw64)
    assert_near_fp64(got, initial.double() + dw64)


# --- plain eager calls skip the op machinery; everything else goes through the op ----


@pytest.fixture
def ops_forbidden(monkeypatch):
    """The custom ops raise when called: a call that reaches one went through the op."""

    def forbidden(*args, **kwargs):
        raise AssertionError("went through the custom op")

    for name in ("grouped_fprop_op", "grouped_dgrad_op", "grouped_wgrad_op"):
        monkeypatch.setattr(_ops, name, forbidden)


def test_plain_eager_calls_run_the_kernel_directly_and_bump_versions(ops_forbidden):
    x, dy, w_ENK = rand(T, K, seed=12), rand(T, N, seed=13), rand(E, N, K, seed=14)
    y = torch.full((T, N), float("nan"), dtype=torch.bfloat16)
    dx = torch.full((T, K), float("nan"), dtype=torch.bfloat16)
    main = [rand(N, K, dtype=torch.float32, seed=e) for e in range(E)]
    expected_main = REF.wgrad(dy, x, SPLITS, out=[t.clone() for t in main], accumulate=True)
    versions = [t._version for t in (y, dx, *main)]
    KERNEL.fprop(x, w_ENK, splits_tensor(), out=y)
    KERNEL.dgrad(dy, torch.nn.Parameter(w_ENK, requires_grad=False), SPLITS, out=dx)
    with torch.no_grad():  # grad mode off: inputs that require grad are fine
        KERNEL.wgrad(dy.requires_grad_(), x, SPLITS, out=main, accumulate=True)
    assert torch.equal(y, REF.fprop(x, w_ENK, SPLITS))
    assert torch.equal(dx, REF.dgrad(dy.detach(), w_ENK, SPLITS))
    assert torch.equal(torch.stack(main), torch.stack(expected_main))
    assert all(t._version > v for t, v in zip((y, dx, *main), versions, strict=True))


def test_direct_calls_show_in_the_profiler_under_the_op_name(ops_forbidden):
    x, w_ENK = rand(T, K), rand(E, N, K, seed=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        KERNEL.fprop(x, w_ENK, SPLITS)
    assert "groupgrad::grouped_fprop" in {event.name for event in prof.events()}


def test_calls_autograd_would_record_are_refused_before_the_op(monkeypatch):
    seen = []
    monkeypatch.setattr(_ops, "grouped_fprop_op", lambda *args: seen.append(args))
    x = rand(T, K).requires_grad_()
    with pytest.raises(ValueError, match=r"^x requires grad, but grouped_fprop is not"):
        KERNEL.fprop(x, rand(E, N, K, seed=1), SPLITS)
    listed = [rand(N, K, seed=e) for e in range(E)]
    listed[2].requires_grad_()
    with pytest.raises(ValueError, match=r"^weights\[2\] requires grad, but grouped_fprop is"):
        KERNEL.fprop(x.detach(), listed, SPLITS)  # the member named, not the whole list
    assert not seen


def test_tracing_and_subclasses_go_through_the_op(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    monkeypatch.setattr(_ops, "grouped_wgrad_op", lambda *args: seen.append(args))
    dy, x = rand(T, N), rand(T, K, seed=1)
    with FakeTensorMode() as mode:  # a dispatch mode, and fake tensors
        fake_dy, fake_x = mode.from_tensor(dy), mode.from_tensor(x)
        KERNEL.wgrad(fake_dy, fake_x, SPLITS, out_dtype=torch.float32)
    assert len(seen) == 1
    assert not _ops.direct_call_ok([fake_dy, fake_x])
    assert not _ops.direct_call_ok([dy.to("meta")])
    assert _ops.direct_call_ok([dy, x])
