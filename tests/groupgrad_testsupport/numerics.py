"""Numerical checks shared by the suites: float64 comparisons, DESIGN's rule for low precision, NaN poison.

DESIGN ("Testing and measuring"): compare against an fp64 reference computed
from the same inputs; a low-precision (bf16) result may err at most twice as
much as PyTorch's own computation of the same thing in that precision, plus a
small atol; NaN never passes; outputs are poisoned with NaN before a kernel
writes them, so an unwritten element shows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


def max_abs_error(actual: Tensor, expected: Tensor) -> float:
    """``max |actual - expected|`` in float64 (0.0 for empty tensors; NaN if either has NaN)."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0
    return float((actual.detach().double() - expected.detach().double()).abs().max())


def _prefixed(what: str) -> Callable[[str], str]:
    return lambda message: f"{what}: {message}"


def assert_close(
    actual: Tensor, expected: Tensor, *, rtol: float, atol: float, what: str = ""
) -> None:
    """``torch.testing.assert_close`` in float64 (so dtypes may differ), with ``what`` in the message.

    NaN never passes (not even against NaN).
    """
    torch.testing.assert_close(
        actual.detach().double(),
        expected.detach().double(),
        rtol=rtol,
        atol=atol,
        msg=_prefixed(what) if what else None,
    )


def assert_as_close_as_torch(
    ours: Tensor,
    exact: Tensor,
    torch_own: Tensor,
    *,
    atol: float,
    rtol: float = 0.0,
    factor: float = 2.0,
    what: str = "",
) -> None:
    """DESIGN's rule: ``ours`` errs at most ``factor`` × PyTorch's own error, plus a tolerance.

    With ``err(t) = max |t - exact|`` (float64), passes when
    ``err(ours) <= factor * err(torch_own) + atol + rtol * max |exact|``.
    A non-finite value in ``ours`` never passes (an unwritten, NaN-poisoned
    element shows here).

    Args:
        ours: The result under test (any dtype).
        exact: The float64 (or float32) reference from the same inputs.
        torch_own: PyTorch's own computation of the same thing in the same
            low precision (e.g. bf16 matmuls on the same bf16 inputs).
        atol: Absolute slack.
        rtol: Slack relative to the largest ``|exact|``.
        factor: How many times PyTorch's error ``ours`` may have.
        what: Names the checked value in the failure message.
    """
    label = f"{what}: " if what else ""
    if ours.shape != exact.shape or torch_own.shape != exact.shape:
        raise AssertionError(
            f"{label}shapes differ: ours {tuple(ours.shape)}, torch {tuple(torch_own.shape)}, "
            f"reference {tuple(exact.shape)}"
        )
    if ours.numel() == 0:
        return
    finite = torch.isfinite(ours.detach())
    if not finite.all():
        first = tuple(int(i) for i in (~finite).nonzero()[0])
        raise AssertionError(
            f"{label}{int((~finite).sum())} non-finite values, first at {first} "
            f"(an element never written?)"
        )
    error = max_abs_error(ours, exact)
    torch_error = max_abs_error(torch_own, exact)
    bound = factor * torch_error + atol + rtol * float(exact.detach().double().abs().max())
    assert error <= bound, (
        f"{label}max error {error:.3g} > {factor:g} × PyTorch's {torch_error:.3g} "
        f"+ slack {bound - factor * torch_error:.3g}"
    )


def assert_within_scale(
    actual: Tensor, expected: Tensor, *, rel: float, atol: float, what: str = ""
) -> None:
    """``max |actual - expected| <= rel * max |expected| + atol`` in float64; NaN never passes.

    For results whose PyTorch twin is not at hand (a whole module's bf16 run
    against its fp64 reference): the error is bounded relative to the
    result's scale rather than element by element.
    """
    label = f"{what}: " if what else ""
    assert not actual.isnan().any(), f"{label}has NaN (an element never written?)"
    scale = float(expected.detach().double().abs().max()) if expected.numel() else 0.0
    error = max_abs_error(actual, expected)
    assert error <= rel * scale + atol, (
        f"{label}max error {error:.3e} > {rel:g} × scale {scale:.3e} + {atol:g}"
    )


def assert_compiled_matches_eager(
    step: Callable[..., Tensor], inputs: Sequence[Tensor], module: nn.Module
) -> None:
    """``torch.compile(step, fullgraph=True)`` gives eager's loss and gradients, exactly.

    ``step(*inputs)`` returns a scalar loss; the loss, every input's ``.grad``
    and every parameter's ``.grad`` of ``module`` are compared with
    ``torch.testing.assert_close`` at its default (dtype-based) tolerances.
    The compiled run uses the ``aot_eager`` backend (traced forward and
    backward graphs, no code generation), after ``torch._dynamo.reset()``.
    """
    params = list(module.parameters())

    def run(fn: Callable[..., Tensor]) -> list[Tensor]:
        for tensor in (*inputs, *params):
            tensor.grad = None
        loss = fn(*inputs)
        loss.backward()
        grads = [t.grad for t in (*inputs, *params)]
        missing = [i for i, g in enumerate(grads) if g is None]
        assert not missing, f"no gradient reached inputs/parameters {missing}"
        return [loss.detach(), *(g.clone() for g in grads if g is not None)]

    torch._dynamo.reset()
    got = run(torch.compile(step, backend="aot_eager", fullgraph=True))
    want = run(step)
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        what = f"compiled vs eager, value {index} (loss, input grads, parameter grads)"
        torch.testing.assert_close(a, b, msg=_prefixed(what))


def poisoned(
    shape: tuple[int, ...] | list[int] | torch.Size,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """A NaN-filled tensor to hand a kernel as its output, so an unwritten element shows."""
    if not dtype.is_floating_point:
        raise TypeError(f"cannot poison a {dtype} tensor with NaN")
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


def poison_(tensor: Tensor) -> Tensor:
    """Fill ``tensor`` with NaN in place (a buffer a kernel should overwrite); returns it."""
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"cannot poison a {tensor.dtype} tensor with NaN")
    with torch.no_grad():
        return tensor.fill_(float("nan"))
