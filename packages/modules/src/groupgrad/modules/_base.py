"""What ``GroupedLinear`` and ``GroupedMLP`` share: the deferred-wgrad queue and the repr."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

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
        self._in_fused_op = False  # a GroupedMLP's fc1 / fc2: its op queues their GEMMs

    def _forward_queue(self) -> WgradQueue | None:
        """Where a forward's backward queues its wgrads: the queue when delayed, else ``None``.

        Raises:
            RuntimeError: Delayed inside the forward of PyTorch's
                ``DistributedDataParallel`` that averages a weight of this layer.
        """
        if not self.delay_wgrad_compute:
            return None
        _refuse_delay_under_ddp(self)
        return self._wgrad_queue

    def _after_forward(self, out: Tensor) -> Tensor:
        """``out``. Delayed, with grad mode on and nothing of the forward requiring grad
        (every weight frozen, an input that needs none), no backward reaches the layer to
        queue a job: the ``backward_dw()`` after the step's backward runs nothing."""
        if self.delay_wgrad_compute and torch.is_grad_enabled() and not out.requires_grad:
            self._wgrad_queue.nothing_deferred()
        return out

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs that one backward deferred (oldest first).

        A no-op with ``delay_wgrad_compute=False`` and nothing queued (jobs queued
        before the option was switched off still run), and for a ``GroupedMLP``'s
        ``fc1`` / ``fc2`` with nothing queued (the MLP's op queues their GEMMs in
        the MLP's own queue, which its ``backward_dw()`` runs). With
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
        if len(self._wgrad_queue) or (self.delay_wgrad_compute and not self._in_fused_op):
            self._wgrad_queue.pop_and_run(type(self).__name__)

    def extra_repr(self) -> str:
        return ", ".join(f"{label}={getattr(self, name)!r}" for label, name in self._repr_fields)


def _refuse_delay_under_ddp(module: nn.Module) -> None:
    """Refuse ``delay_wgrad_compute`` where PyTorch's DDP averages the layer's weights: DDP
    reduces a gradient when autograd produces it, in backward; a delayed one lands later, in
    ``backward_dw()``, and no rank would ever see the others' (silently, each rank kept its
    own). Traced, every parameter of the DDP module counts as averaged."""
    ddp = DistributedDataParallel._active_ddp_module
    if ddp is None:
        return
    weights = [
        (name, p)
        for name, p in module.named_parameters()
        if p.requires_grad and "weight" in name.rsplit(".", 1)[-1]
    ]
    if not torch.compiler.is_compiling():
        averaged = getattr(ddp, "_module_parameters", None) or list(ddp.module.parameters())
        ids = {id(p) for p in averaged}
        weights = [(name, p) for name, p in weights if id(p) in ids]
    if weights:
        raise RuntimeError(
            f"{type(module).__name__} has delay_wgrad_compute=True inside "
            "torch.nn.parallel.DistributedDataParallel, which averages each gradient when "
            "autograd produces it, in backward; a delayed weight gradient lands later, in "
            f"backward_dw(), and would never be averaged over the ranks ({weights[0][0]!r} "
            "among others). Set delay_wgrad_compute=False under DDP, or list the layer's "
            "weights in DDP's parameters to ignore and reduce them yourself"
        )
