"""``torch.compile`` keeps every fp32 wgrad route (DESIGN, "Compile").

One model holds a layer for every route — ``grad_dtype = float32`` on bf16
parameters, autocast over fp32 parameters, ``main_grad`` accumulate and
overwrite, delayed wgrad with and without ``main_grad`` — through
``GroupedLinear``, ``GroupedMLP``, ``grouped_linear`` and ``grouped_mlp``, so
one compile (the default backend, inductor, ``fullgraph=True``) covers them
all; inductor costs tens of seconds a graph on a 2-core CPU. It trains two
micro-batches beside an eager twin: the compiled gradients must match eager's
values and be no more bf16-exact than eager's (``groupgrad_testsupport.compiled``).
The GPU suite runs the same model in both weight layouts on CUDA.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden size, ``F`` ffn size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

from groupgrad.modules import (
    GroupedLinear,
    GroupedMLP,
    grouped_linear,
    grouped_mlp,
    routed_grouped_mlp,
)
from groupgrad.protocol.testing import make_fake_group
from groupgrad_testsupport.compiled import assert_keeps_fp32, compiled_graphs
from groupgrad_testsupport.numerics import assert_within_scale

E, H, F, T = 4, 32, 16, 24
BF16 = torch.bfloat16

# module attribute -> route, for the bf16 parameters
GRAD_DTYPE = ("lin_gd", "mlp_gd", "fn", "lin_delay")
MAIN_GRAD = {"lin_mg": False, "mlp_ow": True, "mlp_delay_mg": False}  # name -> overwrite


class Routes(nn.Module):
    """Every compiled fp32-wgrad route of DESIGN in one chain of layers.

    ``packed`` flips every layer's layout (per-expert <-> one ``(E, ·, ·)`` weight).
    """

    def __init__(self, device: str, packed: bool) -> None:
        super().__init__()
        bf16 = {"dtype": BF16, "device": device}

        def lin(flip: bool, **kw: object) -> GroupedLinear:
            return GroupedLinear(E, H, H, single_grouped_weight=packed != flip, **bf16, **kw)

        def mlp(flip: bool, **kw: object) -> GroupedMLP:
            return GroupedMLP(E, H, F, single_grouped_weight=packed != flip, **bf16, **kw)

        self.lin_gd = lin(False, bias=True)
        self.mlp_gd = mlp(True, bias=True)
        self.fn = nn.ParameterDict(  # the functional ops on parameters a framework owns
            {
                "w": nn.Parameter(torch.randn(E, H, H, **bf16) / H**0.5),
                "b": nn.Parameter(torch.randn(E, H, **bf16)),
                "fc1": nn.Parameter(torch.randn(E, 2 * F, H, **bf16) / H**0.5),
                "fc2": nn.Parameter(torch.randn(E, H, F, **bf16) / F**0.5),
            }
        )
        self.lin_mg = lin(True, bias=False, accumulate_into_main_grad=True)
        self.mlp_ow = mlp(False, accumulate_into_main_grad=True)
        self.lin_delay = lin(False, bias=False, delay_wgrad_compute=True)
        self.mlp_delay_mg = mlp(True, accumulate_into_main_grad=True, delay_wgrad_compute=True)
        fp32 = {"dtype": torch.float32, "device": device}
        self.lin_ac = GroupedLinear(E, H, H, single_grouped_weight=packed, **fp32)
        self.mlp_ac = GroupedMLP(E, H, F, single_grouped_weight=not packed, bias=True, **fp32)
        self.device_type = torch.device(device).type

    def forward(self, x: Tensor, splits: Tensor, probs: Tensor) -> Tensor:
        h = self.lin_gd(x, splits)
        h = self.mlp_gd(h, splits, probs)
        h = grouped_linear(h, self.fn["w"], splits, self.fn["b"])
        h = grouped_mlp(h, self.fn["fc1"], self.fn["fc2"], splits, probs)
        h = self.lin_mg(h, splits)
        h = self.mlp_ow(h, splits, probs)
        h = self.lin_delay(h, splits)
        h = self.mlp_delay_mg(h, splits, probs)
        with torch.autocast(self.device_type, dtype=BF16):
            return self.mlp_ac(self.lin_ac(h, splits), splits, probs)

    def backward_dw(self) -> None:
        self.lin_delay.backward_dw()
        self.mlp_delay_mg.backward_dw()


def build(device: str, packed: bool) -> Routes:
    """A fresh model (seeded, so two calls give twins) with each route's attributes set."""
    torch.manual_seed(0)
    model = Routes(device, packed)
    for name in GRAD_DTYPE:
        for p in getattr(model, name).parameters():
            p.grad_dtype = torch.float32
    for name, overwrite in MAIN_GRAD.items():
        for p in getattr(model, name).parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
            p.grad_added_to_main_grad = False
            p.overwrite_main_grad = overwrite
    return model


