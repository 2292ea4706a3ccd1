"""Megatron DDP's delayed-wgrad hand-shake: hooks a layer fires after its ``backward_dw()``.

With ``ddp_config.delay_wgrad_compute=True``, Megatron's
``DistributedDataParallel`` does not hook autograd's gradient accumulator of a
weight marked ``skip_backward_post_hook``; it calls
``register_wgrad_accumulation_and_reduce_hooks(hook)`` on the module that owns
the weight, and the module calls the hook once its ``backward_dw()`` has
written the gradient (the hook adds ``.grad`` into ``main_grad`` unless
``grad_added_to_main_grad`` says it is there, clears ``.grad`` and, with
``overlap_grad_reduce``, marks the weight ready for its bucket's reduction).

A layer built with ``delay_wgrad_compute`` whose weights have ``main_grad``
(so a Megatron DDP owns them) but received no hook would lose its gradients
(or reduce them before they exist): :meth:`WgradHooks.check` raises instead,
before ``backward_dw()`` runs a GEMM, so a refused call writes nothing and
its job stays queued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from groupgrad.protocol import main_grad_or_none

__all__ = ["WgradHooks"]


class WgradHooks:
    """The wgrad accumulation-and-reduce hooks registered on one layer, fired after ``backward_dw()``."""

    def __init__(self) -> None:
        self._hooks: list[Callable[[], object]] = []

    def __len__(self) -> int:
        return len(self._hooks)

    def register(self, hook: Callable[[], object]) -> None:
        """Keep ``hook`` (Megatron DDP registers one per weight); it runs at every :meth:`fire`."""
        if not callable(hook):
            raise TypeError(f"hook is a {type(hook).__name__}, expected a callable")
        self._hooks.append(hook)

    def check(self, owner: str, weights: Sequence[Tensor]) -> None:
        """Refuse a ``backward_dw()`` whose hooks cannot deliver: called before its GEMMs run.

        Args:
            owner: How messages name the layer.
            weights: The layer's weight parameters (checked for a DDP without hooks).

        Raises:
            RuntimeError: No hook was registered although the weights have
                ``main_grad`` buffers (a Megatron DDP built without
                ``delay_wgrad_compute=True`` in its ``DistributedDataParallelConfig``);
                or more hooks than weights that still require grad (a weight frozen
                after the DDP registered its hook, which asserts ``requires_grad``, or
                the layer wrapped in DDP twice).
        """
        if not self._hooks and any(main_grad_or_none(w) is not None for w in weights):
            raise RuntimeError(
                f"{owner}.backward_dw(): the layer was built with delay_wgrad_compute=True and "
                "its weights have main_grad buffers, but no wgrad hook was registered, so the "
                "deferred gradients would never reach Megatron's gradient buffers; wrap the model "
                "in DistributedDataParallel with "
                "DistributedDataParallelConfig(delay_wgrad_compute=True)"
            )
        trainable = sum(bool(w.requires_grad) for w in weights)
        if len(self._hooks) <= trainable:
            return
        frozen = [i for i, w in enumerate(weights) if not w.requires_grad]
        if frozen:
            raise RuntimeError(
                f"{owner}.backward_dw(): {len(self._hooks)} wgrad hooks were registered but only "
                f"{trainable} weights require grad (weight {frozen[0]} among the frozen ones): a "
                "weight frozen after Megatron's DistributedDataParallel registered its hook, "
                "which asserts requires_grad. Freeze the experts before wrapping the model in "
                "DistributedDataParallel"
            )
        raise RuntimeError(
            f"{owner}.backward_dw(): {len(self._hooks)} wgrad hooks were registered for "
            f"{trainable} weights: the layer was wrapped in Megatron's DistributedDataParallel "
            "more than once (each wrap registers one hook per weight, and each hook adds the "
            "gradient into main_grad); wrap the model once"
        )

    def fire(self) -> None:
        """Run every hook, in registration order (after ``backward_dw()``'s GEMMs)."""
        for hook in self._hooks:
            hook()
