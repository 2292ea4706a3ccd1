"""What ``GroupedLinear`` and ``GroupedMLP`` share: the deferred-wgrad queue and the repr."""

from __future__ import annotations

from torch import nn

from groupgrad.modules._wgrad_queue import WgradQueue

__all__ = ["FLAG_REPR_FIELDS", "GroupedModule"]

# The repr's tail both grouped layers show: their bias and wgrad flags, in this order.
FLAG_REPR_FIELDS: tuple[tuple[str, str], ...] = (
    ("bias", "use_bias"),
    ("single_grouped_weight", "single_grouped_weight"),
    ("accumulate_into_main_grad", "accumulate_into_main_grad"),
    ("delay_wgrad_compute", "delay_wgrad_compute"),
)


class GroupedModule(nn.Module):
    """Base of the grouped layers: their common options, :meth:`backward_dw` and the repr.

    Subclasses list what their repr shows in ``_repr_fields``, as
    ``(label, attribute)`` pairs (their sizes, then ``FLAG_REPR_FIELDS``).
    """

    _repr_fields: tuple[tuple[str, str], ...] = ()

    def __init__(
        self, num_groups: int, bias: bool, single_grouped_weight: bool, delay_wgrad_compute: bool
    ) -> None:
        super().__init__()
        self.num_groups = num_groups
        self.use_bias = bias
        self.single_grouped_weight = single_grouped_weight
        self.delay_wgrad_compute = delay_wgrad_compute
        self._wgrad_queue = WgradQueue()

    def _forward_queue(self) -> WgradQueue | None:
        """Where a forward's backward queues its wgrads: the queue when delayed, else ``None``."""
        return self._wgrad_queue if self.delay_wgrad_compute else None

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs that one backward deferred (oldest first).

        A no-op with ``delay_wgrad_compute=False`` and nothing queued (jobs queued
        before the option was switched off still run). With
        ``main_grad`` each GEMM writes it now (the flag and dummy went to
        autograd at backward); without, the gradient is added into ``.grad``
        as autograd would have; a distributed group is finalized now, right
        after its gradient exists. What the GEMMs read (the layer inputs and
        output gradients kept since backward) is checked first: one modified
        in place since backward raises and nothing is written.

        Raises:
            RuntimeError: No backward has queued a weight gradient, an input
                it reads was modified in place since backward, or a parameter
                was frozen or unfrozen since.
        """
        if self.delay_wgrad_compute or len(self._wgrad_queue):
            self._wgrad_queue.pop_and_run(type(self).__name__)

    def extra_repr(self) -> str:
        return ", ".join(f"{label}={getattr(self, name)!r}" for label, name in self._repr_fields)