def fp32_grads(model: Routes) -> Iterator[tuple[str, Tensor]]:
    """Every gradient the routes must deliver in fp32: ``.grad`` or ``main_grad``."""
    for name, p in model.named_parameters():
        if name.split(".")[0] in MAIN_GRAD:
            yield f"{name}.main_grad", p.main_grad
        else:
            assert p.grad is not None, f"{name} received no gradient"
            yield f"{name}.grad", p.grad


def train(model: Routes, forward: Callable[..., Tensor], device: str) -> None:
    """Two micro-batches (so ``.grad`` and ``main_grad`` accumulate, or are overwritten).

    The tokens-per-expert buffer is refilled after each forward (DESIGN: a
    snapshot), which inductor's partitioner once undid: it recomputed the
    snapshot's ``clone`` from the buffer in the backward.
    """
    torch.manual_seed(1)
    for _ in range(2):
        splits = torch.bincount(torch.randint(0, E, (T,)), minlength=E).to(device)
        x = torch.randn(T, H, dtype=BF16, device=device, requires_grad=True)
        probs = torch.rand(T, device=device)
        y = forward(x, splits, probs)
        splits.copy_(torch.tensor([T, 0, 0, 0]))  # the next batch's routing
        y.float().square().sum().backward()
        model.backward_dw()


def run_routes(device: str, packed: bool) -> None:
    """Compiled (inductor, ``fullgraph=True``) against eager: same values, fp32 kept."""
    eager, compiled = build(device, packed), build(device, packed)
    train(eager, eager, device)
    torch._dynamo.reset()
    train(compiled, torch.compile(compiled, fullgraph=True), device)
    want = dict(fp32_grads(eager))
    for name, got in fp32_grads(compiled):
        assert_within_scale(got, want[name], rel=3e-2, atol=1e-6, what=name)
        assert_keeps_fp32(got, want[name], name)
    for name in MAIN_GRAD:
        for pname, p in getattr(compiled, name).named_parameters():
            assert p.grad_added_to_main_grad, f"{name}.{pname}: grad_added_to_main_grad not set"
            assert p.grad is not None, f"{name}.{pname}: no zero dummy"
            assert not p.grad.any(), f"{name}.{pname}: the dummy is not zero"


def test_compiled_model_keeps_every_fp32_wgrad_route() -> None:
    run_routes("cpu", packed=False)


@pytest.mark.parametrize("packed", [False, True], ids=["per-expert", "packed"])
def test_compiled_grouped_mlp_keeps_the_grad_dtype_route(packed: bool) -> None:
    """The report's case alone: ``GroupedMLP`` with ``grad_dtype = float32`` on bf16 weights."""
    models = []
    for compiled in (False, True):
        torch.manual_seed(4)
        model = GroupedMLP(E, H, F, dtype=BF16, single_grouped_weight=packed, bias=True)
        for p in model.parameters():
            p.grad_dtype = torch.float32
        step = torch.compile(model, fullgraph=True) if compiled else model
        x, probs = torch.randn(T, H, dtype=BF16), torch.rand(T)
        step(x, torch.tensor([9, 0, 5, 10]), probs).float().square().sum().backward()
        models.append(dict(model.named_parameters()))
    eager, compiled_params = models
    for name, p in compiled_params.items():
        assert_within_scale(p.grad, eager[name].grad, rel=1e-2, atol=1e-6, what=name)
        assert_keeps_fp32(p.grad, eager[name].grad, name)


