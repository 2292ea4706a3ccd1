"""Running a grouped ``autograd.Function`` when no backward will follow (grad mode off).

With grad mode off (``torch.no_grad()``, ``torch.inference_mode()``, an
evaluation loop) a grouped Function's forward runs on a context no backward
reads: :func:`forward_without_backward` calls ``forward`` directly there
instead of ``apply``. Eager results are the same; the reason is ``torch.compile``: Dynamo
(seen on torch 2.13) binds the variadic parameters of a Function's forward to
the wrong arguments when it traces ``apply`` with grad mode off, so a
``fullgraph=True`` compile of an evaluation step failed ("unsupported operand
type(s) for @: 'int' and 'FakeTensor'", "'str' object has no attribute
'split'"), depending on the number of parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["forward_without_backward", "wgrad_follows"]


class _NoBackward:
    """The context of a forward no backward follows: it keeps what forward stores on it and
    saves nothing for backward."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass


def wgrad_follows(ctx: Any, weights: Sequence[torch.Tensor]) -> bool:
    """Whether a backward will compute a weight gradient of ``weights`` from what a grouped
    Function's forward saves on ``ctx``: one of them requires grad, and a backward follows
    (not where :func:`forward_without_backward` runs the forward)."""
    return not isinstance(ctx, _NoBackward) and any(w.requires_grad for w in weights)


def forward_without_backward(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.forward(ctx, *args)`` on a context no backward reads: what ``apply`` computes
    with grad mode off. Callers use it in place of ``apply`` exactly then, and call their
    Function's ``apply`` directly otherwise: an ``apply`` reached through a helper's argument
    recorded no graph where Dynamo fell back on eager code (a weight computed from a
    parameter lost its gradient)."""
    return function.forward(_NoBackward(), *args)
