"""The module matrix: one :class:`Case` per combination of the options DESIGN.md names.

``GroupedLinear`` and ``GroupedMLP`` are each tested over
{per-expert, single grouped weight} × {plain, distributed} × {no main_grad,
accumulate, overwrite} × {delay, no delay} × {zero_out_wgrad} × {bias}::

    CASES = [c for c in Case.all() if not (c.zero_out and c.main_grad == "none")]

    @pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
    def test_matches_reference(case: Case) -> None: ...

:func:`module_flags` gives a module the case's options,
:func:`distribute_fake` and :func:`attach_main_grads` set it up for the
case's ``kind`` and ``main_grad``; :func:`experts_fp64` reads a
``GroupedLinear``'s experts for an fp64 reference. After each step
:func:`assert_main_grads_wait_for_backward_dw` (before ``backward_dw()``) and
:func:`assert_weight_grads` check where the weight gradients went, and
:func:`write_into_dummies` dirties the shared zero dummy as a hook would;
:func:`assert_group_backward_ran_once` checks a fake group's leader after a backward.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

Layout = Literal["per_expert", "single"]
Kind = Literal["plain", "distributed"]
MainGrad = Literal["none", "accumulate", "overwrite"]


@dataclass(frozen=True)
class Case:
    """One combination of module options.

    Attributes:
        layout: ``"per_expert"``: one parameter per expert (``weight0`` ..);
            ``"single"``: one packed ``(E, N, K)`` parameter
            (``single_grouped_weight=True``).
        kind: ``"plain"``: ordinary parameters; ``"distributed"``: the
            weights are a ``DistributedWeight`` group (the protocol's fakes
            in the single-process tests).
        main_grad: ``"none"``: wgrads go to ``.grad``
            (``accumulate_into_main_grad=False``); ``"accumulate"``: added into
            a ``main_grad`` that holds earlier values; ``"overwrite"``: copied
            into a ``main_grad`` (``overwrite_main_grad=True``) poisoned with NaN.
        delay: ``delay_wgrad_compute=True``: wgrads run at ``backward_dw()``.
        zero_out: ``zero_out_wgrad=True``: the zero dummy autograd receives is
            re-zeroed before each hand-out (meaningful with a ``main_grad``).
        bias: The module has biases.
    """

    layout: Layout
    kind: Kind
    main_grad: MainGrad
    delay: bool
    zero_out: bool
    bias: bool

    @property
    def id(self) -> str:
        """A pytest id such as ``per_expert-plain-accumulate-delay-keep-bias``."""
        return "-".join(
            [
                self.layout,
                self.kind,
                self.main_grad,
                "delay" if self.delay else "now",
                "zero_out" if self.zero_out else "keep",
                "bias" if self.bias else "nobias",
            ]
        )

    @classmethod
    def all(cls) -> list[Case]:
        """Every combination, in the order of the fields (layout varies slowest)."""
        return [
            cls(*combo)
            for combo in itertools.product(
                get_args(Layout),
                get_args(Kind),
                get_args(MainGrad),
                (False, True),
                (False, True),
                (False, True),
            )
        ]


def module_flags(case: Case) -> dict[str, Any]:
    """The constructor options of ``GroupedLinear`` / ``GroupedMLP`` that ``case`` sets."""
    return {
        "bias": case.bias,
        "single_grouped_weight": case.layout == "single",
        "accumulate_into_main_grad": case.main_grad != "none",
        "delay_wgrad_compute": case.delay,
    }


def splits_for(experts: int, splits: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each micro-batch's token counts for a layer of ``experts``: ``splits`` (one count per
    expert), or, for one expert, each micro-batch's total."""
    return [list(s) for s in splits] if experts > 1 else [[sum(s)] for s in splits]


def experts_fp64(linear: nn.Module) -> tuple[list[Tensor], list[Tensor | None]]:
    """Each expert's weight and bias (``None`` without bias) of a ``GroupedLinear``, in fp64."""
    E: int = linear.num_groups  # type: ignore[assignment]
    if linear.single_grouped_weight:
        ws = list(linear.weight.detach().double().unbind(0))
        bs: list[Tensor | None] = (
            list(linear.bias.detach().double().unbind(0)) if linear.use_bias else [None] * E
        )
    else:
        ws = [getattr(linear, f"weight{e}").detach().double() for e in range(E)]
        bs = [
            getattr(linear, f"bias{e}").detach().double() if linear.use_bias else None
            for e in range(E)
        ]
    return ws, bs


def assert_matrix_close(actual: Tensor, expected: Tensor, what: str) -> None:
    """``actual`` (any float dtype) equals the fp64 ``expected`` to the matrix tests' 1e-5."""
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5, msg=what)


def assert_main_grads_wait_for_backward_dw(
    case: Case, weights: Sequence[Tensor], before: Sequence[Tensor | None]
) -> None:
    """Before ``backward_dw()``: a delayed plain case's ``main_grad`` is as it was (``before``).

    Backward handed autograd the flag and dummy only; ``main_grad`` is written
    at ``backward_dw()``. Other cases are not checked here.
    """
    if case.delay and case.kind == "plain" and case.main_grad != "none":
        for w, old in zip(weights, before, strict=True):
            torch.testing.assert_close(w.main_grad, old, equal_nan=True)  # type: ignore[attr-defined]
        assert all(w.grad_added_to_main_grad for w in weights)  # type: ignore[attr-defined]