def test_a_compiled_loop_with_changing_splits_compiles_once() -> None:
    """Device-tensor ``splits`` that change every step (``T`` fixed, as top-k routing keeps it)."""
    torch.manual_seed(2)
    model = GroupedMLP(E, H, F, dtype=BF16, single_grouped_weight=True)
    for p in model.parameters():
        p.grad_dtype = torch.float32
    step = torch.compile(model, fullgraph=True)
    torch._dynamo.reset()
    before = compiled_graphs()
    seen = set()
    for _ in range(20):
        splits = torch.bincount(torch.randint(0, E, (T,)), minlength=E)
        seen.add(tuple(splits.tolist()))
        step(torch.randn(T, H, dtype=BF16), splits).float().sum().backward()
        model.zero_grad()
    assert len(seen) > 10  # the routing really changed
    assert compiled_graphs() - before <= 2


def _linear(**kw: object) -> GroupedLinear:
    torch.manual_seed(3)
    return GroupedLinear(E, H, H, dtype=BF16, bias=False, single_grouped_weight=True, **kw)


def test_compiled_backward_delivers_once_and_runs_each_hook_once() -> None:
    layer = _linear()
    layer.weight.grad_dtype = torch.float32
    seen: list[tuple[torch.dtype, float]] = []
    layer.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append((p.grad.dtype, float(p.grad.double().abs().sum())))
    )
    step = torch.compile(layer, fullgraph=True)
    splits = torch.tensor([5, 0, 11, 8])
    x = torch.randn(T, H, dtype=BF16)
    for _ in range(2):
        step(x, splits).float().sum().backward()
    assert [dtype for dtype, _ in seen] == [torch.float32, torch.float32]
    assert seen[1][1] == pytest.approx(2 * seen[0][1], rel=1e-6)  # added once per backward


def test_compiled_backward_leaves_grad_alone_where_autograd_would() -> None:
    layer = _linear()
    layer.weight.grad_dtype = torch.float32
    x = torch.randn(T, H, dtype=BF16, requires_grad=True)
    out = torch.compile(layer, fullgraph=True)(x, torch.tensor([5, 0, 11, 8]))
    out.float().sum().backward(inputs=[x])
    assert x.grad is not None
    assert layer.weight.grad is None


def test_compiled_backward_refuses_autograd_grad_of_the_weights() -> None:
    layer = _linear()
    layer.weight.grad_dtype = torch.float32
    out = torch.compile(layer, fullgraph=True)(torch.randn(T, H, dtype=BF16), [6, 6, 6, 6])
    with pytest.raises(
        RuntimeError, match=r"torch\.autograd\.grad asked for the gradient of parameter 'weight'"
    ):
        torch.autograd.grad(out.float().sum(), [layer.weight])
    assert layer.weight.grad is None


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_compiled_autograd_grad_of_a_bias_is_refused_before_main_grad_is_written(
    delay: bool,
) -> None:
    # Catches: the op writing the weights' main_grad (or queueing their job) before it finds
    # that torch.autograd.grad asks for a parameter it cannot return.
    torch.manual_seed(3)
    layer = GroupedLinear(
        E, H, H, dtype=BF16, bias=True, single_grouped_weight=True,
        accumulate_into_main_grad=True, delay_wgrad_compute=delay,
    )  # fmt: skip
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    layer.weight.grad_added_to_main_grad = False
    step = torch.compile(layer, fullgraph=True)
    out = step(torch.randn(T, H, dtype=BF16), torch.tensor([5, 0, 11, 8]))
    with pytest.raises(RuntimeError, match=r"asked for the gradient of parameter 'bias 0 of"):
        torch.autograd.grad(out.float().sum(), [layer.weight, layer.bias])
    assert not layer.weight.main_grad.any()
    assert layer.weight.grad_added_to_main_grad is False
    if delay:  # nothing was queued
        with pytest.raises(RuntimeError, match="no backward has queued a weight gradient"):
            layer.backward_dw()


