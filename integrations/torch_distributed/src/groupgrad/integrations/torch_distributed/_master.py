"""fp32 master weights for parameters whose gradients land in ``main_grad``, for ``torch.optim``.

A bf16 shard cannot take its fp32 ``main_grad`` as ``.grad`` (autograd and
``torch.optim`` want a gradient of the parameter's dtype), and stepping the
bf16 shard itself loses small updates to rounding. The standard recipe keeps
an fp32 copy of every shard (the *master* weight), lets a plain
``torch.optim`` optimizer step the masters with ``main_grad`` as their
``.grad``, and copies the result back into the bf16 shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from groupgrad.protocol import main_grad_or_none, takes_grad_added_flag

__all__ = ["MasterWeights"]


class MasterWeights:
    """fp32 master copies of parameters that receive their gradient in ``main_grad``.

    ``parameters()`` are fresh fp32 ``nn.Parameter`` copies of the model
    parameters (e.g. :func:`named_sharded_parameters`'s, bf16 shards); give
    them to any ``torch.optim`` optimizer, alongside plain parameters (a
    DDP-reduced router) if you like. Each step::

        masters.step(optimizer)  # masters' .grad = main_grad; step; copy back; zero main_grad

    or the same in pieces: :meth:`grads_from_main_grad`, ``optimizer.step()``,
    :meth:`copy_to_model`, :meth:`zero_main_grad` (clip with :meth:`clip_grad_norm_`
    between the first two: the norm over every rank's shards).

    Only the parameters given here are touched; the optimizer's other
    parameters keep their own ``.grad``. Checkpoints: the model's state holds
    the rounded (bf16) shards, not the fp32 masters; save :meth:`state_dict`
    with the optimizer's state, per rank, and resume with
    :meth:`load_state_dict` (bit for bit). :meth:`copy_from_model` restarts
    the masters from the model's values instead (e.g. after loading a
    checkpoint that has no masters), losing what rounding dropped.

    Args:
        params: The model parameters, each with a ``main_grad`` of its shape
            (any of ``groupgrad.protocol.MAIN_GRAD_DTYPES``).
        dtype: The masters' dtype (fp32 by default).

    Raises:
        TypeError: ``params`` holds something that is not a floating-point tensor.
        ValueError: ``params`` is empty or has a parameter twice; a parameter
            has no ``main_grad`` or one of another shape; ``dtype`` is not
            floating point.
    """

    def __init__(self, params: Iterable[Tensor], *, dtype: torch.dtype = torch.float32) -> None:
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype is {dtype}, expected a floating-point torch.dtype")
        if isinstance(params, Tensor):
            raise TypeError(
                "params is a single tensor, expected an iterable of parameters (e.g. "
                "[p for _, p in named_sharded_parameters(model)])"
            )
        self.model_params: list[Tensor] = list(params)
        if not self.model_params:
            raise ValueError("params is empty; expected at least one parameter with a main_grad")
        seen: set[int] = set()
        for index, param in enumerate(self.model_params):
            if not isinstance(param, Tensor) or not param.is_floating_point():
                what = param.dtype if isinstance(param, Tensor) else type(param).__name__
                raise TypeError(f"params[{index}] is a {what}, expected a floating-point tensor")
            if id(param) in seen:
                raise ValueError(f"params[{index}] appears twice; give each parameter once")
            seen.add(id(param))
            main_grad = main_grad_or_none(param)
            if main_grad is None:
                raise ValueError(
                    f"params[{index}] (shape {tuple(param.shape)}) has no main_grad; MasterWeights "
                    "is for parameters whose gradient lands in main_grad (e.g. "
                    "named_sharded_parameters(model)); give plain parameters to the optimizer "
                    "directly"
                )
            if main_grad.shape != param.shape:
                raise ValueError(
                    f"params[{index}].main_grad has shape {tuple(main_grad.shape)}, expected the "
                    f"parameter's shape {tuple(param.shape)}"
                )
        self.dtype = dtype
        self.master_params: list[nn.Parameter] = [
            nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=p.requires_grad)
            for p in self.model_params
        ]

    def parameters(self) -> list[nn.Parameter]:
        """The master weights (same order and shapes as the model parameters), for the optimizer."""
        return list(self.master_params)

    @torch.no_grad()
    def grads_from_main_grad(self) -> None:
        """Set each trainable master's ``.grad`` to its model parameter's ``main_grad``.

        The ``main_grad`` itself when it has the masters' dtype (no copy; an
        alias until :meth:`zero_main_grad`), else a converted copy. Frozen
        parameters' masters get ``None``.
        """
        for param, master in zip(self.model_params, self.master_params, strict=True):
            main_grad = main_grad_or_none(param)
            if not param.requires_grad or main_grad is None:
                master.grad = None
                continue
            master.grad = main_grad if main_grad.dtype == self.dtype else main_grad.to(self.dtype)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Copy every master into its model parameter (rounded to the parameter's dtype)."""
        for param, master in zip(self.model_params, self.master_params, strict=True):
            param.copy_(master)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Refresh every master from its model parameter (e.g. after loading a checkpoint)."""
        for param, master in zip(self.model_params, self.master_params, strict=True):
            master.copy_(param)

    def state_dict(self) -> dict[str, Any]:
        """This rank's masters (the tensors themselves) and the rank that holds them, for
        ``torch.save`` beside the optimizer's state: one file per rank, since each rank's
        masters are its own shards. Not for ``torch.distributed.checkpoint``, which takes
        plain tensors as the same on every rank and keeps one rank's."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {"rank": rank, "masters": [master.detach() for master in self.master_params]}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy the masters of :meth:`state_dict` back (the model is not touched).

        Raises:
            ValueError: ``state`` is not such a dict; it holds another number of
                masters, or one of another shape; it was saved by another rank.
                Nothing is copied then.
        """
        if not isinstance(state, Mapping) or set(state) != {"rank", "masters"}:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"state has {keys}, expected MasterWeights.state_dict()'s 'masters' and 'rank'"
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        if state["rank"] != rank:
            raise ValueError(
                f"state holds rank {state['rank']}'s masters, this is rank {rank}: each rank "
                "loads the file it saved (the masters are its own shards)"
            )
        saved = list(state["masters"])
        if len(saved) != len(self.master_params):
            raise ValueError(
                f"state holds {len(saved)} masters, expected {len(self.master_params)}"
            )
        for index, (value, master) in enumerate(zip(saved, self.master_params, strict=True)):
            if not isinstance(value, Tensor) or value.shape != master.shape:
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"state's masters[{index}] has shape {got}, expected {tuple(master.shape)}"
                )
        for value, master in zip(saved, self.master_params, strict=True):
            master.copy_(value)

    @torch.no_grad()
    def zero_main_grad(self) -> None:
        """Zero every model parameter's ``main_grad``, reset its flag, and drop the masters' ``.grad``."""
        for param, master in zip(self.model_params, self.master_params, strict=True):
            main_grad = main_grad_or_none(param)
            if main_grad is not None:
                main_grad.zero_()
            if takes_grad_added_flag(param):
                param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            master.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, *, others: Iterable[Tensor] = ()) -> Tensor:
        """Scale the gradients so that their 2-norm over the whole model is at most ``max_norm``.

        ``torch.nn.utils.clip_grad_norm_(parameters(), ...)`` would measure this rank's
        shards only, and each rank would clip by another, smaller norm. Here a master of
        a row shard (a member of a sharded layer whose leader is among the masters) adds
        the squares of its ``.grad`` summed over the ranks of its shard group (one
        ``all_reduce`` per group: a collective, every rank of it calls this); any other
        master and ``others`` (parameters every rank holds whole, e.g. a DDP-averaged
        router) count once. Call it after :meth:`grads_from_main_grad`; a master without
        ``.grad`` counts nothing. Every ``.grad`` is then scaled by
        ``min(1, max_norm / (norm + 1e-6))``, as PyTorch's ``clip_grad_norm_`` does.

        Returns:
            The total norm, an fp32 scalar tensor.
        """
        groups: dict[int, Any] = {}  # member id -> its shard group's process group
        for param in self.model_params:
            shard_group = getattr(param, "shard_group", None)
            for member in getattr(shard_group, "members", ()):
                groups[id(member)] = shard_group.process_group  # type: ignore[union-attr]
        sums: dict[int, tuple[Any, Tensor]] = {}  # id(process group) -> (group, sum of squares)
        local = torch.zeros((), dtype=torch.float32, device=self.master_params[0].device)
        for param, master in zip(self.model_params, self.master_params, strict=True):
            if master.grad is None:
                continue
            square = master.grad.float().square().sum()
            if id(param) not in groups:
                local += square
                continue
            group = groups[id(param)]
            _, total = sums.setdefault(id(group), (group, torch.zeros_like(local)))
            total += square
        for group, total in sums.values():  # the same groups, in the same order, on every rank
            dist.all_reduce(total, group=group)
            local += total
        whole = [t for t in others if t.grad is not None]
        for t in whole:
            local += t.grad.float().square().sum()  # type: ignore[union-attr]
        norm = local.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for t in [*(m for m in self.master_params if m.grad is not None), *whole]:
            t.grad.mul_(scale.to(t.grad.dtype))  # type: ignore[union-attr]
        return norm

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step on the masters from ``main_grad``, then back into the model.

        :meth:`grads_from_main_grad`, ``optimizer.step()``, :meth:`copy_to_model`,
        :meth:`zero_main_grad`. ``optimizer`` may hold other parameters too
        (their ``.grad`` is theirs to zero).
        """
        self.grads_from_main_grad()
        optimizer.step()
        self.copy_to_model()
        self.zero_main_grad()
