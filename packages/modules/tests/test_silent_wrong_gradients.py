"""Training-loop scenarios that once gave silently wrong gradients: each is exact or an error.

Every expectation comes from an independent fp64 computation (``F.linear`` per
expert, autograd in fp64), never from the code under test. Each test names
the broken behaviour it catches.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from groupgrad.kernels import grouped_wgrad
from groupgrad.modules import (
    GroupedLinear,
    GroupedMLP,
    grouped_linear,
    grouped_mlp,
    routed_grouped_mlp,
)
from groupgrad.modules._param_records import _FETCHED
from groupgrad.modules._wgrad import ReadyWgrad
from groupgrad.protocol import accumulate_grads_like_autograd
from groupgrad.protocol.testing import make_fake_group

E, K, N = 4, 16, 8
SPLITS = [4, 4, 3, 1]
REFILLED = [6, 2, 0, 4]  # same sum: a reused tokens-per-expert buffer, refilled


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _linear_fp64(x, weights, splits, biases=None):
    """``y_e = x_e @ w_e.T + b_e`` per expert, in fp64, differentiable in the inputs given."""
    rows = []
    for e, x_e in enumerate(x.double().split(list(splits))):
        bias = None if biases is None else biases[e].double()
        rows.append(F.linear(x_e, weights[e].double(), bias))
    return torch.cat(rows)


def _weight_grads_fp64(x, weights, splits, dy, biases=None):
    """fp64 gradients of ``sum(y * dy)`` w.r.t. each expert weight (and bias)."""
    leaves = [w.detach().double().requires_grad_() for w in weights]
    bias_leaves = None
    if biases is not None:
        bias_leaves = [b.detach().double().requires_grad_() for b in biases]
    y = _linear_fp64(x.detach(), leaves, splits, bias_leaves)
    targets = leaves + (bias_leaves or [])
    return torch.autograd.grad((y * dy.double()).sum(), targets)


def _mlp_grads_fp64(x, w1, w2, splits, probs, dy):
    """fp64 gradients of the SwiGLU MLP w.r.t. every fc1 and fc2 expert weight and x."""
    x64 = x.detach().double().requires_grad_()
    l1 = [w.detach().double().requires_grad_() for w in w1]
    l2 = [w.detach().double().requires_grad_() for w in w2]
    h = _linear_fp64(x64, l1, splits)
    g, u = h.chunk(2, dim=1)
    a = F.silu(g) * u * probs.detach().double()[:, None]
    y = _linear_fp64(a, l2, splits)
    grads = torch.autograd.grad((y * dy.double()).sum(), [x64, *l1, *l2])
    return grads[0], grads[1 : 1 + len(w1)], grads[1 + len(w1) :]


def _attach_main_grad(params, dtype=torch.float32, value=0.0):
    for p in params:
        p.main_grad = torch.full(p.shape, value, dtype=dtype)
        p.grad_added_to_main_grad = False


def _close(got, want, *, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


# ------------------------------------------------ 1. splits is a snapshot taken at forward


@pytest.mark.parametrize("kind", ["list", "cpu_tensor"])
@pytest.mark.parametrize("delay", [False, True])
def test_refilling_the_splits_buffer_after_forward_changes_nothing(kind: str, delay: bool) -> None:
    # Catches: splits kept by reference (weight0's gradient off by 2.5 before the fix).
    module = GroupedLinear(E, K, N, delay_wgrad_compute=delay)
    splits = list(SPLITS) if kind == "list" else torch.tensor(SPLITS)
    x, dy = _randn(sum(SPLITS), K, seed=1), _randn(sum(SPLITS), N, seed=2)
    y = module(x, splits)
    for e, count in enumerate(REFILLED):
        splits[e] = count
    y.backward(dy)
    module.backward_dw()
    weights = [getattr(module, f"weight{e}") for e in range(E)]
    biases = [getattr(module, f"bias{e}") for e in range(E)]
    want = _weight_grads_fp64(x, weights, SPLITS, dy, biases)
    for got, expected in zip([*weights, *biases], want, strict=True):
        _close(got.grad, expected)


@pytest.mark.parametrize("delay", [False, True])
def test_refilling_splits_after_a_grouped_mlp_forward_changes_nothing(delay: bool) -> None:
    module = GroupedMLP(E, K, 6, delay_wgrad_compute=delay)
    splits = torch.tensor(SPLITS)
    T = sum(SPLITS)
    x, probs, dy = _randn(T, K, seed=3), torch.rand(T), _randn(T, K, seed=4)
    y = module(x, splits, probs)
    splits.copy_(torch.tensor(REFILLED))
    y.backward(dy)
    module.backward_dw()
    w1 = [getattr(module.fc1, f"weight{e}") for e in range(E)]
    w2 = [getattr(module.fc2, f"weight{e}") for e in range(E)]
    _, want1, want2 = _mlp_grads_fp64(x, w1, w2, SPLITS, probs, dy)
    for got, expected in zip([*w1, *w2], [*want1, *want2], strict=True):
        _close(got.grad, expected)


def test_the_functional_ops_snapshot_splits_too() -> None:
    weights = [_randn(N, K, seed=10 + e).requires_grad_() for e in range(E)]
    splits = list(SPLITS)
    x, dy = _randn(sum(SPLITS), K, seed=5), _randn(sum(SPLITS), N, seed=6)
    y = grouped_linear(x, weights, splits)
    splits[:] = REFILLED
    y.backward(dy)
    for got, want in zip(weights, _weight_grads_fp64(x, weights, SPLITS, dy), strict=True):
        _close(got.grad, want)


# ------------------------------------- 2. what backward_dw() reads is version-checked


@pytest.mark.parametrize("single", [False, True])
def test_input_changed_in_place_before_backward_dw_is_an_error_and_writes_nothing(
    single: bool,
) -> None:
    # Catches: the deferred GEMM reading x after x.mul_(2) (a 2x gradient before the fix).
    module = GroupedLinear(E, K, N, delay_wgrad_compute=True, single_grouped_weight=single)
    x, dy = _randn(sum(SPLITS), K, seed=7), _randn(sum(SPLITS), N, seed=8)
    module(x, SPLITS).backward(dy)
    x.mul_(2)
    with pytest.raises(RuntimeError, match=r"backward_dw\(\): x, which the deferred"):
        module.backward_dw()
    assert all(p.grad is None for n, p in module.named_parameters() if "weight" in n)
    with pytest.raises(RuntimeError, match=r"no backward has queued"):
        module.backward_dw()  # the broken job was dropped, not left to run later


def test_output_grad_changed_in_place_before_backward_dw_is_an_error() -> None:
    module = GroupedLinear(E, K, N, bias=False, delay_wgrad_compute=True)
    _attach_main_grad(module.parameters(), value=float("nan"))
    module.accumulate_into_main_grad = True
    for p in module.parameters():
        p.overwrite_main_grad = True
    x, dy = _randn(sum(SPLITS), K, seed=9), _randn(sum(SPLITS), N, seed=10)
    module(x, SPLITS).backward(dy)
    dy.zero_()
    with pytest.raises(RuntimeError, match=r"dy, which the deferred weight gradient of 'weight0'"):
        module.backward_dw()
    assert all(p.main_grad.isnan().all() for p in module.parameters())  # nothing written


def test_mlp_input_changed_before_backward_dw_is_an_error() -> None:
    module = GroupedMLP(E, K, 6, delay_wgrad_compute=True)
    T = sum(SPLITS)
    x, dy = _randn(T, K, seed=11), _randn(T, K, seed=12)
    module(x, SPLITS).backward(dy)
    x.add_(1.0)
    with pytest.raises(
        RuntimeError, match=r"x, which the deferred weight gradient of 'fc1\.weight0'"
    ):
        module.backward_dw()
    assert all(p.grad is None for p in module.parameters())


def test_unchanged_inputs_run_the_deferred_wgrad_exactly() -> None:
    # Control for the three tests above: the check does not fire without a change.
    module = GroupedLinear(E, K, N, delay_wgrad_compute=True)
    x, dy = _randn(sum(SPLITS), K, seed=13), _randn(sum(SPLITS), N, seed=14)
    module(x, SPLITS).backward(dy)
    module.backward_dw()
    weights = [getattr(module, f"weight{e}") for e in range(E)]
    for got, want in zip(weights, _weight_grads_fp64(x, weights, SPLITS, dy), strict=True):
        _close(got.grad, want)


# -------------------- 2b. weights changed in place between forward and backward


@pytest.mark.parametrize("fp8", [None, "blockwise"])
@pytest.mark.parametrize("single", [False, True])
def test_a_weight_changed_in_place_before_backward_is_an_error_and_writes_nothing(
    single: bool, fp8: str | None
) -> None:
    # Catches: backward's dgrad reading the weight as edited after forward (the gradient of
    # values the forward never saw; nn.Linear raises here), or raising after main_grad is written.
    k, n = (128, 128) if fp8 else (K, N)
    module = GroupedLinear(E, k, n, bias=False, single_grouped_weight=single, fp8_recipe=fp8)
    module.accumulate_into_main_grad = True
    _attach_main_grad(module.parameters(), value=7.0)
    x = _randn(sum(SPLITS), k, seed=20).requires_grad_()
    y = module(x, SPLITS)
    edited = "weight" if single else "weight2"
    with torch.no_grad():
        getattr(module, edited).mul_(-2.0)
    with pytest.raises(RuntimeError, match=rf"^{edited} was modified in place after the forward"):
        y.backward(_randn(sum(SPLITS), n, seed=21))
    assert x.grad is None
    assert all((p.main_grad == 7.0).all() for p in module.parameters())


@pytest.mark.parametrize("fp8", [None, "blockwise"])
def test_a_distributed_member_changed_in_place_before_backward_is_an_error(
    fp8: str | None,
) -> None:
    # Catches: a DistributedWeight group's members (the shards its implementer gathers from)
    # edited in place after the forward, then gathered again by the backward: the dgrad of
    # values the forward never saw, silently (plain weights raise here).
    k, n = (128, 128) if fp8 else (K, N)
    layer = GroupedLinear(E, k, n, bias=False, accumulate_into_main_grad=True, fp8_recipe=fp8)
    group = make_fake_group(
        [getattr(layer, f"weight{e}") for e in range(E)], main_grad_dtype=torch.float32
    )
    for e, member in enumerate(group):
        setattr(layer, f"weight{e}", member)
    x = _randn(sum(SPLITS), k, seed=26).requires_grad_()
    y = layer(x, SPLITS)
    with torch.no_grad():
        group[2].mul_(-2.0)
    with pytest.raises(RuntimeError, match=r"^weight2 was modified in place after the forward"):
        y.backward(_randn(sum(SPLITS), n, seed=27))
    assert x.grad is None
    assert not group[0].finalized  # type: ignore[attr-defined]  # nothing reduced
    assert all(not w.main_grad.any() for w in group)


def test_a_weight_changed_in_place_is_no_error_where_no_gradient_reads_it() -> None:
    # Catches: a check that refuses more than autograd does: without dx nothing reads the weight.
    module = GroupedLinear(E, K, N, bias=False)
    x, dy = _randn(sum(SPLITS), K, seed=22), _randn(sum(SPLITS), N, seed=23)
    y = module(x, SPLITS)  # x needs no gradient: only the wgrad, which reads x and dy
    with torch.no_grad():
        module.weight1.add_(1.0)
    y.backward(dy)
    want = _weight_grads_fp64(x, [getattr(module, f"weight{e}") for e in range(E)], SPLITS, dy)
    for e in range(E):
        _close(getattr(module, f"weight{e}").grad, want[e])


@pytest.mark.parametrize("layer", ["fc1", "fc2"])
def test_an_mlp_weight_changed_in_place_before_backward_is_an_error(layer: str) -> None:
    module = GroupedMLP(E, K, 6, bias=False, accumulate_into_main_grad=True)
    _attach_main_grad(module.parameters(), value=3.0)
    T = sum(SPLITS)
    x = _randn(T, K, seed=24).requires_grad_()
    y = module(x, SPLITS)
    with torch.no_grad():
        getattr(module, layer).weight0.add_(1.0)
    with pytest.raises(RuntimeError, match=rf"^{layer}\.weight0 was modified in place"):
        y.backward(_randn(T, K, seed=25))
    assert all((p.main_grad == 3.0).all() for p in module.parameters())


def test_optimizer_steps_between_iterations_are_no_error() -> None:
    # Catches: versions compared across forwards (each forward records its own).
    module = GroupedMLP(E, K, 6)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    T = sum(SPLITS)
    for step in range(3):
        x = _randn(T, K, seed=30 + step).requires_grad_()
        module(x, SPLITS).backward(_randn(T, K, seed=40 + step))
        optimizer.step()
        optimizer.zero_grad()


# ------------------------------------------------ 3. a frozen member is never written


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("overwrite", [False, True])
def test_frozen_member_of_a_main_grad_group_is_untouched_and_needs_no_main_grad(
    delay: bool, overwrite: bool
) -> None:
    # Catches: a frozen weight's main_grad accumulated and flagged, or a KeyError-like
    # crash when frameworks gave only the trainable weights a main_grad.
    module = GroupedLinear(
        E, K, N, bias=False, accumulate_into_main_grad=True, delay_wgrad_compute=delay
    )
    weights = [getattr(module, f"weight{e}") for e in range(E)]
    weights[1].requires_grad_(False)
    trainable = [w for w in weights if w.requires_grad]
    _attach_main_grad(trainable, value=0.5)
    for w in trainable:
        w.overwrite_main_grad = overwrite
    weights[1].grad_added_to_main_grad = False  # a framework's flag, but no main_grad
    x, dy = _randn(sum(SPLITS), K, seed=15), _randn(sum(SPLITS), N, seed=16)
    module(x, SPLITS).backward(dy)
    module.backward_dw()
    want = _weight_grads_fp64(x, weights, SPLITS, dy)
    assert weights[1].grad is None
    assert weights[1].grad_added_to_main_grad is False
    assert not hasattr(weights[1], "main_grad")
    for e in (0, 2, 3):
        base = 0.0 if overwrite else 0.5
        _close(weights[e].main_grad, want[e] + base)
        assert weights[e].grad_added_to_main_grad is True


@pytest.mark.parametrize("packed", [False, True], ids=["per-expert", "packed"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_frozen_members_own_main_grad_is_never_written(packed: bool, overwrite: bool) -> None:
    # Catches: a frozen member that has a main_grad handed it as the GEMM's scratch (the
    # frozen expert's buffer then receives a gradient it must never get).
    module = GroupedMLP(E, K, 6, single_grouped_weight=packed, accumulate_into_main_grad=True)
    frozen = module.fc1.weight if packed else module.fc1.weight1  # packed: all of fc1
    frozen.requires_grad_(False)
    _attach_main_grad(module.parameters(), value=0.25)  # the frozen one has a main_grad too
    for p in module.parameters():
        p.overwrite_main_grad = overwrite
    before = frozen.main_grad.clone()
    T = sum(SPLITS)
    x, probs, dy = _randn(T, K, seed=23), torch.rand(T), _randn(T, K, seed=24)
    module(x, SPLITS, probs).backward(dy)
    assert torch.equal(frozen.main_grad, before)  # bit-identical
    assert frozen.grad is None
    written = [p for p in module.parameters() if p.requires_grad]
    assert written
    assert all(not torch.equal(p.main_grad, torch.full_like(p, 0.25)) for p in written)


def test_frozen_member_without_main_grad_gets_none_from_autograd_route() -> None:
    module = GroupedLinear(E, K, N, bias=False)
    module.weight2.requires_grad_(False)
    x, dy = _randn(sum(SPLITS), K, seed=17), _randn(sum(SPLITS), N, seed=18)
    module(x, SPLITS).backward(dy)
    weights = [getattr(module, f"weight{e}") for e in range(E)]
    want = _weight_grads_fp64(x, weights, SPLITS, dy)
    assert module.weight2.grad is None
    for e in (0, 1, 3):
        _close(weights[e].grad, want[e])


def test_frozen_packed_weight_is_never_written() -> None:
    module = GroupedLinear(
        E, K, N, single_grouped_weight=True, accumulate_into_main_grad=True, bias=True
    )
    module.weight.requires_grad_(False)
    module.weight.grad_added_to_main_grad = False
    x, dy = _randn(sum(SPLITS), K, seed=19), _randn(sum(SPLITS), N, seed=20)
    x.requires_grad_()
    module(x, SPLITS).backward(dy)
    assert module.weight.grad is None
    assert module.weight.grad_added_to_main_grad is False
    assert module.bias.grad is not None
    assert x.grad is not None


def test_frozen_fc2_member_of_a_grouped_mlp_is_untouched() -> None:
    module = GroupedMLP(E, K, 6, accumulate_into_main_grad=True)
    module.fc2.weight0.requires_grad_(False)
    params = [p for p in module.parameters() if p.requires_grad]
    _attach_main_grad(params)
    T = sum(SPLITS)
    x, probs, dy = _randn(T, K, seed=21), torch.rand(T), _randn(T, K, seed=22)
    module(x, SPLITS, probs).backward(dy)
    w1 = [getattr(module.fc1, f"weight{e}") for e in range(E)]
    w2 = [getattr(module.fc2, f"weight{e}") for e in range(E)]
    _, want1, want2 = _mlp_grads_fp64(x, w1, w2, SPLITS, probs, dy)
    assert not hasattr(module.fc2.weight0, "main_grad")
    assert module.fc2.weight0.grad is None
    for got, expected in zip([*w1, *w2[1:]], [*want1, *want2[1:]], strict=True):
        _close(got.main_grad, expected)


@pytest.mark.parametrize("layer", ["linear", "mlp"])
@pytest.mark.parametrize(
    ("main_grad", "delay"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_a_weight_frozen_at_forward_and_thawed_before_backward_gets_no_gradient(
    layer: str, main_grad: bool, delay: bool
) -> None:
    # Catches: the wgrad GEMM reading requires_grad at backward: a weight frozen when the
    # forward ran got a main_grad (and its flag) or a deferred .grad, where autograd gives none.
    opts = {"bias": False, "accumulate_into_main_grad": main_grad, "delay_wgrad_compute": delay}
    module = GroupedLinear(E, K, N, **opts) if layer == "linear" else GroupedMLP(E, K, 6, **opts)
    params = dict(module.named_parameters())
    _attach_main_grad(params.values())
    thawed = "weight2" if layer == "linear" else "fc1.weight2"
    params[thawed].requires_grad_(False)
    x = _randn(sum(SPLITS), K, seed=17)
    call = (lambda: module(x, SPLITS)) if layer == "linear" else (lambda: module(x, SPLITS, None))
    y = call()
    params[thawed].requires_grad_(True)
    if main_grad or delay:  # past autograd: refused before anything is written
        with pytest.raises(RuntimeError, match=rf"^'{thawed}' did not require grad when the "):
            y.sum().backward()  # delayed or not, backward refuses it
        for name, p in params.items():
            assert not p.main_grad.any(), name
            assert p.grad is None or not p.grad.any(), name
        return
    y.sum().backward()  # autograd drops the thawed weight's gradient, as for any op
    assert params[thawed].grad is None
    assert all(p.grad is not None for name, p in params.items() if name != thawed)


# ------------------------------------------------ 4. the shared dummy is zero when handed out


def _main_grad_layer(seed: int, **options) -> GroupedLinear:
    torch.manual_seed(seed)
    module = GroupedLinear(2, K, N, bias=False, accumulate_into_main_grad=True, **options)
    _attach_main_grad(module.parameters())
    return module


def test_a_fresh_layers_first_grad_is_zero_after_another_layer_wrote_into_its_grad() -> None:
    # Catches: one cached zero buffer behind every dummy, written through a.weight0.grad,
    # making a fresh layer's first .grad all ones.
    x = _randn(5, K, seed=23)
    a = _main_grad_layer(0)
    a(x, [2, 3]).sum().backward()
    a.weight0.grad.add_(1.0)  # weight decay / a hook writing into .grad in place
    b = _main_grad_layer(1)
    b(x, [2, 3]).sum().backward()
    assert b.weight0.grad is not None
    assert not b.weight0.grad.any()
    assert not b.weight1.grad.any()
    assert b.weight0.grad.data_ptr() == a.weight0.grad.data_ptr()  # still memory-free


def test_the_dummy_has_the_parameters_grad_dtype() -> None:
    module = GroupedLinear(
        2, K, N, bias=False, dtype=torch.bfloat16, accumulate_into_main_grad=True
    )
    _attach_main_grad(module.parameters())
    for p in module.parameters():
        p.grad_dtype = torch.float32
    x = _randn(5, K, seed=24, dtype=torch.bfloat16)
    module(x, [2, 3]).sum().backward()
    assert module.weight0.grad.dtype == torch.float32
    assert not module.weight0.grad.any()
    # handed out in the grad dtype, autograd took it without a cast: one shared storage
    assert module.weight0.grad.data_ptr() == module.weight1.grad.data_ptr()


# ---------------------------------- 5. accumulate_grads_like_autograd checks the shape


def test_accumulate_grads_like_autograd_rejects_a_same_numel_gradient_of_another_shape() -> None:
    # Catches: a (16, 4) gradient reshaped into a (4, 16) parameter, scrambled.
    param = torch.nn.Parameter(torch.zeros(4, 16))
    with pytest.raises(RuntimeError, match=r"grads\[0\] has shape \(16, 4\), expected .*\(4, 16\)"):
        accumulate_grads_like_autograd([param], [torch.ones(16, 4)])
    assert param.grad is None
    accumulate_grads_like_autograd([param], [torch.ones(4, 16)])
    assert torch.equal(param.grad, torch.ones(4, 16))


# ------------------------------------------------ the smaller fixes of the same issue


def test_a_bool_is_not_a_size() -> None:
    with pytest.raises(ValueError, match=r"num_groups is True, expected a positive int"):
        GroupedLinear(True, K, N)
    with pytest.raises(ValueError, match=r"out_features is False, expected a positive int"):
        GroupedLinear(E, K, False)


def test_a_transposed_main_grad_is_named_as_the_parameters_main_grad() -> None:
    module = GroupedLinear(E, K, N, bias=False, accumulate_into_main_grad=True)
    _attach_main_grad(module.parameters())
    module.weight1.main_grad = torch.zeros(K, N).t()  # right shape, column-major
    x = _randn(sum(SPLITS), K, seed=25)
    with pytest.raises(ValueError, match=r"weight1\.main_grad must be row-major"):
        module(x, SPLITS).sum().backward()
    assert not module.weight0.main_grad.any()  # nothing half-written


def test_grouped_wgrad_refuses_to_write_into_a_tensor_that_requires_grad() -> None:
    dy, x = _randn(6, N, seed=26), _randn(6, K, seed=27)
    out = torch.full((2, N, K), float("nan"), requires_grad=True)
    with pytest.raises(ValueError, match=r"out is a leaf tensor that requires grad"):
        grouped_wgrad(dy, x, [3, 3], out=out)
    listed = [torch.zeros(N, K), torch.zeros(N, K, requires_grad=True)]
    with pytest.raises(ValueError, match=r"out\[1\] is a leaf tensor that requires grad"):
        grouped_wgrad(dy, x, [3, 3], out=listed)
    assert out.isnan().all()
    assert not listed[0].any()
    with torch.no_grad():  # as PyTorch allows in-place writes to leaves under no_grad
        grouped_wgrad(dy, x, [3, 3], out=out)
    assert not out.isnan().any()


def test_a_module_saved_whole_overwrites_main_grad_in_a_new_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Catches: the per-parameter record of the backward that overwrote main_grad pickled with
    # torch.save(module): a fresh process numbers its backwards from the same start, so its
    # first backward took main_grad as already written and added to the stale buffer (off by
    # exactly the 1000 the buffer held).
    path = tmp_path / "layer.pt"
    save = (
        "import sys, torch\n"
        "from groupgrad.modules import GroupedLinear\n"
        "layer = GroupedLinear(4, 8, 4, bias=False, accumulate_into_main_grad=True)\n"
        "for p in layer.parameters():\n"
        "    p.main_grad = torch.zeros(p.shape); p.overwrite_main_grad = True\n"
        "layer(torch.randn(12, 8), [3, 2, 5, 2]).sum().backward()  # a warm-up step\n"
        "torch.save(layer, sys.argv[1])\n"
    )
    load = (
        "import sys, torch\n"
        "layer = torch.load(sys.argv[1], weights_only=False)\n"
        "for p in layer.parameters():\n"
        "    p.main_grad = torch.full(p.shape, 1000.0)  # stale: an overwrite never reads it\n"
        "x = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))\n"
        "layer(x, [3, 2, 5, 2]).sum().backward()\n"
        "want = torch.ones(4, 3, dtype=torch.float64) @ x[:3].double()\n"
        "print(float((layer.weight0.main_grad.double() - want).abs().max()))\n"
    )
    for code in (save, load):
        done = subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 1e-5


def test_a_module_saved_while_its_wgrad_is_deferred_loads_with_no_hooks_held() -> None:
    # Catches: the record of the hooks a deferred wgrad holds back pickled with torch.save
    # (torch drops the hooks themselves): the loaded copy took its own hooks for held already,
    # so autograd ran them at backward, before backward_dw() delivered the gradient (they saw
    # .grad None), and backward_dw() ran them again with the saved module's hooks.
    saved_hook_calls: list[torch.Tensor | None] = []
    layer = GroupedLinear(2, 8, 4, bias=False, delay_wgrad_compute=True)
    layer.weight0.register_post_accumulate_grad_hook(lambda p: saved_hook_calls.append(p.grad))
    x = _randn(6, 8, seed=40)
    layer(x, [3, 3]).sum().backward()  # the wgrad queued: the hooks held until backward_dw()
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    layer.backward_dw()
    saved_hook_calls.clear()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    seen: list[torch.Tensor | None] = []
    loaded.weight0.register_post_accumulate_grad_hook(
        lambda p: seen.append(None if p.grad is None else p.grad.clone())
    )
    loaded(x, [3, 3]).sum().backward()
    assert seen == []  # held back: the gradient has not landed
    loaded.backward_dw()
    want = torch.ones(4, 3, dtype=torch.float64) @ x[:3].double()
    assert len(seen) == 1
    assert seen[0] is not None
    _close(seen[0], want)
    assert saved_hook_calls == []  # torch.save drops hooks: the saved module's stay behind


# ------------------------------------------------ grad_dtype: fp32 wgrads, never bf16-rounded


def _bf16_representable_fraction(t: torch.Tensor) -> float:
    return float((t.float() == t.bfloat16().float()).float().mean())


@pytest.mark.parametrize("single", [False, True])
def test_bf16_weights_with_fp32_grad_dtype_get_fp32_wgrads_from_the_gemm(single: bool) -> None:
    # Catches: a wgrad computed in bf16 and upcast (100 % bf16-representable before the fix).
    splits = [40, 0, 64, 24]
    module = GroupedLinear(E, 64, 32, dtype=torch.bfloat16, single_grouped_weight=single)
    for p in module.parameters():
        p.grad_dtype = torch.float32
    T = sum(splits)
    x, dy = (
        _randn(T, 64, seed=28, dtype=torch.bfloat16),
        _randn(T, 32, seed=29, dtype=torch.bfloat16),
    )
    module(x, splits).backward(dy)
    if single:
        weights, biases = list(module.weight.unbind(0)), list(module.bias.unbind(0))
        grads = list(module.weight.grad.unbind(0)) + list(module.bias.grad.unbind(0))
    else:
        weights = [getattr(module, f"weight{e}") for e in range(E)]
        biases = [getattr(module, f"bias{e}") for e in range(E)]
        grads = [p.grad for p in (*weights, *biases)]
    want = _weight_grads_fp64(x, weights, splits, dy, biases)
    for got, expected in zip(grads, want, strict=True):
        assert got.dtype == torch.float32
        _close(got, expected, rtol=1e-5, atol=1e-5)
    nonzero = torch.cat([g.flatten() for g in grads[:E]])
    nonzero = nonzero[nonzero != 0]
    assert _bf16_representable_fraction(nonzero) < 0.05


def test_grouped_mlp_functional_with_fp32_grad_dtype_gets_unrounded_fp32_wgrads() -> None:
    T, H, Fh = sum(SPLITS), 16, 8
    w1 = _randn(E, 2 * Fh, H, seed=30, dtype=torch.bfloat16).requires_grad_()
    w2 = _randn(E, H, Fh, seed=31, dtype=torch.bfloat16).requires_grad_()
    for w in (w1, w2):
        w.grad_dtype = torch.float32
    x = _randn(T, H, seed=32, dtype=torch.bfloat16).requires_grad_()
    probs, dy = torch.rand(T), _randn(T, H, seed=33, dtype=torch.bfloat16)
    grouped_mlp(x, w1, w2, SPLITS, probs).backward(dy)
    assert w1.grad.dtype == w2.grad.dtype == torch.float32
    # fc2's wgrad is dy.T @ a for the bf16 activation a the op fed fc2: rebuild a the way
    # the op rounds it (h once into bf16, a once into bf16), then the fp64 product
    h = torch.cat(
        [
            x_e.double() @ w.double().T
            for x_e, w in zip(x.detach().split(SPLITS), w1.detach(), strict=True)
        ]
    ).bfloat16()
    g, u = h.double().chunk(2, dim=1)
    a = (F.silu(g) * u * probs.double()[:, None]).bfloat16().double()
    want2 = [
        dy_e.double().T @ a_e for dy_e, a_e in zip(dy.split(SPLITS), a.split(SPLITS), strict=True)
    ]
    for got, want in zip(w2.grad.unbind(0), want2, strict=True):
        _close(got, want, rtol=1e-5, atol=1e-5)
    for grad in (w1.grad, w2.grad):
        nonzero = grad.flatten()[grad.flatten() != 0]
        assert _bf16_representable_fraction(nonzero) < 0.05


def test_a_backward_dw_refused_for_a_missing_main_grad_keeps_its_job_for_a_retry() -> None:
    # Catches: the job popped before the main_grad checks (the micro-batch's gradient lost, its
    # post-accumulate hooks held for good, a retry told that nothing was queued).
    module = GroupedLinear(
        E, K, N, bias=False, single_grouped_weight=True, accumulate_into_main_grad=True,
        delay_wgrad_compute=True,
    )  # fmt: skip
    module.weight.grad_added_to_main_grad = False
    calls = []
    module.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p))
    T = sum(SPLITS)
    x, dy = _randn(T, K, seed=50), _randn(T, N, seed=51)
    module(x, SPLITS).backward(dy)
    with pytest.raises(RuntimeError, match=r"weight.*main_grad"):
        module.backward_dw()
    assert calls == []
    module.weight.main_grad = torch.zeros(module.weight.shape)
    module.backward_dw()  # the same job, now runnable
    want = _weight_grads_fp64(x, list(module.weight.unbind(0)), SPLITS, dy)
    for e in range(E):
        _close(module.weight.main_grad[e], want[e])
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match=r"no backward has queued"):
        module.backward_dw()


@pytest.mark.parametrize("delay", [False, True])
def test_a_main_grad_that_requires_grad_is_written_alike_with_and_without_delay(
    delay: bool,
) -> None:
    # Catches: backward_dw() running with grad on, where the kernels refuse to write into a
    # leaf that requires grad, while the same main_grad is written by backward (grad off).
    module = GroupedLinear(
        E, K, N, bias=False, single_grouped_weight=True, accumulate_into_main_grad=True,
        delay_wgrad_compute=delay,
    )  # fmt: skip
    module.weight.main_grad = torch.zeros(module.weight.shape, requires_grad=True)
    module.weight.grad_added_to_main_grad = False
    T = sum(SPLITS)
    x, dy = _randn(T, K, seed=52), _randn(T, N, seed=53)
    module(x, SPLITS).backward(dy)
    if delay:
        module.backward_dw()
    want = _weight_grads_fp64(x, list(module.weight.unbind(0)), SPLITS, dy)
    for e in range(E):
        _close(module.weight.main_grad[e].detach(), want[e])


# ------------------------------------------------ autocast


@pytest.mark.parametrize("single", [False, True])
def test_autocast_runs_bf16_gemms_and_delivers_fp32_wgrads_unrounded(single: bool) -> None:
    splits = [40, 0, 64, 24]
    module = GroupedLinear(E, 64, 32, single_grouped_weight=single)  # fp32 parameters
    T = sum(splits)
    x, dy = _randn(T, 64, seed=34).requires_grad_(), _randn(T, 32, seed=35)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x, splits)
        assert y.dtype == torch.bfloat16  # like nn.Linear under autocast
    y.backward(dy.bfloat16())
    assert x.grad.dtype == torch.float32
    weights = (
        list(module.weight.unbind(0))
        if single
        else [getattr(module, f"weight{e}") for e in range(E)]
    )
    grads = list(module.weight.grad.unbind(0)) if single else [w.grad for w in weights]
    # the GEMM saw bf16 operands: the exact wgrad of those, in fp32, never rounded to bf16
    x16, w16, dy16 = x.detach().bfloat16(), [w.detach().bfloat16() for w in weights], dy.bfloat16()
    want = _weight_grads_fp64(x16, w16, splits, dy16)
    for got, expected in zip(grads, want, strict=True):
        assert got.dtype == torch.float32
        _close(got, expected, rtol=1e-5, atol=1e-5)
    _close(
        y.detach(),
        _linear_fp64(
            x16,
            w16,
            splits,
            [
                b.detach().bfloat16()
                for b in (
                    module.bias.unbind(0)
                    if single
                    else [getattr(module, f"bias{e}") for e in range(E)]
                )
            ],
        ),
        rtol=1e-2,
        atol=1e-2,
    )


def test_autocast_with_a_grouped_mlp_matches_an_fp64_reference_of_its_bf16_operands() -> None:
    module = GroupedMLP(E, 16, 8)
    T = sum(SPLITS)
    x, probs, dy = _randn(T, 16, seed=36).requires_grad_(), torch.rand(T), _randn(T, 16, seed=37)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x, SPLITS, probs)
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    for p in module.parameters():
        assert p.grad.dtype == torch.float32
    w1 = [getattr(module.fc1, f"weight{e}").detach().bfloat16() for e in range(E)]
    w2 = [getattr(module.fc2, f"weight{e}").detach().bfloat16() for e in range(E)]
    _, want1, _ = _mlp_grads_fp64(x.detach().bfloat16(), w1, w2, SPLITS, probs, dy.bfloat16())
    got1 = [getattr(module.fc1, f"weight{e}").grad for e in range(E)]
    for got, want in zip(got1, want1, strict=True):
        _close(got, want, rtol=3e-2, atol=3e-2)  # fc1's wgrad reads bf16 dh from the SwiGLU step


# ------------------------------------------------ post-accumulate hooks with a delayed wgrad


def _hook_log(main_grad: bool, delay: bool, mlp: bool) -> list[float | None]:
    """What a post-accumulate hook of one weight saw over two micro-batches."""
    torch.manual_seed(30)
    options = {"accumulate_into_main_grad": main_grad, "delay_wgrad_compute": delay}
    module = GroupedMLP(E, K, 6, **options) if mlp else GroupedLinear(E, K, N, **options)
    if main_grad:
        _attach_main_grad(module.parameters())
    weight = module.fc1.weight0 if mlp else module.weight0
    seen: list[float | None] = []

    def hook(p: torch.Tensor) -> None:
        grad = p.main_grad if main_grad else p.grad
        seen.append(None if grad is None else float(grad.double().abs().sum()))

    weight.register_post_accumulate_grad_hook(hook)
    T = sum(SPLITS)
    for micro in range(2):
        x = _randn(T, K, seed=31 + micro)
        out = module(x, SPLITS, torch.rand(T)) if mlp else module(x, SPLITS)
        out.square().sum().backward()
        if delay:
            module.backward_dw()
    return seen


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "mlp"])
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_a_delayed_wgrad_runs_each_hook_once_on_the_complete_gradient(
    main_grad: bool, mlp: bool
) -> None:
    # Catches: autograd running the hooks at backward (on a stale .grad, or before main_grad
    # is written) and backward_dw() running them again.
    want = _hook_log(main_grad, delay=False, mlp=mlp)
    got = _hook_log(main_grad, delay=True, mlp=mlp)
    assert len(want) == 2
    assert want[1] > want[0] > 0
    assert got == pytest.approx(want, rel=1e-6)


def test_hooks_held_for_a_dropped_deferred_job_go_back_to_autograd() -> None:
    module = GroupedLinear(E, K, N, bias=False, delay_wgrad_compute=True)
    calls: list[int] = []
    module.weight0.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    x = _randn(sum(SPLITS), K, seed=33)
    module(x, SPLITS).sum().backward()
    x.mul_(2)  # the deferred job's input changed: backward_dw() drops it
    with pytest.raises(RuntimeError, match="was modified in place since backward"):
        module.backward_dw()
    assert calls == []
    module.delay_wgrad_compute = False  # nothing deferred any more: autograd runs the hook
    module(x, SPLITS).sum().backward()
    assert calls == [1]


@pytest.mark.parametrize("where", ["hook", "gemm"])
def test_a_backward_dw_that_raises_gives_every_held_hook_back_to_autograd(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: a raising hook (or GEMM: out of memory) leaving the holds of its group's
    # parameters, and of the job's GEMMs not run yet, in place for good: their hooks (a DDP
    # reduction) never ran again. The job is lost, as a backward that raises loses its gradients.
    module = GroupedMLP(E, K, 6, delay_wgrad_compute=True)
    calls: dict[str, int] = {}
    failing = [True]  # the first hook or GEMM to run raises, once

    def fail_once() -> None:
        if failing.pop() if failing else False:
            raise KeyError(f"a {where} failed")

    for name, param in module.named_parameters():

        def hook(p: torch.Tensor, name: str = name) -> None:
            calls[name] = calls.get(name, 0) + 1
            if where == "hook":
                fail_once()

        param.register_post_accumulate_grad_hook(hook)
    if where == "gemm":
        run = ReadyWgrad.run
        monkeypatch.setattr(ReadyWgrad, "run", lambda self: fail_once() or run(self))
    x = _randn(sum(SPLITS), K, seed=34)
    module(x, SPLITS).sum().backward()
    with pytest.raises(KeyError, match=f"a {where} failed"):
        module.backward_dw()
    assert sum(calls.values()) == (where == "hook")
    with pytest.raises(RuntimeError, match="no backward has queued"):
        module.backward_dw()
    calls.clear()
    module.delay_wgrad_compute = False  # nothing deferred any more: autograd runs the hooks
    module(x, SPLITS).sum().backward()
    assert calls == {name: 1 for name, _ in module.named_parameters()}


def _fresh_buffer_owner(layer: GroupedLinear) -> dict[str, list[torch.Tensor]]:
    """Make ``layer``'s weights hand out a fresh NaN buffer per ``get_main_grad()`` call, as
    DESIGN allows; return the buffers handed out, per name."""
    handed: dict[str, list[torch.Tensor]] = {}
    for name, param in layer.named_parameters():
        param.__fsdp_param__ = True  # type: ignore[attr-defined]
        param.overwrite_main_grad = True  # type: ignore[attr-defined]
        param.grad_added_to_main_grad = False  # type: ignore[attr-defined]

        def fresh(p: torch.Tensor = param, name: str = name) -> torch.Tensor:
            handed.setdefault(name, []).append(torch.full(p.shape, float("nan")))
            return handed[name][-1]

        param.get_main_grad = fresh  # type: ignore[attr-defined]
    return handed


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_get_main_grad_is_called_once_per_backward_for_a_layer_used_twice(delay: bool) -> None:
    # Catches: a layer used twice in one backward calling get_main_grad() for each GEMM; an
    # owner that hands out a fresh (uninitialised) buffer per call, as DESIGN allows, got the
    # second use's gradient added into garbage and lost the first's.
    layer = GroupedLinear(E, K, K, bias=False, accumulate_into_main_grad=True,
                          delay_wgrad_compute=delay)  # fmt: skip
    handed = _fresh_buffer_owner(layer)
    weights = [w.detach().double().requires_grad_() for w in layer.parameters()]
    for step in (1, 2):  # the second backward calls the getter again
        x, dy = _randn(sum(SPLITS), K, seed=60 + step), _randn(sum(SPLITS), K, seed=70 + step)
        layer(torch.tanh(layer(x, SPLITS)), SPLITS).backward(dy)
        if delay:
            layer.backward_dw()
        twice = _linear_fp64(torch.tanh(_linear_fp64(x, weights, SPLITS)), weights, SPLITS)
        want = torch.autograd.grad((twice * dy.double()).sum(), weights)
        for e, name in enumerate(f"weight{e}" for e in range(E)):
            assert len(handed[name]) == step, (name, step)
            _close(handed[name][-1], want[e])
        assert not _FETCHED, "the buffers a backward took outlive it"


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
@pytest.mark.parametrize("region", ["second", "first"])
def test_get_main_grad_is_called_once_per_backward_across_a_reentrant_checkpoint(
    delay: bool, region: str
) -> None:
    # Catches: the buffers a reentrant checkpoint region's GEMM took forgotten as the region's
    # nested graph task ended (the callback ran on that task, not on the backward): the use
    # outside the region, whose GEMM runs later in the same backward ("second": the region
    # is used second in forward, so runs first in backward), called get_main_grad() again.
    layer = GroupedLinear(E, K, K, bias=False, accumulate_into_main_grad=True,
                          delay_wgrad_compute=delay)  # fmt: skip
    handed = _fresh_buffer_owner(layer)
    weights = [w.detach().double().requires_grad_() for w in layer.parameters()]
    x, dy = _randn(sum(SPLITS), K, seed=90), _randn(sum(SPLITS), K, seed=91)
    in_region = lambda t: checkpoint(layer, t, SPLITS, use_reentrant=True)  # noqa: E731
    outside = lambda t: layer(t, SPLITS)  # noqa: E731
    first, second = (in_region, outside) if region == "first" else (outside, in_region)
    second(torch.tanh(first(x.requires_grad_()))).backward(dy)
    if delay:
        layer.backward_dw()
    twice = _linear_fp64(torch.tanh(_linear_fp64(x.detach(), weights, SPLITS)), weights, SPLITS)
    want = torch.autograd.grad((twice * dy.double()).sum(), weights)
    for e in range(E):
        assert len(handed[f"weight{e}"]) == 1, e
        _close(handed[f"weight{e}"][0], want[e])
    assert not _FETCHED, "the buffers a backward took outlive it"


def test_main_grads_a_failed_backward_took_go_at_the_next_backward() -> None:
    # Catches: the buffers fc2's plan took from get_main_grad() kept for good after fc1's plan
    # raised (autograd runs no queued callback for a backward that raised).
    mlp = GroupedMLP(E, K, 6, accumulate_into_main_grad=True)
    buffers = {name: torch.zeros(p.shape) for name, p in mlp.named_parameters()}
    for name, param in mlp.named_parameters():
        param.__fsdp_param__ = True  # type: ignore[attr-defined]
        param.get_main_grad = lambda name=name: buffers[name]  # type: ignore[attr-defined]
    buffers["fc1.weight0"], kept = None, buffers["fc1.weight0"]  # type: ignore[assignment]
    x = _randn(sum(SPLITS), K, seed=80)
    with pytest.raises(RuntimeError, match=r"get_main_grad\(\) returned NoneType"):
        mlp(x, SPLITS).sum().backward()
    assert _FETCHED, "fc2's plan took no buffer before fc1's failed: nothing left to forget"
    buffers["fc1.weight0"] = kept
    mlp(x, SPLITS).sum().backward()
    assert not _FETCHED


def _twice_differentiable_case(op: str) -> tuple[object, torch.Tensor, list[torch.Tensor]]:
    """``(fn, x, params)``: one grouped op of ``x`` and its weights (and router weights)."""
    if op == "linear":
        w = _randn(E, N, K, seed=40).requires_grad_()
        return (lambda x: grouped_linear(x, w, SPLITS)), _randn(sum(SPLITS), K, seed=41), [w]
    hidden, ffn = (128, 128) if op == "mlp_fp8" else (K, N)
    w1 = _randn(E, 2 * ffn, hidden, seed=42).requires_grad_()
    w2 = _randn(E, hidden, ffn, seed=43).requires_grad_()
    x = _randn(sum(SPLITS), hidden, seed=44)
    if op == "routed":
        slots = torch.arange(sum(SPLITS))  # top-1, tokens already in expert order
        top = torch.rand(sum(SPLITS), 1, generator=torch.Generator().manual_seed(45))
        top.requires_grad_()
        fn = lambda x: routed_grouped_mlp(x, w1, w2, slots, SPLITS, top)  # noqa: E731
        return fn, x, [w1, w2, top]
    recipe = "blockwise" if op == "mlp_fp8" else None
    return (lambda x: grouped_mlp(x, w1, w2, SPLITS, fp8_recipe=recipe)), x, [w1, w2]


@pytest.mark.parametrize("op", ["linear", "mlp", "mlp_fp8", "routed"])
@pytest.mark.parametrize("loss", ["square", "sum"])
def test_a_second_derivative_through_a_grouped_op_is_an_error_not_zero(op: str, loss: str) -> None:
    # Catches: the backward's gradients handed to create_graph=True as constants, so a gradient
    # penalty or a Hessian-vector product silently lacks the op's terms (x's second derivative
    # came out as the penalty's other term alone, the weights' as None). "sum": the output
    # gradient is a constant and the gradients depend on the op's inputs only.
    fn, x, params = _twice_differentiable_case(op)
    x.requires_grad_()
    leaves = [x, *params]

    def first_order(create_graph: bool) -> tuple[torch.Tensor, ...]:
        y = fn(x)  # type: ignore[operator]
        out = y.square().sum() if loss == "square" else y.sum()
        return torch.autograd.grad(out, leaves, create_graph=create_graph)

    plain, graphed = first_order(False), first_order(True)
    for a, b in zip(plain, graphed, strict=True):
        assert torch.equal(a, b.detach())  # first-order values unchanged
        assert not a.requires_grad
        assert b.requires_grad
    penalty = sum(g.square().sum() for g in graphed) + x.sum()
    with pytest.raises(RuntimeError, match="is differentiable once: a second derivative"):
        penalty.backward()


def _writing_main_grads(
    kind: str, delay: bool, main_grad: bool = True
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A per-expert layer writing every weight's fp32 ``main_grad`` (``"mlp_fp8"``: H = F =
    128, FP8); with ``main_grad=False`` one whose wgrads go to ``.grad``."""
    torch.manual_seed(50)
    if kind == "linear":
        layer: torch.nn.Module = GroupedLinear(
            E, K, N, bias=False, accumulate_into_main_grad=main_grad, delay_wgrad_compute=delay
        )
    else:
        size = 128 if kind == "mlp_fp8" else K
        layer = GroupedMLP(
            E, size, size, accumulate_into_main_grad=main_grad, delay_wgrad_compute=delay,
            fp8_recipe="blockwise" if kind == "mlp_fp8" else None,
        )  # fmt: skip
    weights = list(layer.parameters())
    if main_grad:
        _attach_main_grad(weights)
    return layer, weights