def test_compiled_autograd_grad_over_a_main_grad_weight_does_as_eager() -> None:
    # Catches: the compiled op refusing torch.autograd.grad over a weight whose gradient never
    # goes back to autograd (main_grad, no zero dummy): eager writes main_grad and returns None.
    got = []
    for compiled in (False, True):
        layer = _linear(accumulate_into_main_grad=True)
        layer.weight.main_grad = torch.zeros(layer.weight.shape)
        x = torch.randn(T, H, dtype=BF16, generator=torch.Generator().manual_seed(4))
        x.requires_grad_()
        step = torch.compile(layer, fullgraph=True) if compiled else layer
        out = step(x, torch.tensor([5, 0, 11, 8])).float().sum()
        dx, dw = torch.autograd.grad(out, [x, layer.weight], allow_unused=True)
        assert dw is None
        got.append((dx, layer.weight.main_grad))
    assert torch.equal(got[0][0], got[1][0])
    assert torch.equal(got[0][1], got[1][1])
    assert got[1][1].any()


def test_a_contract_flag_changed_after_tracing_is_refused_before_anything_is_written() -> None:
    # Catches: the op writing main_grad (and setting the flag) before it finds the traced zero
    # dummies stale; the step retried as the message says would then add its wgrad twice.
    layer = _linear(accumulate_into_main_grad=True)
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    step = torch.compile(layer, fullgraph=True)
    x, splits = torch.randn(T, H, dtype=BF16), torch.tensor([5, 0, 11, 8])
    step(x, splits).float().sum().backward()
    once = layer.weight.main_grad.clone()
    assert once.any()
    layer.weight.grad_added_to_main_grad = False  # now the contract hands autograd a dummy
    with pytest.raises(RuntimeError, match=r"grad_added_to_main_grad or requires_grad of weight"):
        step(x, splits).float().sum().backward()
    assert torch.equal(layer.weight.main_grad, once)
    assert layer.weight.grad_added_to_main_grad is False
    torch._dynamo.reset()  # as the message says, then the same step again: added once
    torch.compile(layer, fullgraph=True)(x, splits).float().sum().backward()
    assert torch.equal(layer.weight.main_grad, once + once)
    assert layer.weight.grad_added_to_main_grad is True


def test_distributed_weights_are_refused_at_trace_time_naming_the_leader() -> None:
    group = make_fake_group([torch.randn(H, H) for _ in range(E)])
    step = torch.compile(lambda x: grouped_linear(x, group, [6, 6, 6, 6]), fullgraph=True)
    with pytest.raises(Exception, match="parameter 'weight0' is a DistributedWeight"):
        step(torch.randn(T, H))
    assert all(w.grad is None for w in group)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["per-expert", "packed"])
def test_compiled_model_keeps_every_fp32_wgrad_route_on_cuda(packed: bool) -> None:
    """The CPU test's model on the GPU (CUTLASS and Triton kernels), in both layouts."""
    run_routes("cuda", packed)


