"""Parameter gradients under ``torch.compile``: the eager code, run at run time by one opaque op.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.

Why an op: AOTAutograd traces a backward into a graph whose gradient for each
parameter has the dtype of the traced parameter, whose ``grad_dtype`` it does
not carry (torch 2.11 and 2.13): an fp32 wgrad of a bf16 parameter is cast to
bf16 on its way out of the graph and back to fp32 by autograd — the silent
rounding groupgrad exists to prevent. And a traced backward replays no Python
side effects (``get_main_grad()`` once per backward, ``grad_added_to_main_grad``
set, ``overwrite_main_grad`` read when the GEMM runs, a job queued for
``backward_dw()``).

So :func:`hand_over`, which every grouped autograd Function's backward calls
for its parameters, runs :func:`~groupgrad.modules._grads.parameter_grads`
directly in eager code, and under ``torch.compile`` puts one call of
``groupgrad::parameter_grads`` in the graph instead: an opaque, ordered op
(never reordered with its kind, never removed, never captured into a CUDA
graph) whose kernel runs that same function at run time on the real
parameters, then puts into ``.grad`` every gradient autograd would have
accumulated — in the parameter's ``grad_dtype`` (fp32 straight from the GEMM
epilogue), as autograd's AccumulateGrad does, and only where this backward
accumulates into the parameter at all. Autograd then receives ``None`` for
those parameters; its AccumulateGrad still runs their post-accumulate-grad
hooks (it does for ``None``), once, on the delivered gradient. A deferred
wgrad (``backward_dw()``) keeps copies of its operands: the compiled graph
reuses their buffers once the op returns.
The zero dummies of the ``main_grad`` contract still travel through autograd
(frameworks hook their arrival): the traced graph hands autograd fresh zeros
for exactly the parameters :func:`~groupgrad.protocol.receives_dummy` names,
and the op checks at run time that the contract agrees.

What the op needs besides tensors (the layers' layouts, the module's wgrad
queue) travels as constants: a layout key registered when the graph is traced
and the queue's registry number (:meth:`WgradQueue.number`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch._library.effects import EffectType

from groupgrad.modules._grads import (
    LayerGrads,
    autograd_dispatch,
    gradients_delivered,
    parameter_grads,
)
from groupgrad.modules._group import Splits, WeightGroupSpec
from groupgrad.modules._operands import Fp8Form, Operand, operand_rows, put_together, take_apart
from groupgrad.modules._wgrad import WgradTarget
from groupgrad.modules._wgrad_queue import WgradQueue
from groupgrad.protocol import WgradRoute, accumulate_grads_like_autograd, receives_dummy

__all__ = ["hand_over", "refuse_derived_parameters"]


@dataclass(frozen=True)
class _Layout:
    """One layer of an op as the compiled op must know it (everything but its tensors);
    ``ahead``: only checked, its GEMM in a later call (:func:`hand_over`'s ``ahead``)."""

    spec: WeightGroupSpec
    shape: tuple[int, ...]
    num_weights: int
    num_biases: int
    operands: tuple[str, str]
    forms: tuple[Fp8Form | None, Fp8Form | None]
    bias_dy: bool
    ahead: bool
    frozen: tuple[bool, ...]  # per weight: it did not require grad at forward

    def bind(self, params: Sequence[Tensor]) -> LayerGrads:
        """The layer on its real parameters (weights, then biases)."""
        weights = tuple(params[: self.num_weights])
        target = WgradTarget(self.spec, self.shape, weights, self.frozen)
        return LayerGrads(target, tuple(params[self.num_weights :]), self.operands)

    def take(
        self, tensors: Iterator[Tensor], tokens: int, splits: object
    ) -> tuple[Operand, Operand, Tensor | None]:
        """The layer's ``dy``, ``x`` (tensors or FP8 forms) and bias ``dy``, from the op's tensors."""
        dy = put_together(self.forms[0], tensors, tokens, splits)
        x = put_together(self.forms[1], tensors, tokens, splits)
        return dy, x, next(tensors) if self.bias_dy else None


_LAYOUTS: dict[str, tuple[_Layout, ...]] = {}


@torch.compiler.assume_constant_result
def _layout_key(layouts: tuple[tuple[Any, ...], ...]) -> str:
    """Register the layers' layouts (when the graph is traced) and return their key.

    Each layout: names, packed, wgrad_into_main_grad, shape, weights, biases,
    operand names, operand forms, whether a bias ``dy`` follows, whether it is ahead, which
    weights did not require grad at forward.
    """
    key = repr(layouts)
    _LAYOUTS.setdefault(
        key,
        tuple(
            _Layout(WeightGroupSpec(n, p, m), s, w, b, o, f, d, a, z)
            for n, p, m, s, w, b, o, f, d, a, z in layouts
        ),
    )
    return key


@torch.compiler.assume_constant_result
def _traced_dummies(layout: str, *params: Tensor) -> tuple[bool, ...]:
    """Per parameter: whether autograd receives a dummy, read once when the graph is traced.

    Not traced by Dynamo, so it installs no guard on ``grad_added_to_main_grad``
    (whose value a framework flips every step: torch 2.11 would recompile on
    it); the op checks at run time that the answer still holds.
    """
    layers, _ = _bind_all(_LAYOUTS[layout], params)
    return tuple(d for layer in layers for d in _dummy_mask(layer))


def _bind_all(
    layouts: Sequence[_Layout], params: Sequence[Tensor]
) -> tuple[list[LayerGrads], list[LayerGrads]]:
    """The layers of one op on its flat parameter list (each layer's weights, then biases):
    those it hands over, and those it checks ahead."""
    layers: tuple[list[LayerGrads], list[LayerGrads]] = ([], [])
    start = 0
    for part in layouts:
        stop = start + part.num_weights + part.num_biases
        layers[part.ahead].append(part.bind(params[start:stop]))
        start = stop
    return layers


def _engine_accumulates(params: Sequence[Tensor], names: Sequence[str]) -> list[bool]:
    """Whether the backward now running accumulates into each parameter's ``.grad``
    (``.backward()`` does; ``backward(inputs=...)`` only for those named), their gradient
    nodes looked up together.

    Raises:
        RuntimeError: ``torch.autograd.grad`` asked for a parameter's gradient:
            the compiled op cannot return it through the traced graph.
    """
    delivered = gradients_delivered(params)
    if None in delivered:
        name = names[delivered.index(None)]
        raise RuntimeError(
            f"torch.autograd.grad asked for the gradient of parameter {name!r} of a groupgrad "
            "layer under torch.compile; compiled, groupgrad delivers parameter gradients into "
            ".grad itself (the traced graph would round an fp32 gradient of a bf16 parameter). "
            "Call .backward() and read .grad, or run this layer without torch.compile"
        )
    return cast(list[bool], delivered)


def _check_before_writing(
    layers: Sequence[LayerGrads], dummies: Sequence[bool], queued: bool
) -> set[int]:
    """What the op checks before any gradient is written: the traced dummies still agree
    with the contract, and ``torch.autograd.grad`` asks for none of the parameters whose
    gradient autograd would receive from the op (biases; weights on the autograd route,
    not ``queued`` for ``backward_dw()``). Returns the ``id``s of those whose ``.grad``
    this backward accumulates into."""
    params = [p for layer in layers for p in layer.params]
    names = [n for layer in layers for n in _names(layer)]
    expected = [d for layer in layers for d in _dummy_mask(layer)]
    if list(dummies) != expected:
        changed = [n for n, d, e in zip(names, dummies, expected, strict=True) if d != e]
        raise RuntimeError(
            f"grad_added_to_main_grad or requires_grad of {', '.join(changed)} changed after "
            "torch.compile traced this layer (it hands autograd a zero dummy exactly where "
            "they say); set them before the first compiled step, or call torch._dynamo.reset()"
        )
    returned = [r for layer in layers for r in _returned(layer, queued)]
    live = [
        (p, n) for p, n, r in zip(params, names, returned, strict=True) if r and p.requires_grad
    ]
    accumulates = _engine_accumulates([p for p, _ in live], [n for _, n in live])
    if _compiled_autograd_running():
        into_grad = [n for (_, n), takes in zip(live, accumulates, strict=True) if takes]
        _refuse_under_compiled_autograd(into_grad, queued)
    return {id(p) for (p, _), takes in zip(live, accumulates, strict=True) if takes}


def _compiled_autograd_running() -> bool:
    """Whether this op runs inside a graph of Compiled Autograd
    (``torch._dynamo.config.compiled_autograd``, ``compiled_autograd._enable``)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False))


def _refuse_under_compiled_autograd(into_grad: Sequence[str], queued: bool) -> None:
    """Refuse, before anything is written, what Compiled Autograd would silently undo.

    Its graph accumulates each parameter's gradient from what it captured before this op
    ran: a ``.grad`` the op wrote (``into_grad``: biases, weights on the autograd route)
    is set back (to ``None`` after ``zero_grad()``); and it runs the post-accumulate-grad
    hooks it captured, so a ``queued`` (delayed) layer's hooks would run at backward on a
    stale gradient and again in ``backward_dw()``. ``main_grad`` written at backward is
    kept, exactly as eager.

    Raises:
        RuntimeError: naming the first such parameter, or the delay.
    """
    if queued:
        raise RuntimeError(
            "delay_wgrad_compute=True under Compiled Autograd (torch._dynamo.config."
            "compiled_autograd): its graph runs the parameters' post-accumulate-grad hooks at "
            "backward, on a gradient not yet computed, and backward_dw() would run them again. "
            "Set delay_wgrad_compute=False, or run backward without Compiled Autograd"
        )
    if into_grad:
        raise RuntimeError(
            f"the gradient of {into_grad[0]} goes to .grad, which Compiled Autograd "
            "(torch._dynamo.config.compiled_autograd) sets back after this layer writes it (to "
            "None after zero_grad()): it would be lost. Write the weights' gradients into "
            "main_grad (accumulate_into_main_grad=True, no bias), or run backward without "
            "Compiled Autograd"
        )


def _deliver(
    layers: Sequence[LayerGrads], answers: Sequence[Tensor | None], delivered: set[int]
) -> None:
    """Put into ``.grad`` what autograd would have accumulated: the answers for the
    parameters ``delivered`` names (:func:`_check_before_writing`)."""
    params = [p for layer in layers for p in layer.params]
    picked = [
        (p, g) for p, g in zip(params, answers, strict=True) if g is not None and id(p) in delivered
    ]
    if picked:  # the hooks: autograd's AccumulateGrad runs them next, as for a None gradient
        accumulate_grads_like_autograd(
            [p for p, _ in picked], [g for _, g in picked], run_hooks=False
        )


def _names(layer: LayerGrads) -> list[str]:
    spec = layer.target.spec
    return [*spec.names, *(f"bias {i} of {spec.names[0]}" for i in range(len(layer.biases)))]


def _returned(layer: LayerGrads, queued: bool) -> list[bool]:
    """Per parameter of ``layer``: whether the op returns its gradient to autograd (a bias's
    always; a weight's on the autograd route, unless ``queued`` for ``backward_dw()``)."""
    weights = not queued and layer.target.route() is WgradRoute.AUTOGRAD
    return [weights] * len(layer.target.params) + [True] * len(layer.biases)


def _dummy_mask(layer: LayerGrads) -> list[bool]:
    """Per parameter of ``layer``: whether autograd receives a zero dummy for it."""
    spec = layer.target.spec
    weights = receives_dummy(
        layer.target.params, wgrad_into_main_grad=spec.wgrad_into_main_grad, names=spec.names
    )
    return [*weights, *([False] * len(layer.biases))]


@torch.library.custom_op(
    "groupgrad::parameter_grads", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def _parameter_grads_op(
    operands: list[Tensor],
    tokens: int,
    splits: Tensor | None,
    counts: list[int] | None,
    params: list[Tensor],
    layout: str,
    queue: int,
    dummies: list[bool],
) -> None:
    """Run :func:`parameter_grads` on the real parameters and deliver its gradients (run time).

    ``operands``: each layer's ``dy`` and ``x`` taken apart (a tensor, or an
    FP8 form's tensors; the layout says which), then its bias ``dy`` where the
    layout has one; ``tokens``: ``T``.
    """
    parts = [part for part in _LAYOUTS[layout] if not part.ahead]
    layers, ahead = _bind_all(_LAYOUTS[layout], params)
    wgrad_queue = WgradQueue.numbered(queue)
    with autograd_dispatch():
        delivered = _check_before_writing(layers, dummies, wgrad_queue is not None)
    if wgrad_queue is not None:  # kept for backward_dw(): the compiled graph reuses its buffers
        operands = [t.clone() for t in operands]
        splits = None if splits is None else splits.clone()
    counted = splits if splits is not None else tuple(counts or ())
    stream = iter(operands)
    taken = [part.take(stream, tokens, counted) for part in parts]
    dys, xs = [t[0] for t in taken], [t[1] for t in taken]
    bias_dys = [t[2] for t in taken if t[2] is not None] or None
    answers = parameter_grads(
        layers, dys, xs, counted, wgrad_queue, bias_dys=bias_dys, compiled=True, ahead=ahead
    )
    with autograd_dispatch():
        _deliver(layers, answers, delivered)


@_parameter_grads_op.register_fake
def _parameter_grads_fake(
    operands: list[Tensor],
    tokens: int,
    splits: Tensor | None,
    counts: list[int] | None,
    params: list[Tensor],
    layout: str,
    queue: int,
    dummies: list[bool],
) -> None:
    """Nothing to infer (the op returns nothing); refuses CUDA graphs while the graph is traced.

    Under ``mode="reduce-overhead"`` inductor's CUDA graph trees keep every
    allocation of the thread in their pool while they warm a graph up; the
    gradients the op leaves in ``.grad`` would live on there, untracked
    (PyTorch then stops the step). So a CUDA graph compile is refused here,
    naming the layer, before anything runs.
    """
    import torch._inductor.config as inductor_config  # loaded already when this traces

    if operands and operands[0].device.type == "cuda" and inductor_config.triton.cudagraphs:
        leader = _LAYOUTS[layout][0].spec.names[0]
        raise RuntimeError(
            f"torch.compile(mode='reduce-overhead') (CUDA graphs) is not supported for the "
            f"groupgrad layer of {leader!r}: its backward delivers parameter gradients at run "
            "time, which CUDA graph trees cannot keep; compile with the default mode"
        )


torch.library._register_effectful_op(_parameter_grads_op._opoverload, EffectType.ORDERED)


def hand_over(
    layers: Sequence[LayerGrads],
    dys: Sequence[Operand],
    xs: Sequence[Operand],
    splits: Splits,
    queue: WgradQueue | None,
    *,
    bias_dys: Sequence[Tensor] | None = None,
    ahead: Sequence[LayerGrads] = (),
) -> list[Tensor | None]:
    """What autograd receives for every layer's parameters (:func:`parameter_grads`).

    Eager: :func:`parameter_grads` itself. Under ``torch.compile``: one
    ``groupgrad::parameter_grads`` call in the graph (see the module
    docstring), and fresh zeros where the ``main_grad`` contract hands
    autograd a dummy, ``None`` elsewhere. ``dys`` and ``xs`` may be FP8
    forms (:class:`~groupgrad.kernels.Fp8Blocks`; then ``bias_dys`` carries
    the unquantized ``dy`` for bias gradients): compiled, each crosses the op
    as its tensors and is rebuilt there. ``ahead``: layers a later call hands
    over, checked now (their parameters cross the op too, their layouts marked).
    """
    if not torch.compiler.is_compiling():
        if queue is not None and _compiled_autograd_running():  # its compiler traced no Dynamo
            _refuse_under_compiled_autograd((), queued=True)
        return parameter_grads(layers, dys, xs, splits, queue, bias_dys=bias_dys, ahead=ahead)
    tensors: list[Tensor] = []
    layouts = []
    for index, (layer, dy, x) in enumerate(zip(layers, dys, xs, strict=True)):
        (dy_form, dy_parts), (x_form, x_parts) = take_apart(dy), take_apart(x)
        tensors += [*dy_parts, *x_parts, *([] if bias_dys is None else [bias_dys[index]])]
        layouts.append(_layout_of(layer, (dy_form, x_form), bias_dys is not None, False))
    layouts += [_layout_of(layer, (None, None), False, True) for layer in ahead]
    own = [p for layer in layers for p in layer.params]
    params = [*own, *(p for layer in ahead for p in layer.params)]
    key = _layout_key(tuple(layouts))
    dummies = _traced_dummies(key, *params)  # for the layers handed over
    is_tensor = isinstance(splits, Tensor)
    torch.ops.groupgrad.parameter_grads(
        tensors,
        operand_rows(dys[0]),
        splits if is_tensor else None,
        None if is_tensor else [int(s) for s in splits],
        params,
        key,
        -1 if queue is None else queue.number,
        list(dummies),
    )
    return [torch.zeros_like(p) if d else None for p, d in zip(own, dummies, strict=True)]


def _layout_of(
    layer: LayerGrads, forms: tuple[Fp8Form | None, Fp8Form | None], bias_dy: bool, ahead: bool
) -> tuple[Any, ...]:
    """``layer``'s entry of :func:`_layout_key`."""
    spec, sizes = layer.target.spec, (len(layer.target.params), len(layer.biases))
    flags = (spec.packed, spec.wgrad_into_main_grad)
    tail = (layer.operands, forms, bias_dy, ahead, layer.target.frozen_at_forward)
    return (spec.names, *flags, layer.target.shape, *sizes, *tail)


def refuse_derived_parameters(
    params: Sequence[Tensor], leader: str, *, delayed: Sequence[Tensor] = ()
) -> None:
    """Refuse a weight or bias computed from another tensor where groupgrad, not autograd,
    delivers its gradient into ``.grad``: under ``torch.compile``, and a weight whose
    gradient ``delay_wgrad_compute`` defers to ``backward_dw()``.

    Compiled, the layer's backward delivers parameter gradients into ``.grad``
    at run time (module docstring), and the traced backward hands autograd
    ``None`` for them; ``backward_dw()`` adds the deferred gradients into
    ``.grad`` after autograd's backward. A tensor computed from a parameter
    (``p * 2``, ``p.t().contiguous()``, a ``DTensor``'s ``to_local()``, a
    ``torch.nn.utils.parametrize`` weight) has no ``.grad`` that reaches that
    parameter, so its gradient would be lost without a word. Eager code without
    delay takes such tensors (autograd carries their gradient back).

    Args:
        params: The layer's weights and biases, as the autograd Function gets them.
        leader: The name of the layer's first weight, for the message.
        delayed: The weights among ``params`` whose gradient is deferred.

    Raises:
        RuntimeError: One of ``params`` requires grad and is not a leaf, while
            grad mode is on under ``torch.compile``, or one of ``delayed`` does
            while grad mode is on.
    """
    if not torch.is_grad_enabled():
        return
    if not torch.compiler.is_compiling():
        for param in delayed:
            if param.requires_grad and not param.is_leaf:
                raise RuntimeError(
                    f"a weight of the groupgrad layer led by {leader!r} is computed from "
                    "another tensor (not a leaf: a parametrization, weight_norm, p * 2) and the "
                    "layer has delay_wgrad_compute=True: backward_dw() adds its gradient into "
                    ".grad after autograd's backward, where it would not reach the tensor it "
                    "came from. Set delay_wgrad_compute=False for this layer, or pass the "
                    "parameter itself"
                )
        return
    for index, param in enumerate(params):
        if param.requires_grad and not param.is_leaf:
            raise RuntimeError(
                f"tensor {index} among the parameters of the groupgrad layer led by {leader!r} "
                "is computed from another tensor (not a leaf) under torch.compile, where "
                "groupgrad delivers parameter gradients into .grad itself: its gradient would "
                "not reach the tensor it came from. Pass the parameter itself, or run this "
                "layer without torch.compile (torch.compiler.disable)"
            )