def _first_layer(layer: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of ``layer``'s first grouped linear (a ``GroupedMLP``'s fc1)."""
    return list((layer.fc1 if isinstance(layer, GroupedMLP) else layer).parameters())


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlp_fp8"])
@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
@pytest.mark.parametrize("ask", ["autograd.grad", "inputs"])
def test_a_backward_for_the_input_only_leaves_main_grad_alone(
    kind: str, delay: bool, ask: str
) -> None:
    # Catches: torch.autograd.grad(loss, [x]) (adversarial examples, input saliency) or
    # backward(inputs=[x]) running the wgrad GEMMs anyway — into main_grad, or into a
    # backward_dw() job — so the next optimizer step reads a gradient nobody asked for.
    layer, weights = _writing_main_grads(kind, delay)
    x = _randn(sum(SPLITS), weights[0].shape[-1], seed=51).requires_grad_()
    out = layer(x, SPLITS).square().sum()
    if ask == "inputs":
        out.backward(inputs=[x])
        dx = x.grad
    else:
        (dx,) = torch.autograd.grad(out, [x])
    assert dx is not None
    assert float(dx.abs().sum()) > 0
    assert all(not w.main_grad.any() for w in weights)
    assert all(w.grad is None for w in weights)
    if delay:  # nothing was queued: the backward_dw() after it runs nothing, a second raises
        layer.backward_dw()  # type: ignore[operator]
        assert all(not w.main_grad.any() for w in weights)
        with pytest.raises(RuntimeError, match="no backward has queued a weight gradient"):
            layer.backward_dw()  # type: ignore[operator]
    # the same layer's full backward still writes every main_grad, once
    layer(x.detach(), SPLITS).square().sum().backward()
    if delay:
        layer.backward_dw()  # type: ignore[operator]
    assert all(w.main_grad.any() for w in weights)


@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "no-input-grad"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_backward_dw_after_a_backward_with_every_weight_frozen_runs_nothing(
    kind: str, input_grad: bool
) -> None:
    # Catches: backward_dw() raising "no backward has queued" after a backward whose layer had
    # every weight frozen (a fine-tune of the router only): Megatron's delayed wgrad schedule
    # calls it once after each backward, and training stopped at step 1. Without an input
    # that needs grad (the first layer of such a fine-tune) no backward reaches the layer.
    layer, weights = _writing_main_grads(kind, delay=True)
    for param in layer.parameters():
        param.requires_grad_(False)
    x = _randn(sum(SPLITS), weights[0].shape[-1], seed=52).requires_grad_(input_grad)
    head = torch.ones((), requires_grad=True)  # a trainable parameter after the layer
    for _ in range(2):
        (layer(x, SPLITS).square().sum() * head).backward()
        layer.backward_dw()  # type: ignore[operator]
    assert head.grad is not None
    assert (x.grad is not None) == input_grad
    assert all(not w.main_grad.any() and w.grad is None for w in weights)
    with pytest.raises(RuntimeError, match="no backward has queued a weight gradient"):
        layer.backward_dw()  # type: ignore[operator]


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlp_fp8"])
@pytest.mark.parametrize("route", ["main_grad", "main_grad delayed", "grad delayed"])
@pytest.mark.parametrize("ask", ["autograd.grad", "inputs"])
def test_a_backward_for_some_of_a_layers_weights_is_an_error_where_its_wgrads_pass_autograd(
    kind: str, route: str, ask: str
) -> None:
    # Catches: backward(inputs=[weight0]) or torch.autograd.grad(loss, [weight0]) running the
    # layer's one wgrad GEMM for every member anyway, into main_grad or a backward_dw() job
    # (which accumulates .grad), so weight1 gets a gradient nobody asked for.
    main_grad, delay = route.startswith("main_grad"), route.endswith("delayed")
    layer, weights = _writing_main_grads(kind, delay, main_grad)
    x = _randn(sum(SPLITS), weights[0].shape[-1], seed=52).requires_grad_()
    out = layer(x, SPLITS).square().sum()
    first = _first_layer(layer)[0]
    refused = r"asks for the gradients of \S*weight0 but not of \S*weight1, .*name all of"
    if route == "grad delayed" and ask == "autograd.grad":  # no backward_dw() can answer it
        refused = r"^torch\.autograd\.grad asks for the gradient of \S*weight0, which delay_wgr"
    run = (
        (lambda: out.backward(inputs=[first]))
        if ask == "inputs"
        else (lambda: torch.autograd.grad(out, [first]))
    )
    with pytest.raises(RuntimeError, match=refused):
        run()
    for w in weights:  # nothing written, flagged or queued
        assert w.grad is None
        if main_grad:
            assert not w.main_grad.any()
            assert w.grad_added_to_main_grad is False
    if delay:
        with pytest.raises(RuntimeError, match="no backward has queued a weight gradient"):
            layer.backward_dw()  # type: ignore[operator]


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlp_fp8"])
@pytest.mark.parametrize("allow_unused", [False, True])
def test_autograd_grad_of_delayed_weights_is_an_error_and_queues_nothing(
    kind: str, allow_unused: bool
) -> None:
    # Catches: torch.autograd.grad(loss, weights) of a layer with delay_wgrad_compute and no
    # main_grad answered None (or PyTorch's "appears to not have been used in the graph")
    # while a backward_dw() job was queued that would later put the gradient into .grad,
    # which torch.autograd.grad never touches.
    layer, weights = _writing_main_grads(kind, delay=True, main_grad=False)
    x = _randn(sum(SPLITS), weights[0].shape[-1], seed=53).requires_grad_()
    out = layer(x, SPLITS).square().sum()
    with pytest.raises(RuntimeError, match=r"^torch\.autograd\.grad asks for the gradient of "):
        torch.autograd.grad(out, weights, allow_unused=allow_unused)
    assert all(w.grad is None for w in weights)
    with pytest.raises(RuntimeError, match="no backward has queued a weight gradient"):
        layer.backward_dw()  # type: ignore[operator]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_gradient_hook_on_a_delayed_weight_is_an_error(kind: str) -> None:
    # Catches: a Tensor.register_hook hook (a gradient mask, a clip) on a weight whose
    # gradient backward_dw() puts into .grad: autograd called it with None at backward and
    # the unhooked gradient landed in .grad.
    layer, weights = _writing_main_grads(kind, delay=True, main_grad=False)
    _first_layer(layer)[0].register_hook(lambda g: g * 0)
    out = layer(_randn(sum(SPLITS), weights[0].shape[-1], seed=54), SPLITS).square().sum()
    with pytest.raises(
        RuntimeError,
        match=r"^a gradient hook \(Tensor\.register_hook\) is on "
        r"\S*weight0, .*delay_wgrad_compute=True",
    ):
        out.backward()
    assert all(w.grad is None for w in weights)
    with pytest.raises(RuntimeError, match="no backward has queued a weight gradient"):
        layer.backward_dw()  # type: ignore[operator]


def test_a_gradient_hook_on_a_delayed_layers_bias_runs_as_under_autograd() -> None:
    # A bias's gradient goes back through autograd at backward, delay or not: its hook runs.
    layer = GroupedLinear(E, K, N, bias=True, delay_wgrad_compute=True)
    layer.bias0.register_hook(lambda g: g * 0)
    layer(_randn(sum(SPLITS), K, seed=55), SPLITS).square().sum().backward()
    layer.backward_dw()
    assert not layer.bias0.grad.any()
    assert layer.bias1.grad.any()
    assert layer.weight0.grad.any()


def test_a_backward_for_some_of_a_distributed_groups_weights_is_an_error() -> None:
    # Catches: the all-or-none rule skipped for a distributed group without main_grad: its
    # one GEMM fills every member's buffer and the leader's finalize reduces them all.
    group = make_fake_group([_randn(N, K, seed=60 + e) for e in range(E)])
    out = grouped_linear(_randn(sum(SPLITS), K, seed=64), group, SPLITS).square().sum()
    with pytest.raises(RuntimeError, match="gradients of weight1 but not of weight0, weight2"):
        out.backward(inputs=[group[1]])
    assert group[0].calls["finalize_group_grads"] == 0  # type: ignore[attr-defined]
    assert all(w.grad is None for w in group)


@pytest.mark.parametrize("kind", ["mlp", "mlp_fp8"])
def test_a_backward_for_one_layers_weights_writes_that_layers_main_grads_only(kind: str) -> None:
    # Catches: a layer's delivery read off another layer's (or another member's) gradient node
    # — fc2's main_grads written for a backward that asks for fc1's, or fc1's left unwritten.
    layer, weights = _writing_main_grads(kind, False)
    fc1 = _first_layer(layer)
    x = _randn(sum(SPLITS), weights[0].shape[-1], seed=53)
    layer(x, SPLITS).square().sum().backward(inputs=fc1)
    asked = [w.main_grad.clone() for w in fc1]
    assert all(not w.main_grad.any() for w in weights if all(w is not f for f in fc1))
    _attach_main_grad(weights)
    layer(x, SPLITS).square().sum().backward()  # the full backward's fc1 main_grads
    assert all(got.any() for got in asked)
    for got, w in zip(asked, fc1, strict=True):
        assert torch.equal(got, w.main_grad)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("ask", ["autograd.grad", "inputs"])
def test_a_backward_for_some_weights_is_exact_where_autograd_takes_the_wgrads(
    kind: str, ask: str
) -> None:
    # Catches: the all-or-none rule applied where the wgrads go back to autograd, which keeps
    # only those asked for: one expert's gradient asked of a plain layer would be refused.
    layer, weights = _writing_main_grads(kind, False, main_grad=False)
    x = _randn(sum(SPLITS), weights[0].shape[-1], seed=54)
    dy = _randn(sum(SPLITS), weights[-1].shape[0], seed=55)
    first = _first_layer(layer)[1]
    out = (layer(x, SPLITS) * dy).sum()
    if ask == "inputs":
        out.backward(inputs=[first])
        got = first.grad
    else:
        (got,) = torch.autograd.grad(out, [first])
    if kind == "linear":
        want = _weight_grads_fp64(x, weights, SPLITS, dy)[1]
    else:
        fc1, fc2 = _first_layer(layer), list(layer.fc2.parameters())  # type: ignore[union-attr]
        want = _mlp_grads_fp64(x, fc1, fc2, SPLITS, torch.ones(sum(SPLITS)), dy)[1][1]
    _close(got, want)
    assert all(w.grad is None for w in weights if w is not first)


@pytest.mark.parametrize("regions", ["plain", "reentrant"])
@pytest.mark.parametrize("route", ["grad", "main_grad", "main_grad overwrite"])
@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_a_layer_used_twice_in_one_forward_gets_the_sum_of_both_uses(
    route: str, delay: bool, regions: str
) -> None:
    # Catches: with delay_wgrad_compute, one backward queueing a job per use (backward_dw(),
    # once per backward, left half the gradient for the next step; a hook ran on each half);
    # with overwrite_main_grad, the second use's GEMM overwriting the first's in main_grad.
    # "reentrant": each use in a region of its own under torch.utils.checkpoint with
    # use_reentrant=True, whose backward autograd runs as a graph task of its own, nested in
    # the outer backward: the uses must still count as one backward's.
    main_grad, overwrite = route.startswith("main_grad"), route.endswith("overwrite")
    torch.manual_seed(60)
    layer = GroupedLinear(
        E, K, N, bias=False, accumulate_into_main_grad=main_grad, delay_wgrad_compute=delay
    )
    weights = list(layer.parameters())
    if main_grad:
        _attach_main_grad(weights, value=float("nan") if overwrite else 0.0)
        for w in weights:
            w.overwrite_main_grad = overwrite
    seen: list[torch.Tensor] = []
    weights[0].register_post_accumulate_grad_hook(
        lambda p: seen.append((p.main_grad if main_grad else p.grad).clone())
    )
    x1, x2 = _randn(sum(SPLITS), K, seed=61), _randn(sum(SPLITS), K, seed=62)
    dy1, dy2 = _randn(sum(SPLITS), N, seed=63), _randn(sum(SPLITS), N, seed=64)
    use = layer
    if regions == "reentrant":  # a region's input must require grad for it to backward
        x1.requires_grad_(), x2.requires_grad_()

        def use(x: torch.Tensor, splits: list[int]) -> torch.Tensor:
            return checkpoint(layer, x, splits, use_reentrant=True)

    ((use(x1, SPLITS) * dy1).sum() + (use(x2, SPLITS) * dy2).sum()).backward()
    if delay:
        assert len(layer._wgrad_queue) == 1  # queued as one job, not merged when run
        layer.backward_dw()
        with pytest.raises(RuntimeError, match="no backward has queued a weight gradient"):
            layer.backward_dw()  # one job for the one backward
    first = _weight_grads_fp64(x1, weights, SPLITS, dy1)
    second = _weight_grads_fp64(x2, weights, SPLITS, dy2)
    for w, a, b in zip(weights, first, second, strict=True):
        _close(w.main_grad if main_grad else w.grad, a + b)
    # once, on the whole gradient; where autograd accumulates into .grad (or the dummy) itself,
    # it runs the hook once per nested backward of a reentrant checkpoint, as for any parameter
    assert len(seen) == (2 if regions == "reentrant" and not delay else 1)
    _close(seen[-1], first[0] + second[0])


def test_a_layer_used_twice_still_overwrites_once_when_thousands_of_layers_run_between() -> None:
    # Catches: the record of which backward overwrote a layer's main_grad kept in a table that
    # was cleared when it held 4096 layers: cleared between a layer's two GEMMs of one
    # backward, it let the second one overwrite the first's gradient again.
    torch.manual_seed(69)
    layer = GroupedLinear(E, K, N, bias=False, accumulate_into_main_grad=True)
    others = [
        GroupedLinear(1, 2, 2, bias=False, accumulate_into_main_grad=True) for _ in range(4200)
    ]
    weights = list(layer.parameters())
    for w in [*weights, *(w for other in others for w in other.parameters())]:
        _attach_main_grad([w], value=float("nan"))
        w.overwrite_main_grad = True
    x1, x2 = _randn(sum(SPLITS), K, seed=70), _randn(sum(SPLITS), K, seed=71)
    dy1, dy2 = _randn(sum(SPLITS), N, seed=72), _randn(sum(SPLITS), N, seed=73)
    between = torch.ones(1, 2, requires_grad=True)
    loss = (layer(x1, SPLITS) * dy1).sum()  # its backward runs last
    loss = loss + sum(other(between, [1]).sum() for other in others)
    loss = loss + (layer(x2, SPLITS) * dy2).sum()  # its backward runs first
    loss.backward()
    first = _weight_grads_fp64(x1, weights, SPLITS, dy1)
    second = _weight_grads_fp64(x2, weights, SPLITS, dy2)
    for w, a, b in zip(weights, first, second, strict=True):
        _close(w.main_grad, a + b)


@pytest.mark.parametrize("how", ["functional", "reordered", "two layers", "two layers delayed"])
def test_a_weight_shared_by_two_groups_gets_both_gradients_when_overwriting(how: str) -> None:
    # Catches: "the first GEMM of a backward overwrites main_grad, the others add" kept per
    # weight group instead of per parameter: a weight in two groups (two layers sharing it, or
    # one weight list given twice in another order) was overwritten by each group's GEMM.
    torch.manual_seed(74)
    w0, w1 = (torch.nn.Parameter(_randn(N, K, seed=75 + i)) for i in range(2))
    x1, x2 = _randn(3, K, seed=77), _randn(5, K, seed=78)
    dy1, dy2 = _randn(3, N, seed=79), _randn(5, N, seed=80)
    if how.startswith("two layers"):
        delay = how.endswith("delayed")
        a = GroupedLinear(
            1, K, N, bias=False, accumulate_into_main_grad=True, delay_wgrad_compute=delay
        )
        b = GroupedLinear(
            2, K, N, bias=False, accumulate_into_main_grad=True, delay_wgrad_compute=delay
        )
        a.weight0, b.weight0, b.weight1 = w0, w0, w1
        first, second = (lambda x: a(x, [3])), (lambda x: b(x, [2, 3]))
        wanted = [dy1.T @ x1 + dy2[:2].T @ x2[:2], dy2[2:].T @ x2[2:]]
    else:
        pair = [w0, w1] if how == "functional" else [w1, w0]
        first = lambda x: grouped_linear(x, [w0], [3], accumulate_into_main_grad=True)  # noqa: E731
        second = lambda x: grouped_linear(x, pair, [2, 3], accumulate_into_main_grad=True)  # noqa: E731
        mine = {id(w0): dy1.T @ x1, id(w1): torch.zeros(N, K)}
        for w, (d, x) in zip(pair, ((dy2[:2], x2[:2]), (dy2[2:], x2[2:])), strict=True):
            mine[id(w)] = mine[id(w)] + d.T @ x
        wanted = [mine[id(w0)], mine[id(w1)]]
    _attach_main_grad([w0, w1], value=float("nan"))
    for w in (w0, w1):
        w.overwrite_main_grad = True
    ((first(x1) * dy1).sum() + (second(x2) * dy2).sum()).backward()
    if how == "two layers delayed":
        a.backward_dw()
        b.backward_dw()
    for w, want in zip((w0, w1), wanted, strict=True):
        _close(w.main_grad, want)


@pytest.mark.parametrize("route", ["grad", "main_grad"])
def test_a_delayed_weight_shared_by_two_layers_runs_its_hooks_once_on_the_whole_gradient(
    route: str,
) -> None:
    # Catches: the hooks of a deferred parameter run after the last GEMM of its layer's job:
    # a weight shared by two delayed layers ran them after each layer's backward_dw(), the
    # first time on one layer's part of the gradient (a DDP hook would reduce that part).
    main_grad = route == "main_grad"
    torch.manual_seed(81)
    a = GroupedLinear(
        1, K, N, bias=False, accumulate_into_main_grad=main_grad, delay_wgrad_compute=True
    )
    b = GroupedLinear(
        2, K, N, bias=False, accumulate_into_main_grad=main_grad, delay_wgrad_compute=True
    )
    b.weight0 = a.weight0
    shared = a.weight0
    if main_grad:
        _attach_main_grad([shared, b.weight1])
    seen: list[torch.Tensor] = []
    shared.register_post_accumulate_grad_hook(
        lambda p: seen.append((p.main_grad if main_grad else p.grad).clone())
    )
    x1, x2 = _randn(3, K, seed=82), _randn(5, K, seed=83)
    dy1, dy2 = _randn(3, N, seed=84), _randn(5, N, seed=85)
    ((a(x1, [3]) * dy1).sum() + (b(x2, [2, 3]) * dy2).sum()).backward()
    a.backward_dw()
    assert seen == [], "the hooks ran before the other layer's GEMM into the weight"
    b.backward_dw()
    assert len(seen) == 1
    _close(seen[0], dy1.T @ x1 + dy2[:2].T @ x2[:2])


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_a_distributed_weight_overwriting_main_grad_refuses_a_second_use_in_one_backward(
    delay: bool,
) -> None:
    # Catches: a distributed layer used twice in one backward with overwrite_main_grad: its
    # implementer's finalize delivers each use's gradient by overwriting main_grad, so it kept
    # the last use's gradient only, silently (torch_distributed's shards did).
    layer = GroupedLinear(
        E, K, N, bias=False, accumulate_into_main_grad=True, delay_wgrad_compute=delay
    )
    group = make_fake_group(
        [getattr(layer, f"weight{e}") for e in range(E)], main_grad_dtype=torch.float32
    )
    for e, member in enumerate(group):
        setattr(layer, f"weight{e}", member)
        member.main_grad = torch.zeros(N, K)
        member.overwrite_main_grad = True
    x = _randn(sum(SPLITS), K, seed=86)
    once = layer(x, SPLITS).square().sum()
    once.backward()
    if delay:
        layer.backward_dw()  # one use per backward: delivered, no error
    assert all(member.main_grad.any() for member in group)
    twice = layer(x, SPLITS).square().sum() + layer(x, SPLITS).sum()
    run = (lambda: (twice.backward(), layer.backward_dw())) if delay else twice.backward
    with pytest.raises(
        RuntimeError, match=r"weight\d is a distributed weight with overwrite_main_grad"
    ):
        run()


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_an_mlp_used_in_two_reentrant_regions_gets_one_backwards_gradients(delay: bool) -> None:
    # Catches: the fused MLP's backward counting each reentrant checkpoint region's nested
    # graph task as a backward of its own (a second job; the second overwrite of main_grad).
    def run(regions: bool) -> list[torch.Tensor]:
        layer, weights = _writing_main_grads("mlp", delay=delay)
        for w in weights:
            w.main_grad.fill_(float("nan"))
            w.overwrite_main_grad = True
        xs = [_randn(sum(SPLITS), K, seed=s).requires_grad_() for s in (67, 68)]

        def use(x: torch.Tensor) -> torch.Tensor:
            return checkpoint(layer, x, SPLITS, use_reentrant=True) if regions else layer(x, SPLITS)

        sum(use(x).square().sum() for x in xs).backward()  # type: ignore[union-attr]
        if delay:
            layer.backward_dw()  # type: ignore[operator]
            with pytest.raises(RuntimeError, match="no backward has queued a weight gradient"):
                layer.backward_dw()  # type: ignore[operator]
        return [w.main_grad for w in weights]

    for got, want in zip(run(True), run(False), strict=True):
        _close(got, want)


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_a_layer_in_nested_reentrant_regions_gets_one_backwards_gradient(delay: bool) -> None:
    # Catches: the inner region's GEMM (a graph task nested in the outer region's, itself
    # nested in the backward) recorded before the outer region's own use tells which backward
    # the outer region's task belongs to, and never compared again: a second backward_dw()
    # job, or the outer use overwriting the inner use's main_grad.
    _, got = _used_around_a_nested_region(delay, True, nested=True, linker="same", after=False)
    _, want = _used_around_a_nested_region(delay, True, nested=False, linker="same", after=False)
    for g, w in zip(got, want, strict=True):
        _close(g, w)


def _used_around_a_nested_region(
    delay: bool, overwrite: bool, nested: bool, linker: str, after: bool = True
) -> tuple[GroupedLinear, list[torch.Tensor]]:
    """A layer used in an outer reentrant region before a region nested in it, in that nested
    region, and (``after``) after both; the outer region's own groupgrad layer (``linker``)
    is that same layer or another one. Returns the layer and its ``main_grad``s after the
    backward (and ``backward_dw()``, which must leave no job queued)."""
    torch.manual_seed(72)
    layer = GroupedLinear(E, K, K, bias=False, accumulate_into_main_grad=True,
                          delay_wgrad_compute=delay)  # fmt: skip
    other = GroupedLinear(E, K, K, bias=False)
    weights = list(layer.parameters())
    _attach_main_grad(weights, value=float("nan") if overwrite else 0.0)
    for w in weights:
        w.overwrite_main_grad = overwrite
    first = layer if linker == "same" else other

    def inner(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(layer(h, SPLITS))

    def outer(h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(first(h, SPLITS))
        return checkpoint(inner, h, use_reentrant=True) if nested else inner(h)

    x = _randn(sum(SPLITS), K, seed=73).requires_grad_()
    h = checkpoint(outer, x, use_reentrant=True) if nested else outer(x)
    (layer(h, SPLITS) if after else h).square().sum().backward()
    if delay:
        layer.backward_dw()
        assert len(layer._wgrad_queue) == 0
    return layer, [w.main_grad for w in weights]


@pytest.mark.parametrize("linker", ["same", "other"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["accumulate", "overwrite"])
def test_a_layer_used_around_a_nested_region_gets_one_backward_dw_job(
    overwrite: bool, linker: str
) -> None:
    # Catches: the nested region's GEMM queued as a backward of its own (its enclosing region's
    # layer runs its backward after it, so the nesting was unknown then): a second job, which
    # backward_dw() left queued to land in the next step; its use missing from this one.
    _, got = _used_around_a_nested_region(True, overwrite, nested=True, linker=linker)
    _, want = _used_around_a_nested_region(True, overwrite, nested=False, linker=linker)
    for g, w in zip(got, want, strict=True):
        _close(g, w)


@pytest.mark.parametrize("linker", ["same", "other"])
def test_a_layer_used_around_a_nested_region_overwriting_now_is_an_error(linker: str) -> None:
    # Catches: the nested region's GEMM overwriting main_grad (its backward not yet known to be
    # the outer one's), losing the use after both regions without a word.
    with pytest.raises(RuntimeError, match=r"^main_grad of weight\d.* overwritten twice in one"):
        _used_around_a_nested_region(False, True, nested=True, linker=linker)
    _, got = _used_around_a_nested_region(False, False, nested=True, linker=linker)
    _, want = _used_around_a_nested_region(False, False, nested=False, linker=linker)
    for g, w in zip(got, want, strict=True):  # accumulating: exact
        _close(g, w)


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_freezing_a_weight_between_backward_and_backward_dw_is_an_error(main_grad: bool) -> None:
    # Catches: backward_dw() reading requires_grad anew: a weight frozen after the backward
    # that deferred its gradient (its flag already set, its hooks held) got nothing, silently.
    layer, weights = _writing_main_grads("linear", delay=True, main_grad=main_grad)
    layer(_randn(sum(SPLITS), K, seed=65), SPLITS).square().sum().backward()
    weights[1].requires_grad_(False)
    with pytest.raises(
        RuntimeError,
        match=r"backward_dw\(\): weight1 has requires_grad=False now "
        r"but had True at the backward",
    ):
        layer.backward_dw()  # type: ignore[operator]
    for w in weights:  # nothing written (with main_grad, .grad holds the zero dummy)
        assert not w.main_grad.any() if main_grad else w.grad is None


def test_a_job_queued_before_delay_was_switched_off_still_runs() -> None:
    # Catches: backward_dw() a no-op once delay_wgrad_compute is False, with a job queued: its
    # gradient never landed and its held hooks stayed held for every later backward.
    layer, weights = _writing_main_grads("linear", delay=True, main_grad=False)
    runs: list[int] = []
    weights[0].register_post_accumulate_grad_hook(lambda p: runs.append(1))
    x = _randn(sum(SPLITS), K, seed=66)
    layer(x, SPLITS).square().sum().backward()
    layer.delay_wgrad_compute = False
    layer.backward_dw()  # type: ignore[operator]
    assert weights[0].grad is not None
    assert runs == [1]
    layer(x, SPLITS).square().sum().backward()  # not delayed: autograd runs the hook itself
    assert runs == [1, 1]
    layer.backward_dw()  # type: ignore[operator]  # nothing queued, not delayed: a no-op


class _Double(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2.0 * w


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_a_parametrized_weight_learns_or_is_refused_with_delayed_wgrads(
    kind: str, delay: bool
) -> None:
    # Catches: backward_dw() adding a deferred gradient into .grad of the weight a
    # parametrization computed at forward (a throw-away tensor): the parameter it came from
    # never got one. Without delay autograd carries it back.
    module: nn.Module = (
        GroupedLinear(E, K, N, bias=False, delay_wgrad_compute=delay)
        if kind == "linear"
        else GroupedMLP(E, K, 6, delay_wgrad_compute=delay)
    )
    owner = module if kind == "linear" else module.fc2
    before = owner.weight0.detach().double()
    parametrize.register_parametrization(owner, "weight0", _Double())
    x = _randn(sum(SPLITS), K, seed=95)
    if delay:
        with pytest.raises(
            RuntimeError, match=r"computed from another tensor .*delay_wgrad_compute"
        ):
            module(x, SPLITS)
        return
    module(x, SPLITS).sum().backward()
    original = owner.parametrizations.weight0.original
    twin = GroupedLinear(E, K, N, bias=False) if kind == "linear" else GroupedMLP(E, K, 6)
    twin.load_state_dict({k.replace("parametrizations.weight0.original", "weight0"): v
                          for k, v in module.state_dict().items()})  # fmt: skip
    twin_owner = twin if kind == "linear" else twin.fc2
    with torch.no_grad():
        twin_owner.weight0.copy_(2 * before)
    twin(x, SPLITS).sum().backward()
    assert original.grad is not None
    torch.testing.assert_close(original.grad, 2 * twin_owner.weight0.grad)


def test_a_parametrized_weight_with_main_grad_names_the_cause() -> None:
    # Catches: "parameter 'weight0' has no main_grad" alone, where weight0 is a tensor a
    # parametrization computed (the user's main_grad is on the parameter it came from).
    layer = GroupedLinear(E, K, N, bias=False, accumulate_into_main_grad=True)
    parametrize.register_parametrization(layer, "weight0", _Double())
    original = layer.parametrizations.weight0.original
    original.main_grad = torch.zeros(original.shape)  # type: ignore[attr-defined]
    layer.weight1.main_grad = torch.zeros(layer.weight1.shape)  # type: ignore[attr-defined]
    out = layer(_randn(sum(SPLITS), K, seed=96), SPLITS).sum()
    with pytest.raises(RuntimeError, match=r"'weight0' has no main_grad.*computed from another"):
        out.backward()
    assert not original.main_grad.any()


def _flagged_main_grad_layer(**options: object) -> GroupedLinear:
    layer = GroupedLinear(E, K, K, bias=False, accumulate_into_main_grad=True, **options)
    for param in layer.parameters():
        param.main_grad = torch.zeros(param.shape)  # type: ignore[attr-defined]
        param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    return layer


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
@pytest.mark.parametrize("case", ["route_switched_off", "penalty"])
def test_a_dummy_kept_as_grad_takes_no_other_parameters_gradient(case: str, delay: bool) -> None:
    # Catches: a later real gradient added in place into a .grad that is an alias of the
    # shared zero dummy (every weight of that shape had one): it landed in every expert's
    # .grad. "route_switched_off": accumulate_into_main_grad turned off after a step, .grad
    # kept by zero_grad(set_to_none=False); "penalty": a term on weight0 in a later
    # micro-batch, beside a second layer of the same shape.
    layer, other = _flagged_main_grad_layer(delay_wgrad_compute=delay), _flagged_main_grad_layer()
    weights = [w.detach().double().requires_grad_() for w in layer.parameters()]
    x, dy = _randn(sum(SPLITS), K, seed=97), _randn(sum(SPLITS), K, seed=98)
    layer(x, SPLITS).backward(dy)
    other(x, SPLITS).backward(dy)
    if delay:
        layer.backward_dw()
    assert layer.weight1.grad is not None, "the premise: autograd kept the dummy as .grad"
    assert layer.weight1.grad.untyped_storage().data_ptr() == (
        other.weight2.grad.untyped_storage().data_ptr()
    ), "the premise: one storage for every dummy of that shape"
    if case == "route_switched_off":  # with a penalty on weight0, beside the layer's gradient
        torch.optim.SGD(layer.parameters(), lr=0.0).zero_grad(set_to_none=False)
        layer.accumulate_into_main_grad = False
        (layer(x, SPLITS) * dy).sum().add(0.5 * layer.weight0.square().sum()).backward()
        if delay:
            layer.backward_dw()
        loss = (_linear_fp64(x, weights, SPLITS) * dy.double()).sum()
        want = torch.autograd.grad(loss + 0.5 * weights[0].square().sum(), weights)
        for e in range(E):
            _close(getattr(layer, f"weight{e}").grad, want[e])
    else:
        (layer(x, SPLITS) * dy).sum().add(0.5 * layer.weight0.square().sum()).backward()
        if delay:
            layer.backward_dw()
        torch.testing.assert_close(layer.weight0.grad, layer.weight0.detach())
        for grad in (layer.weight1.grad, layer.weight2.grad, other.weight2.grad):
            assert grad is not None
            assert not grad.any()


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_parameters_swap_after_a_step(delay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Catches: the per-parameter records (which backward overwrote main_grad, which deferred
    # GEMMs are queued) kept through weak references: torch.utils.swap_tensors refuses a
    # tensor with one, so module.to() and load_state_dict with torch's swap on failed after
    # a step ("Couldn't swap GroupedLinear.weight0").
    layer = _flagged_main_grad_layer(delay_wgrad_compute=delay)
    for param in layer.parameters():
        param.overwrite_main_grad = True  # type: ignore[attr-defined]
    x, dy = _randn(sum(SPLITS), K, seed=99), _randn(sum(SPLITS), K, seed=100)
    layer(x, SPLITS).backward(dy)
    if delay:
        layer.backward_dw()
    assert layer.weight0.main_grad.any()  # the premise: a GEMM wrote (and was recorded)
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
    weight0 = layer.weight0
    layer.to(torch.float64)
    assert layer.weight0 is weight0  # swapped in place, as torch's swap does
    assert layer.weight0.dtype == torch.float64
    state = {k: v.float() for k, v in layer.state_dict().items()}
    layer.load_state_dict(state)
    assert layer.weight0.dtype == torch.float64