@pytest.mark.gpu
def test_compiled_loop_with_device_splits_compiles_once_on_cuda() -> None:
    torch.manual_seed(5)
    model = GroupedMLP(E, H, F, dtype=BF16, device="cuda", single_grouped_weight=True)
    for p in model.parameters():
        p.grad_dtype = torch.float32
    step = torch.compile(model, fullgraph=True)
    torch._dynamo.reset()
    before = compiled_graphs()
    for _ in range(20):
        splits = torch.bincount(torch.randint(0, E, (T,), device="cuda"), minlength=E)
        step(torch.randn(T, H, dtype=BF16, device="cuda"), splits).float().sum().backward()
        model.zero_grad()
    assert compiled_graphs() - before <= 2


def _reduce_overhead_steps(device: str) -> tuple[GroupedMLP, list[dict[str, Tensor]]]:
    """Three steps of a ``mode="reduce-overhead"`` compiled MLP and its gradients after each."""
    torch.manual_seed(6)
    model = GroupedMLP(E, H, F, dtype=BF16, device=device, single_grouped_weight=True)
    for p in model.parameters():
        p.grad_dtype = torch.float32
    step = torch.compile(model, mode="reduce-overhead")
    grads = []
    for seed in range(3):
        torch.manual_seed(7 + seed)
        splits = torch.bincount(torch.randint(0, E, (T,), device=device), minlength=E)
        step(torch.randn(T, H, dtype=BF16, device=device), splits).float().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    return model, grads


def test_reduce_overhead_mode_runs_on_the_cpu() -> None:
    """No CUDA graphs on the CPU: the mode compiles as the default one, gradients fp32."""
    _, grads = _reduce_overhead_steps("cpu")
    assert all(g.dtype == torch.float32 and g.any() for step in grads for g in step.values())


@pytest.mark.gpu
def test_reduce_overhead_mode_is_refused_when_traced_on_cuda() -> None:
    """``mode="reduce-overhead"`` (CUDA graph trees) on CUDA: refused at trace time, naming the layer."""
    with pytest.raises(
        Exception, match=r"mode='reduce-overhead'\) \(CUDA graphs\) is not supported"
    ):
        _reduce_overhead_steps("cuda")


@pytest.mark.parametrize("layer", ["linear", "mlp"])
def test_weights_computed_from_parameters_keep_their_gradient_when_compiled(layer: str) -> None:
    """A derived weight (``p * 2``) runs the layer eagerly inside a compiled function (its
    gradient reaches ``p`` as in eager code); ``fullgraph=True`` refuses it instead."""
    gen = torch.Generator().manual_seed(5)
    splits = torch.tensor([3, 0, 5])
    x = torch.randn(8, 16, generator=gen)
    if layer == "linear":
        p = nn.Parameter(torch.randn(3, 12, 16, generator=gen))

        def f(x: Tensor, p: Tensor) -> Tensor:
            return grouped_linear(x, p * 2.0, splits).square().sum()

    else:
        p = nn.Parameter(torch.randn(3, 24, 16, generator=gen))
        fc2 = nn.Parameter(torch.randn(3, 16, 12, generator=gen))

        def f(x: Tensor, p: Tensor) -> Tensor:
            return grouped_mlp(x, p * 2.0, fc2, splits).square().sum()

    f(x, p).backward()
    eager = p.grad.clone()
    p.grad = None
    torch.compile(f, backend="aot_eager")(x, p).backward()
    assert p.grad is not None, "the derived weight's gradient was lost under torch.compile"
    torch.testing.assert_close(p.grad, eager)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="computed from another tensor"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(x, p)


def test_compiled_backward_for_the_input_only_leaves_main_grad_alone() -> None:
    layer = _linear(accumulate_into_main_grad=True)
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    layer.weight.grad_added_to_main_grad = False
    x = torch.randn(T, H, dtype=BF16, requires_grad=True)
    step = torch.compile(layer, fullgraph=True)
    splits = torch.tensor([5, 0, 11, 8])
    step(x, splits).float().sum().backward(inputs=[x])
    (dx,) = torch.autograd.grad(step(x, splits).float().sum(), [x])
    assert x.grad is not None
    assert torch.equal(dx, x.grad)
    assert not layer.weight.main_grad.any()  # no wgrad GEMM ran into it
    step(x, splits).float().sum().backward()
    assert layer.weight.main_grad.any()


