"""What one backward hands autograd for a grouped op's parameters: wgrads and bias gradients.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features;
``dy_TN`` a layer's output gradient, ``x_TK`` its input, ``b_EN`` its bias.

An op's backward describes each of its layers as a :class:`LayerGrads` (the
wgrad target, the biases, how messages name the GEMM's operands) and asks
:func:`parameter_grads` for what autograd receives: every ``main_grad``
GEMM of every layer is planned and checked before the first GEMM writes, then
each layer's wgrad GEMM runs (or is queued for ``backward_dw()``) and its
bias gradient is summed. The autograd Functions reach this through
:func:`groupgrad.modules._compiled.hand_over`, the same code eager and
compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd.graph import Node

from groupgrad.kernels import grouped_wgrad
from groupgrad.modules._group import Splits
from groupgrad.modules._operands import Operand
from groupgrad.modules._wgrad import DeferredWgrad, ReadyWgrad, WgradTarget
from groupgrad.modules._wgrad_queue import WgradQueue
from groupgrad.protocol import WgradRoute, autograd_grad_dtype

#: A layer's weights' gradient nodes, in the weights' order (``None`` for one that requires
#: no grad): :func:`gradient_nodes`.
WeightNodes = tuple[Node | None, ...]

__all__ = [
    "LayerGrads",
    "autograd_dispatch",
    "bias_grad",
    "bias_grads",
    "gradient_delivered",
    "gradient_nodes",
    "gradients_delivered",
    "parameter_grads",
]


def bias_grad(dy_TN: Tensor, splits: Splits, dtype: torch.dtype) -> Tensor:
    """``(E, N)`` bias gradient: the fp32 sum of each expert's rows of ``dy``, cast to ``dtype``.

    Summed by the grouped wgrad GEMM against 8 columns of ones (``dy_e.T @ 1``, the
    narrowest the GEMM aligns): exact products, fp32 sums, bitwise reproducible,
    where CUDA's ``index_add_`` adds atomically in an order that changes from run to
    run (for bf16 ``dy`` 4-8x slower: DEVICE_RUNS 202; fp32 ``dy``'s split makes this
    route about 5x slower than it: DEVICE_RUNS 211). bf16 and fp16 ``dy`` go in as they are
    (their values are exact in TF32 too, should a reference-path GEMM use it); fp32
    ``dy`` as :func:`_exact_bf16_parts`, whose three sums are added in a fixed order.
    """
    T, N = dy_TN.shape
    whole = dy_TN.dtype in (torch.bfloat16, torch.float16)
    dy_TX = dy_TN if whole else _exact_bf16_parts(dy_TN)
    ones_TK = dy_TX.new_ones(T, 8)
    db_EX = grouped_wgrad(dy_TX, ones_TK, splits, out_dtype=torch.float32)[..., 0]
    if whole:
        return db_EX.contiguous().to(dtype)
    high, middle, low = db_EX.unflatten(1, (3, N)).unbind(1)
    return (high + (middle + low)).to(dtype)


def _exact_bf16_parts(x_TN: Tensor) -> Tensor:
    """``(T, 3N)`` bf16 whose three ``N``-wide parts sum to fp32 ``x``: its top 8 significant
    bits, the next 8, the rest.

    Each part is ``x``'s bits truncated, so none rounds or overflows: a finite ``x``
    near the fp32 maximum stays finite, though the first parts' sum may overflow
    within about 1 % of it where ``x``'s would not (a first part is below ``|x|`` by up
    to 2**-7 of it). Only bits below bf16's smallest subnormal, 2**-133 (in values
    under 2**-110), are lost. A non-finite ``x`` is its own first part, the others 0.
    Written in place where it can: about 4x ``x``'s bytes at the peak.
    """
    x = x_TN.float()
    T, N = x.shape
    parts = x.new_empty(T, 3, N, dtype=torch.bfloat16)
    finite = torch.isfinite(x)
    high = torch.where(finite, _top_bf16_bits(x), x)
    parts[:, 0] = high
    rest = torch.sub(x, high, out=high).masked_fill_(~finite, 0.0)  # exact: what high left out
    middle = _top_bf16_bits(rest)
    parts[:, 1] = middle
    parts[:, 2] = rest.sub_(middle)
    return parts.view(T, 3 * N)


def _top_bf16_bits(x: Tensor) -> Tensor:
    """fp32 ``x`` with its 16 low bits cleared: bf16-representable, rounded toward zero."""
    return (x.view(torch.int32) & -65536).view(torch.float32)


def bias_grads(
    dy_TN: Tensor, biases: Sequence[Tensor], splits: Splits, packed: bool
) -> list[Tensor | None]:
    """What autograd receives for a layer's biases: each in its ``grad_dtype``, or ``None``s.

    ``None`` for every bias when none requires grad (or there are none).
    """
    if not biases or not any(b.requires_grad for b in biases):
        return [None] * len(biases)
    db_EN = bias_grad(dy_TN, splits, autograd_grad_dtype(biases))
    grads: list[Tensor | None] = [db_EN] if packed else list(db_EN.unbind(0))
    return [g if b.requires_grad else None for g, b in zip(grads, biases, strict=True)]


@contextlib.contextmanager
def autograd_dispatch() -> Iterator[None]:
    """Autograd's dispatch on, also inside a custom op's kernel (which runs below it).

    So that a parameter's gradient edge can be looked up there, and its
    post-accumulate-grad hooks run as they do under autograd's AccumulateGrad.
    """
    key = torch._C.DispatchKey.AutogradFunctionality
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)


def gradient_nodes(ctx: Any, *groups: Sequence[Tensor]) -> list[WeightNodes | None]:
    """The gradient nodes of each group of an autograd Function's parameters, read off its
    context (``ctx.next_functions``): the groups, in this order, are the last inputs of its
    ``apply`` (e.g. fc1's weights, fc1's biases, fc2's weights, fc2's biases). Cheaper than a
    lookup per parameter (:func:`gradient_delivered`): at 128 experts a layer's nodes cost
    microseconds, its lookups a fraction of a millisecond. ``None`` for every group while
    ``torch.compile`` traces: the compiled op looks them up at run time."""
    if torch.compiler.is_compiling():
        return [None] * len(groups)
    edges = ctx.next_functions
    start = len(edges) - sum(map(len, groups))
    nodes: list[WeightNodes | None] = []
    for group in groups:
        nodes.append(tuple(map(itemgetter(0), edges[start : start + len(group)])))
        start += len(group)
    return nodes


def _executes(node: Node) -> bool | None:
    """Whether the backward now running executes ``node``; ``None`` where
    ``torch.autograd.grad`` captures the gradient of a leaf it stands for."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # a leaf whose gradient torch.autograd.grad captures
        return None


