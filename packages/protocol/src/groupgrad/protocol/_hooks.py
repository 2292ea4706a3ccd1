"""Post-accumulate-grad hooks of parameters whose gradient lands later than autograd thinks.

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

from collections.abc import Callable, Iterable

import torch

__all__ = [
    "hold_post_accumulate_grad_hooks",
    "release_post_accumulate_grad_hooks",
    "run_post_accumulate_grad_hooks",
]

_HELD = "_groupgrad_held_hooks"  # [pending deferred gradients, the held hooks by handle id]


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
            held = [0, dict(live or {})]
            if live:
                live.clear()
            setattr(param, _HELD, held)
        held[0] += 1


def release_post_accumulate_grad_hooks(params: Iterable[torch.Tensor]) -> None:
    """Release one hold of each parameter; the last one gives its hooks back to autograd."""
    for param in params:
        held = param.__dict__.get(_HELD)
        if held is None:
            continue
        held[0] -= 1
        if held[0] == 0:
            delattr(param, _HELD)
            if held[1]:
                live = _live(param)
                if live is None:  # nothing registered since: re-register in order
                    for hook in held[1].values():
                        param.register_post_accumulate_grad_hook(hook)
                else:
                    restored = {**held[1], **live}
                    live.clear()
                    live.update(restored)


def run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Run the hooks ``param.register_post_accumulate_grad_hook`` registered, in order.

    Held hooks (:func:`hold_post_accumulate_grad_hooks`) run too: the deferred
    step calls this once the gradient has landed.
    """
    held = param.__dict__.get(_HELD)
    hooks = {**(held[1] if held is not None else {}), **(_live(param) or {})}
    for hook in hooks.values():
        hook(param)