def test_compiled_backward_for_some_weights_writing_main_grad_is_an_error() -> None:
    # The compiled op reads each expert's delivery at run time, as eager does from its context.
    torch.manual_seed(3)
    layer = GroupedLinear(E, H, H, dtype=BF16, bias=False, accumulate_into_main_grad=True)
    weights = list(layer.parameters())
    for w in weights:
        w.main_grad = torch.zeros(w.shape)
    step = torch.compile(layer, fullgraph=True)
    x, splits = torch.randn(T, H, dtype=BF16), torch.tensor([5, 0, 11, 8])
    with pytest.raises(RuntimeError, match="asks for the gradients of weight0 but not of weight1"):
        step(x, splits).float().sum().backward(inputs=[weights[0]])
    assert not any(w.main_grad.any() for w in weights)
    step(x, splits).float().sum().backward(inputs=weights)  # all of them: delivered
    assert all(w.main_grad.any() for w in weights[:1] + weights[2:])  # expert 1 has no tokens


@pytest.mark.parametrize("on", ["weight1", "bias1"])
def test_a_gradient_hook_on_a_compiled_layers_parameter_is_an_error(on: str) -> None:
    # Catches: compiled, the op puts the gradients into .grad past autograd, which then called
    # a Tensor.register_hook hook with None: a gradient mask or clip silently not applied.
    torch.manual_seed(3)
    layer = GroupedLinear(E, H, H, dtype=BF16, bias=True)
    getattr(layer, on).register_hook(lambda g: g * 0)
    x, splits = torch.randn(T, H, dtype=BF16), torch.tensor([5, 1, 10, 8])
    step = torch.compile(layer, fullgraph=True)
    name = "bias 1 of weight0" if on == "bias1" else on
    hooked = rf"^a gradient hook \(Tensor\.register_hook\) is on {name}, .*under torch\.compile"
    with pytest.raises(RuntimeError, match=hooked):
        step(x, splits).float().sum().backward()
    assert all(p.grad is None for p in layer.parameters())
    x.requires_grad_()
    step(x, splits).float().sum().backward(inputs=[x])  # no parameter's gradient: no error
    assert x.grad is not None


def test_compiled_backward_for_some_weights_going_to_grad_delivers_exactly_those() -> None:
    torch.manual_seed(3)
    layer = GroupedLinear(E, H, H, dtype=BF16, bias=False)
    weights = list(layer.parameters())
    x, splits = torch.randn(T, H, dtype=BF16), torch.tensor([5, 0, 11, 8])
    layer(x, splits).float().sum().backward()
    want = weights[2].grad
    layer.zero_grad(set_to_none=True)
    torch.compile(layer, fullgraph=True)(x, splits).float().sum().backward(inputs=[weights[2]])
    assert torch.equal(weights[2].grad, want)
    assert all(w.grad is None for w in weights[:2] + weights[3:])


