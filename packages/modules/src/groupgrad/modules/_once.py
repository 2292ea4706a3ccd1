"""The grouped ops differentiate once: a second derivative through them is an error, never zero.

Their backwards run GEMM kernels that autograd does not record, so the
gradients they return carry no graph. Under ``create_graph=True`` (a gradient
penalty, a Hessian-vector product, MAML) autograd would take those gradients
for constants, and a second derivative through them would silently lack this
op's terms. :func:`differentiable_once` gives each gradient, in that mode
only, a ``grad_fn`` that raises when a second backward reaches it; first-order
values are unchanged. Compiled graphs need nothing: AOTAutograd refuses a
double backward itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["differentiable_once"]

Backward = Callable[..., tuple[Tensor | None, ...]]


class _SecondDerivative(torch.autograd.Function):
    """Copies of the gradients whose backward raises (autograd reaches it only twice over)."""

    @staticmethod
    def forward(ctx: Any, op: str, *grads: Tensor) -> tuple[Tensor, ...]:
        ctx.op = op
        return tuple(g.clone() for g in grads)

    @staticmethod
    def backward(ctx: Any, *unused: Tensor) -> tuple[None, ...]:
        raise RuntimeError(
            f"{ctx.op} is differentiable once: a second derivative through its gradients "
            "(create_graph=True: a gradient penalty, a Hessian-vector product) is not "
            "supported, expected only first-order gradients of it"
        )


def differentiable_once(op: str) -> Callable[[Backward], Backward]:
    """Decorate an autograd Function's ``backward`` (under ``@staticmethod``) for op ``op``.

    Without ``create_graph`` (grad mode off in backward) or while compiling,
    the backward runs as written. With it, the backward runs without
    recording, and every gradient it returns comes back through
    :class:`_SecondDerivative`: the same values, and an error if differentiated.
    """

    def decorate(backward: Backward) -> Backward:
        @functools.wraps(backward)
        def once(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
            if torch.compiler.is_compiling() or not torch.is_grad_enabled():
                return backward(ctx, *grad_outputs)
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            given = [g.detach().requires_grad_() for g in grads if isinstance(g, Tensor)]
            refused = iter(_SecondDerivative.apply(op, *given) if given else ())
            return tuple(next(refused) if isinstance(g, Tensor) else g for g in grads)

        return once

    return decorate