def gradient_delivered(param: Tensor) -> bool | None:
    """Whether the backward now running delivers ``param``'s gradient.

    ``.backward()`` delivers every parameter's; ``backward(inputs=[...])`` and
    ``torch.autograd.grad(outputs, [...])`` only those of the tensors named
    (and of nothing the backward does not reach): a wgrad GEMM for another
    parameter, into its ``main_grad`` or a ``backward_dw()`` job, would be a
    gradient nobody asked for, added where the next step reads it.

    Returns:
        ``True`` or ``False``; ``None`` where ``torch.autograd.grad`` captures
        ``param``'s gradient itself (it is named among the inputs).
    """
    return gradients_delivered([param])[0]


def gradients_delivered(params: Sequence[Tensor]) -> list[bool | None]:
    """:func:`gradient_delivered` of each of ``params`` (each requiring grad), their gradient
    nodes looked up together (:func:`_lookup_nodes`)."""
    return _states(_lookup_nodes(params)) if params else []


def _states(nodes: Sequence[Node]) -> list[bool | None]:
    """:func:`_executes` of each node, in one pass in the common case (no gradient captured)."""
    try:
        return list(map(torch._C._will_engine_execute_node, nodes))
    except RuntimeError:  # torch.autograd.grad captures one of them
        return list(map(_executes, nodes))