class Inference(nn.Module):
    """A layer of each Function and argument count, bf16 and FP8, for an evaluation step."""

    def __init__(self) -> None:
        super().__init__()
        h, bf16 = 128, {"dtype": BF16}  # FP8 blocks are 128 wide
        self.lin = GroupedLinear(E, h, h, **bf16)  # per-expert, no bias
        self.lin_packed = GroupedLinear(E, h, h, bias=True, single_grouped_weight=True, **bf16)
        self.mlp = GroupedMLP(E, h, h, bias=True, **bf16)
        self.mlp_packed = GroupedMLP(E, h, h, single_grouped_weight=True, **bf16)
        self.lin_fp8 = GroupedLinear(E, h, h, bias=True, fp8_recipe="blockwise", **bf16)
        self.mlp_fp8 = GroupedMLP(
            E, h, h, single_grouped_weight=True, fp8_recipe="blockwise", **bf16
        )
        self.fc1 = nn.Parameter(torch.randn(E, 2 * h, h, **bf16) / h**0.5)
        self.fc2 = nn.Parameter(torch.randn(E, h, h, **bf16) / h**0.5)

    def forward(self, x: Tensor, splits: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        y = self.lin_packed(self.lin(x, splits), splits)
        y = self.mlp_packed(self.mlp(y, splits), splits)
        y = self.mlp_fp8(self.lin_fp8(y, splits), splits)
        sorted_ids, slots = torch.sort(ids.reshape(-1), stable=True)
        counts = torch.bincount(sorted_ids, minlength=E)
        return routed_grouped_mlp(y, self.fc1, self.fc2, slots, counts, weights)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_an_evaluation_step_compiles_with_fullgraph(mode: str) -> None:
    # Catches: the grouped Functions' apply traced with grad mode off, where Dynamo binds their
    # variadic parameters to the wrong arguments ("unsupported operand type(s) for @: 'int'
    # and 'FakeTensor'", "'str' object has no attribute 'split'").
    model = Inference()
    generator = torch.Generator().manual_seed(7)
    splits = torch.tensor([40, 0, 56, 32])
    x = torch.randn(128, 128, generator=generator).to(BF16)
    ids = torch.randint(0, E, (128, 2), generator=generator)
    weights = torch.rand(128, 2, generator=generator).to(BF16)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        want = model(x, splits, ids, weights)
        got = torch.compile(model, fullgraph=True)(x, splits, ids, weights)
    torch.testing.assert_close(got, want)  # bf16's tolerance: inductor may fuse differently
    assert not got.requires_grad


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_fp8_layers_compile_with_dynamic_shapes(kind: str) -> None:
    # Catches: an FP8 operand's form carrying the source's column count into the compiled
    # op's constant layout key: a symbol under dynamic shapes (dynamic=True, or an FSDP2 unit
    # recompiled for another layer size), which Dynamo cannot make a constant.
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        cls = GroupedMLP if kind == "mlp" else GroupedLinear
        layer = cls(E, 128, 128, dtype=BF16, fp8_recipe="blockwise")
        for param in layer.parameters():
            param.grad_dtype = torch.float32
        step = torch.compile(layer, fullgraph=True, dynamic=True) if compiled else layer
        for tokens in (24, 40):  # two token counts, one graph
            x = torch.randn(tokens, 128, dtype=BF16)
            splits = torch.tensor([tokens - 16, 0, 6, 10])
            step(x, splits).float().square().sum().backward()
        grads.append([p.grad for p in layer.parameters()])
    for eager, compiled in zip(*grads, strict=True):
        assert compiled.dtype == torch.float32
        torch.testing.assert_close(compiled, eager)


def _compiled_autograd_backward(loss: Tensor) -> None:
    """``loss.backward()`` under Compiled Autograd (its graph compiled by Dynamo's eager
    backend, as ``torch._dynamo.config.compiled_autograd`` would with the default)."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss.backward()


@pytest.mark.parametrize("case", ["grad", "bias", "delayed"])
def test_compiled_autograd_refuses_what_it_would_undo_before_writing(case: str) -> None:
    # Catches: under Compiled Autograd the .grad the op wrote set back to what the graph
    # captured (None: every weight and bias gradient lost without a word), and a delayed
    # layer's hooks run at backward on a gradient not computed yet, then again.
    torch._dynamo.reset()
    layer = GroupedLinear(E, H, H, dtype=BF16, bias=case == "bias",
                          accumulate_into_main_grad=case != "grad",
                          delay_wgrad_compute=case == "delayed")  # fmt: skip
    for param in layer.parameters():
        param.main_grad = torch.zeros(param.shape)  # type: ignore[attr-defined]
    loss = layer(torch.randn(T, H, dtype=BF16), [5, 0, 11, 8]).float().square().sum()
    message = "delay_wgrad_compute=True under Compiled" if case == "delayed" else "goes to .grad"
    with pytest.raises(RuntimeError, match=message):
        _compiled_autograd_backward(loss)
    for param in layer.parameters():
        assert param.grad is None
        assert not param.main_grad.any()  # type: ignore[attr-defined]


@pytest.mark.parametrize("packed", [False, True], ids=["per-expert", "packed"])
def test_compiled_autograd_writes_main_grad_as_eager(packed: bool) -> None:
    # Catches: the refusal above firing where Compiled Autograd keeps what the op writes
    # (main_grad at backward, the flag and the dummy autograd receives).
    torch._dynamo.reset()
    got = []
    for compiled in (False, True):
        torch.manual_seed(5)
        mlp = GroupedMLP(E, H, F, dtype=BF16, single_grouped_weight=packed,
                         accumulate_into_main_grad=True)  # fmt: skip
        for param in mlp.parameters():
            param.main_grad = torch.zeros(param.shape)  # type: ignore[attr-defined]
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        x = torch.randn(T, H, dtype=BF16, generator=torch.Generator().manual_seed(6))
        for _ in range(2):
            loss = mlp(x, [5, 0, 11, 8]).float().square().sum()
            _compiled_autograd_backward(loss) if compiled else loss.backward()
        got.append([p.main_grad for p in mlp.parameters()])  # type: ignore[attr-defined]
        assert all(p.grad_added_to_main_grad for p in mlp.parameters())  # type: ignore[attr-defined]
    assert any(eager.any() for eager in got[0])
    for eager, compiled_grad in zip(*got, strict=True):
        assert torch.equal(eager, compiled_grad)


def test_compiled_autograd_allows_a_backward_that_writes_no_grad() -> None:
    # Catches: the refusal firing for a layer whose parameters this backward does not
    # accumulate into (backward(inputs=[x]), a pipeline schedule's dgrad-only backward).
    torch._dynamo.reset()
    layer = GroupedLinear(E, H, H, dtype=BF16, bias=True)
    x = torch.randn(T, H, dtype=BF16, requires_grad=True)
    want = torch.autograd.grad(layer(x, [5, 0, 11, 8]).float().square().sum(), [x])[0]
    loss = layer(x, [5, 0, 11, 8]).float().square().sum()
    import torch._dynamo.compiled_autograd as compiled_autograd

    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss.backward(inputs=[x])
    assert torch.equal(x.grad, want)
    assert all(p.grad is None for p in layer.parameters())


def test_compiled_autograd_without_dynamo_refuses_a_delayed_layer() -> None:
    # Catches: the delay refused only where Dynamo traces the layer's backward: a Compiled
    # Autograd compiler of its own (here one that runs the captured graph as it is) ran the
    # hooks at backward, on a main_grad not yet written, then again in backward_dw().
    layer = GroupedLinear(E, H, H, dtype=BF16, bias=False, accumulate_into_main_grad=True,
                          delay_wgrad_compute=True)  # fmt: skip
    for param in layer.parameters():
        param.main_grad = torch.zeros(param.shape)  # type: ignore[attr-defined]
    loss = layer(torch.randn(T, H, dtype=BF16), [5, 0, 11, 8]).float().square().sum()
    import torch._dynamo.compiled_autograd as compiled_autograd

    with (
        pytest.raises(RuntimeError, match="delay_wgrad_compute=True under Compiled"),
        compiled_autograd._enable(lambda graph: graph),
    ):
        loss.backward()
    assert not any(p.main_grad.any() for p in layer.parameters())  # type: ignore[attr-defined]


def test_the_splits_snapshot_op_passes_opcheck() -> None:
    """``groupgrad::snapshot_splits`` (the traced copy of ``splits``): schema, fake, compile."""
    from groupgrad.modules._group import _snapshot_op

    torch.library.opcheck(_snapshot_op, (torch.tensor([3, 0, 5, 4]),))
