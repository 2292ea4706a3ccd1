"""Running a grouped ``autograd.Function`` when no backward will follow (grad mode off).

With grad mode off (``torch.no_grad()``, ``torch.inference_mode()``, an
evaluation loop) a grouped Function's forward runs on a context no backward
reads: :func:`apply_function` calls ``forward`` directly there instead of
``apply``. Eager results are the same; the reason is ``torch.compile``: Dynamo
(torch 2.11 to 2.13) binds the variadic parameters of a Function's forward to
the wrong arguments when it traces ``apply`` with grad mode off, so a
``fullgraph=True`` compile of an evaluation step failed ("unsupported operand
type(s) for @: 'int' and 'FakeTensor'", "'str' object has no attribute
'split'"), depending on the number of parameters.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["apply_function"]


class _NoBackward:
    """The context of a forward no backward follows: it keeps what forward stores on it and
    saves nothing for backward."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass


def apply_function(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``; with grad mode off, ``function.forward`` on a context no
    backward reads (the same result; see the module's docstring for why)."""
    if torch.is_grad_enabled():
        return function.apply(*args)
    return function.forward(_NoBackward(), *args)