def _weights_delivered(target: WgradTarget, nodes: WeightNodes | None, queued: bool) -> bool:
    """Whether this backward delivers the gradients of ``target``'s trainable weights.

    Where the wgrads go back to autograd, which drops those nobody asked for,
    any one weight delivered runs the GEMM. Where they go past autograd — into
    ``main_grad``, a distributed group's buffers or a ``backward_dw()`` job
    (``queued``) — the one GEMM writes every member's, so this backward must
    deliver all of them or none.

    Args:
        nodes: The weights' gradient nodes (:func:`gradient_nodes`); ``None``:
            looked up per weight.

    Raises:
        RuntimeError: Past autograd, some trainable weights delivered and
            others not (``backward(inputs=...)`` or ``torch.autograd.grad``
            naming some of them); nothing was written.
    """
    past = queued or target.spec.wgrad_into_main_grad or target.route() is WgradRoute.DISTRIBUTED
    if nodes is None:  # compiled: looked up at run time
        trainable = [p for p in target.params if p.requires_grad]
        if not trainable or not past:
            return any(gradient_delivered(p) is not False for p in trainable)
        live = _lookup_nodes(trainable)
    else:
        live = [node for node in nodes if node is not None]  # the trainable weights'
        if not live or not past:
            return any(_executes(node) is not False for node in live)
    states = _states(live)
    if queued and None in states and target.route() is WgradRoute.AUTOGRAD:
        raise RuntimeError(
            f"torch.autograd.grad asks for the gradient of {_trainable_names(target)[states.index(None)]}, "
            "which delay_wgrad_compute=True defers to backward_dw() (it puts the gradient into "
            ".grad): call .backward(), then backward_dw(), or build the layer without "
            "delay_wgrad_compute"
        )
    taken = [state is not False for state in states]
    if all(taken) or not any(taken):
        return taken[0]
    names = _trainable_names(target)
    asked = [name for name, t in zip(names, taken, strict=True) if t]
    left = [name for name, t in zip(names, taken, strict=True) if not t]
    raise RuntimeError(
        f"this backward asks for the gradients of {_listing(asked)} but not of "
        f"{_listing(left)} (backward(inputs=...) or torch.autograd.grad naming some of them): "
        "groupgrad writes a grouped layer's weight gradients past autograd (into main_grad, a "
        "distributed group's buffers or a backward_dw() job) in one GEMM for all of them, so "
        "the others would get a gradient nobody asked for; name all of the layer's trainable "
        "weights, or none of them"
    )


def _trainable_names(target: WgradTarget) -> list[str]:
    """The names of ``target``'s weights that require grad, in order (for messages)."""
    pairs = zip(target.spec.names, target.params, strict=True)
    return [name for name, p in pairs if p.requires_grad]


def _refuse_hooked(
    layers: Sequence[LayerGrads], taken: Sequence[bool], how: str, *, biases: bool
) -> None:
    """Raise where a parameter whose gradient reaches ``.grad`` past autograd (``how`` says
    why: a ``backward_dw()`` job, the compiled op) has a tensor hook (``Tensor.register_hook``):
    autograd would call the hook with ``None``, and the gradient would land unhooked.

    The weights of each layer ``taken`` on the autograd route, and with ``biases`` the
    biases (compiled, theirs go past autograd too) this backward delivers; checked before
    anything is written. Post-accumulate-grad hooks run on the delivered gradient as
    autograd runs them (:func:`groupgrad.protocol.accumulate_grads_like_autograd`).
    """
    hooked: list[tuple[str, Tensor]] = []
    for layer, takes in zip(layers, taken, strict=True):
        spec = layer.target.spec
        if takes and layer.target.route() is WgradRoute.AUTOGRAD:
            pairs = zip(spec.names, layer.target.params, strict=True)
            hooked += [(name, p) for name, p in pairs if p.requires_grad and p._backward_hooks]
        if biases:
            named = [(f"bias {i} of {spec.names[0]}", b) for i, b in enumerate(layer.biases)]
            hooked += [(name, b) for name, b in named if b.requires_grad and b._backward_hooks]
    if not hooked:
        return
    delivered = gradients_delivered([p for _, p in hooked])
    names = [name for (name, _), state in zip(hooked, delivered, strict=True) if state]
    if names:
        raise RuntimeError(
            f"a gradient hook (Tensor.register_hook) is on {_listing(names)}, whose gradient "
            f"goes into .grad past autograd {how}: autograd would call the hook with None and "
            "the gradient would land unhooked. Register it with "
            "register_post_accumulate_grad_hook (run on the delivered .grad), or hook the "
            "layer's output instead"
        )


def _lookup_nodes(params: Sequence[Tensor]) -> list[Node]:
    """The gradient nodes of ``params`` (each requiring grad), looked up together: a leaf's
    is its gradient accumulator, reached through a view as ``get_gradient_edge`` does
    (about a microsecond a parameter, a quarter of a lookup through ``get_gradient_edge``
    with the dispatch entered per parameter)."""
    with autograd_dispatch(), torch.enable_grad():  # a backward runs with grad mode off
        return [p.grad_fn or _accumulator(p) for p in params]


def _accumulator(leaf: Tensor) -> Node:
    """A leaf's gradient accumulator: the next node of a view's."""
    return cast(Node, cast(Node, leaf.view_as(leaf).grad_fn).next_functions[0][0])


def _listing(names: Sequence[str]) -> str:
    """``names`` joined for a message, the first few of a long list."""
    shown = ", ".join(names[:4])
    return shown if len(names) <= 4 else f"{shown}, … ({len(names)} in all)"