def assert_weight_grads(
    case: Case,
    weights: Sequence[Tensor],
    labels: Sequence[str],
    *,
    latest: Sequence[Tensor],
    total: Sequence[Tensor],
    initial: Sequence[Tensor | None],
) -> None:
    """After a step, each weight's gradient is where ``case.main_grad`` puts it.

    ``"none"``: ``.grad`` holds ``total`` (the fp64 sum of every step's wgrad).
    ``"overwrite"``: ``main_grad`` holds ``latest`` (this step's); ``"accumulate"``:
    ``initial`` (``main_grad`` before the first step) plus ``total``. With a
    ``main_grad`` the flag is set and ``.grad`` is a zero dummy of the
    weight's shape. ``labels`` name the weights in messages.
    """
    for w, label, dw, dw_sum, start in zip(weights, labels, latest, total, initial, strict=True):
        if case.main_grad == "none":
            assert_matrix_close(w.grad, dw_sum, f".grad of {label}")  # type: ignore[arg-type]
            continue
        expected = dw if case.main_grad == "overwrite" else start.double() + dw_sum  # type: ignore[union-attr]
        assert_matrix_close(w.main_grad, expected, f"main_grad of {label}")  # type: ignore[attr-defined]
        assert w.grad_added_to_main_grad is True, label  # type: ignore[attr-defined]
        assert w.grad is not None, f"{label}: autograd received no dummy"
        assert w.grad.shape == w.shape
        assert not w.grad.any(), f"{label}: the dummy .grad is not zero"


def distribute_fake(owner: nn.Module, main_grad: MainGrad) -> list[Tensor]:
    """Replace ``owner``'s weights (``owner.weight_names``) with one fake ``DistributedWeight`` group.

    The group comes from ``groupgrad.protocol.testing.make_fake_group``: its
    leader's forward materialization scales the weights by 2 and its backward
    one by 4 (so a test sees which weights each GEMM used), and its finalize
    hands autograd the wgrads (``main_grad="none"``) or zero dummies (with an
    fp32 ``main_grad``).

    Returns:
        The group's members, leader first (now ``owner``'s weights).
    """
    from groupgrad.protocol.testing import FakeDistributedWeight, make_fake_group

    names: list[str] = list(owner.weight_names)  # type: ignore[arg-type]
    group = make_fake_group(
        [getattr(owner, name) for name in names],
        main_grad_dtype=None if main_grad == "none" else torch.float32,
    )
    leader = group[0]
    assert isinstance(leader, FakeDistributedWeight)
    leader.finalize_returns = "grads" if main_grad == "none" else "dummy"
    for name, param in zip(names, group, strict=True):
        setattr(owner, name, param)
    return group


def assert_group_backward_ran_once(group: Sequence[Tensor]) -> None:
    """After one backward: the fake group's leader materialized it for backward once and finalized it once."""
    from groupgrad.protocol.testing import FakeDistributedWeight

    leader = group[0]
    assert isinstance(leader, FakeDistributedWeight), type(leader)
    assert leader.calls["materialize_group_for_backward"] == 1
    assert leader.calls["finalize_group_grads"] == 1


def attach_main_grads(
    params: Sequence[Tensor],
    main_grad: MainGrad,
    *,
    zero_out: bool = False,
    generator: torch.Generator | None = None,
) -> None:
    """Give each parameter the ``main_grad`` and flags ``main_grad`` (a :class:`Case` field) asks for.

    ``"none"``: nothing. ``"accumulate"``: an fp32 ``main_grad`` of random
    values (from ``generator``, drawn on the CPU, or from the global RNG on
    the parameter's device when ``None``) that the wgrad is added to.
    ``"overwrite"``: an fp32 ``main_grad`` of NaN with ``overwrite_main_grad``
    set, so an element left unwritten shows. Both clear
    ``grad_added_to_main_grad`` and set ``zero_out_wgrad`` where ``zero_out``.
    """
    if main_grad == "none":
        return
    for param in params:
        if main_grad == "overwrite":
            buffer = torch.full(param.shape, float("nan"), device=param.device)
        elif generator is not None:
            buffer = torch.randn(param.shape, generator=generator).to(param.device)
        else:
            buffer = torch.randn(param.shape, device=param.device)
        param.main_grad = buffer  # type: ignore[attr-defined]
        param.overwrite_main_grad = main_grad == "overwrite"  # type: ignore[attr-defined]
        param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        if zero_out:
            param.zero_out_wgrad = True  # type: ignore[attr-defined]


def write_into_dummies(weights: Sequence[Tensor], *, versioned: bool) -> None:
    """Write into the shared zero dummy behind each ``.grad``, as hooks and frameworks do.

    ``versioned``: an ordinary in-place add, which moves the buffer's version
    counter (the protocol's version guard must re-zero it). Else the write
    goes through ``.data``, which the version counter cannot see (a fused
    kernel writing the storage): only ``zero_out_wgrad`` re-zeroes it. The
    next hand-out must be all zeros either way.
    """
    for weight in weights:
        grad = weight.grad
        assert grad is not None, "no dummy to write into"
        (grad if versioned else grad.data).add_(1.0)
