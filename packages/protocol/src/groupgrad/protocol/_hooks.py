"""Gradients that land later than autograd thinks: delivered and hooked as autograd would.

:func:`accumulate_grads_like_autograd` adds a gradient computed outside
autograd into ``.grad`` as AccumulateGrad would, then runs the hooks.

Autograd runs a parameter's post-accumulate-grad hooks when its
AccumulateGrad node runs, with a gradient or with ``None``. A deferred wgrad
(``delay_wgrad_compute``) lands in ``backward_dw()``, after that node ran: the
hooks would see a stale ``.grad`` (or a ``main_grad`` not yet written) and run
again once the gradient exists. So backward holds them back
(:func:`hold_post_accumulate_grad_hooks`: the parameter's hook dictionary,
which autograd reads, is emptied and kept aside) and the deferred step runs
them once the gradient has landed (:func:`run_post_accumulate_grad_hooks`),
then gives them back (:func:`release_post_accumulate_grad_hooks`) when no
deferred gradient of the parameter is pending any more. A hook registered
while they are held runs from autograd as usual; a hook removed while held
comes back when they are released.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from groupgrad.protocol._attrs import grad_dtype_of, own_dummy_grads
from groupgrad.protocol._distributed import WeightGroup, as_weight_list

__all__ = [
    "accumulate_grads_like_autograd",
    "hold_post_accumulate_grad_hooks",
    "release_post_accumulate_grad_hooks",
    "run_post_accumulate_grad_hooks",
]

_HELD = "_groupgrad_held_hooks"  # the parameter's _Held, while deferred gradients hold its hooks


class _Held:
    """A parameter's held hooks: how many pending deferred gradients hold them, and the hooks
    by handle id.

    Pickled as ``None``: ``torch.save`` of a module saves its parameters' attributes but not
    their hooks, and no deferred gradient is pending in the loaded copy, so the copy holds
    nothing (a held record loaded with it would keep the copy's own hooks running at backward,
    before a deferred gradient lands, and run the saved ones after it).
    """

    __slots__ = ("count", "hooks")

    def __init__(self, hooks: dict[int, Callable[[torch.Tensor], None]]) -> None:
        self.count = 0
        self.hooks = hooks

    def __reduce__(self) -> tuple[type[None], tuple[()]]:
        return (type(None), ())


def _live(param: torch.Tensor) -> dict[int, Callable[[torch.Tensor], None]] | None:
    """The dictionary autograd reads the parameter's post-accumulate-grad hooks from."""
    return getattr(param, "_post_accumulate_grad_hooks", None)


def hold_post_accumulate_grad_hooks(params: Iterable[torch.Tensor]) -> None:
    """Keep autograd from running each parameter's post-accumulate-grad hooks until released.

    Counted: each hold is for one deferred gradient, and the hooks return to
    autograd when every one of them has been released.
    """
    for param in params:
        held = param.__dict__.get(_HELD)
        if held is None:
            live = _live(param)
            held = _Held(dict(live or {}))
            if live:
                live.clear()
            setattr(param, _HELD, held)
        held.count += 1


def release_post_accumulate_grad_hooks(params: Iterable[torch.Tensor]) -> None:
    """Release one hold of each parameter; the last one gives its hooks back to autograd."""
    for param in params:
        held = param.__dict__.get(_HELD)
        if held is None:
            continue
        held.count -= 1
        if held.count == 0:
            delattr(param, _HELD)
            if held.hooks:
                live = _live(param)
                if live is None:  # nothing registered since: re-register in order
                    for hook in held.hooks.values():
                        param.register_post_accumulate_grad_hook(hook)
                else:
                    restored = {**held.hooks, **live}
                    live.clear()
                    live.update(restored)


def run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Run the hooks ``param.register_post_accumulate_grad_hook`` registered, in order.

    Held hooks (:func:`hold_post_accumulate_grad_hooks`) run too: the deferred
    step calls this once the gradient has landed.
    """
    held = param.__dict__.get(_HELD)
    hooks = {**(held.hooks if held is not None else {}), **(_live(param) or {})}
    for hook in hooks.values():
        hook(param)


def accumulate_grads_like_autograd(
    weights: WeightGroup,
    grads: Sequence[torch.Tensor | None],
    *,
    run_hooks: bool | Sequence[bool] = True,
) -> None:
    """Add deferred gradients into ``.grad`` as autograd's AccumulateGrad would have.

    For each parameter that requires grad: a non-``None`` gradient goes into
    ``.grad`` in the parameter's ``grad_dtype`` (the gradient itself,
    detached, no copy when it has that dtype, when ``.grad`` is ``None``; else
    added in place); then the parameter's post-accumulate-grad hooks run, as
    autograd runs them (it does so for a ``None`` gradient too), and one hold
    :func:`defer_weight_grads` put on them is released. Call it with
    all-``None`` gradients to run the hooks once a deferred GEMM has written
    ``main_grad``.

    Args:
        weights: The group's parameters.
        grads: One entry per parameter, e.g. :meth:`WeightGradPlan.finish`'s result.
        run_hooks: ``False`` where autograd's own AccumulateGrad runs the
            hooks afterwards (it does, for a ``None`` gradient too, when the
            backward that delivers them reaches the parameter), or a later
            deferred gradient of the same backward does; for all parameters
            or one flag per parameter.

    Raises:
        ValueError: ``grads`` does not have one entry per parameter.
        RuntimeError: A gradient's shape differs from its parameter's, or it
            lives on another device (autograd rejects both); nothing is
            accumulated then.

    A hook that raises stops the delivery, as in autograd; every hold of this
    call is released all the same, so the parameters' hooks still run from
    the next backward.
    """
    members = as_weight_list(weights)
    if len(grads) != len(members):
        raise ValueError(f"grads has {len(grads)} entries but the group has {len(members)} weights")
    flags = [run_hooks] * len(members) if isinstance(run_hooks, bool) else list(run_hooks)
    if len(flags) != len(members):
        raise ValueError(
            f"run_hooks has {len(flags)} entries but the group has {len(members)} weights"
        )
    for index, (param, grad) in enumerate(zip(members, grads, strict=True)):
        if grad is None or not param.requires_grad:
            continue
        if grad.shape != param.shape:
            raise RuntimeError(
                f"grads[{index}] has shape {tuple(grad.shape)}, expected the parameter's shape "
                f"{tuple(param.shape)}"
            )
        if grad.device != param.device:
            raise RuntimeError(
                f"grads[{index}] is on {grad.device}, expected the parameter's device {param.device}"
            )
    live = [
        (p, g, hooks) for p, g, hooks in zip(members, grads, flags, strict=True) if p.requires_grad
    ]
    own_dummy_grads(p for p, g, _ in live if g is not None)  # never add into a shared dummy
    released = 0
    try:
        with torch.no_grad():
            for param, grad, hooks in live:
                if grad is not None:
                    if param.grad is None:
                        param.grad = grad.detach().to(grad_dtype_of(param))
                    else:
                        param.grad.add_(grad)
                if hooks:
                    run_post_accumulate_grad_hooks(param)
                release_post_accumulate_grad_hooks([param])
                released += 1
    finally:
        release_post_accumulate_grad_hooks(param for param, _, _ in live[released:])