@dataclass(frozen=True)
class LayerGrads:
    """One layer of an op, as its backward's parameter gradients see it.

    Attributes:
        target: The layer's wgrad GEMM target (weight layout, shape, weights).
        biases: The layer's bias parameters (empty without bias).
        operands: How messages name the wgrad GEMM's ``dy`` and ``x``.
        nodes: The weights' gradient nodes where the op's backward has them
            (:func:`gradient_nodes`); ``None``: looked up where needed.
    """

    target: WgradTarget
    biases: tuple[Tensor, ...] = ()
    operands: tuple[str, str] = ("dy", "x")
    nodes: WeightNodes | None = None

    @property
    def params(self) -> tuple[Tensor, ...]:
        """The weights, then the biases: the order autograd's answers take."""
        return (*self.target.params, *self.biases)


def parameter_grads(
    layers: Sequence[LayerGrads],
    dys: Sequence[Operand],
    xs: Sequence[Operand],
    splits: Splits,
    queue: WgradQueue | None,
    *,
    bias_dys: Sequence[Tensor] | None = None,
    compiled: bool = False,
    ahead: Sequence[LayerGrads] = (),
) -> list[Tensor | None]:
    """Run one backward's wgrad GEMMs (or queue them) and sum its bias gradients.

    A layer none of whose weights' gradients this backward delivers
    (:func:`gradient_delivered`: ``torch.autograd.grad(loss, [x])``,
    ``backward(inputs=[...])``) runs no wgrad GEMM and queues nothing; its
    weights get ``None``. One whose wgrads go past autograd must have all of
    its trainable weights delivered or none (:func:`_weights_delivered`).

    Args:
        layers: The op's layers, in the order their GEMMs run.
        dys: Each layer's ``(T, N)`` output gradient, as its wgrad GEMM reads
            it: a tensor, or its ``(128, 1)`` FP8 form.
        xs: Each layer's ``(T, K)`` input, in the form ``dys`` take.
        splits: ``E`` token counts (the op's copy from forward).
        queue: The module's wgrad queue with ``delay_wgrad_compute`` (the
            wgrad GEMMs become one job for ``backward_dw()``), else ``None``.
        bias_dys: Each layer's output gradient as a tensor, for its bias
            gradient, where ``dys`` are FP8 forms (a bias gradient is summed
            from the unquantized ``dy``); ``None``: ``dys`` themselves.
        compiled: Run by the compiled op, which puts the gradients into
            ``.grad`` itself (``groupgrad.modules._compiled``).
        ahead: Layers of the same backward that a later call hands over
            (``routed_grouped_mlp`` hands fc1 over once fc2's operands are
            freed): their partial-delivery and tensor-hook refusals run here
            too, before this call writes (their other checks, at their call).

    Returns:
        What autograd receives for :attr:`LayerGrads.params` of every layer,
        concatenated in layer order.

    Raises:
        RuntimeError: A ``main_grad`` of any layer is missing or malformed, a
            layer's weights are delivered in part, or a parameter whose
            gradient goes past autograd has a tensor hook; nothing was
            written then.
    """
    deferred: list[DeferredWgrad] | None = None if queue is None else []
    every = [*layers, *ahead]
    takes_every = [_weights_delivered(ly.target, ly.nodes, queue is not None) for ly in every]
    taken = takes_every[: len(layers)]
    for layer, takes in zip(every, takes_every, strict=True):
        if takes:
            layer.target.refuse_thawed(queue is not None)
    if compiled:
        _refuse_hooked(every, takes_every, "under torch.compile", biases=True)
    elif queue is not None:
        how = "with delay_wgrad_compute=True (backward_dw())"
        _refuse_hooked(every, takes_every, how, biases=False)
    readied: list[ReadyWgrad | None] = [None] * len(layers)
    if deferred is None:  # every main_grad GEMM is checked before any GEMM writes
        readied = [
            layer.target.early(dy, x, splits) if takes else None
            for layer, dy, x, takes in zip(layers, dys, xs, taken, strict=True)
        ]
    # a bias gradient sums the unquantized dy: bias_dys where dys are FP8 forms
    sums = cast(list[Tensor], list(dys if bias_dys is None else bias_dys))
    answers: list[Tensor | None] = []
    for layer, dy, x, ready, dy_TN, takes in zip(
        layers, dys, xs, readied, sums, taken, strict=True
    ):
        if takes:
            answers += layer.target.step(dy, x, splits, deferred, layer.operands, ready)
        else:  # no weight of it requires grad, or this backward delivers none of theirs
            answers += [None] * len(layer.target.params)
        answers += bias_grads(dy_TN, layer.biases, splits, layer.target.spec.packed)
    if queue is not None and deferred is not None:
        queue.push(deferred)
    return answers
