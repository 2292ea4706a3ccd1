"""Recompute in fp64, in one process, what the ``sharded_worker.py`` ranks returned.

Legend: ``T`` tokens, ``E`` experts, ``N`` out_features, ``K`` in_features,
``H`` hidden, ``F`` ffn_hidden, ``W`` world size.

The reference trains the same model in one process, with plain PyTorch
autograd on the full fp64 weights: for every micro-batch, each rank's own data
gives that rank's output and input gradients; the ranks' weight gradients are
summed (``"sum"``) or averaged (``"mean"``), then accumulated over the
step's micro-batches (``"accumulate"``) or taken alone (``"overwrite"``); after
each step, SGD ``w -= lr * main_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F


def expert_weights(weights: dict[str, Tensor], prefix: str, cfg: dict[str, Any]) -> list[Tensor]:
    """One ``(N, K)`` weight per expert, from per-expert or packed parameters."""
    if cfg["packed"]:
        return list(weights[f"{prefix}weight"].unbind(0))
    return [weights[f"{prefix}weight{e}"] for e in range(cfg["experts"])]


def forward(
    cfg: dict[str, Any],
    weights: dict[str, Tensor],
    x_TK: Tensor,
    splits: list[int],
    probs_T: Tensor | None,
) -> Tensor:
    """The model on full weights with plain PyTorch ops (any dtype)."""
    chunks = x_TK.split(splits)
    if cfg["module"] == "linear":
        ws = expert_weights(weights, "", cfg)
        return torch.cat([x @ w.T for x, w in zip(chunks, ws, strict=True)])
    assert probs_T is not None
    ffn = cfg["ffn_hidden"]
    w1s, w2s = expert_weights(weights, "fc1.", cfg), expert_weights(weights, "fc2.", cfg)
    outs = []
    for x, p, w1, w2 in zip(chunks, probs_T.split(splits), w1s, w2s, strict=True):
        h = x @ w1.T
        outs.append((F.silu(h[:, :ffn]) * h[:, ffn:] * p[:, None]) @ w2.T)
    return torch.cat(outs)


@dataclass
class MicroReference:
    """fp64 reference of one rank's micro-batch."""

    y: Tensor
    dx: Tensor
    dprobs: Tensor | None
    wgrads: dict[str, Tensor]  # this rank's full, unreduced weight gradients


def reference_micro(
    cfg: dict[str, Any], weights: dict[str, Tensor], record: dict
) -> MicroReference:
    leaves = {n: w.detach().clone().requires_grad_(True) for n, w in weights.items()}
    x = record["x"].double().requires_grad_(True)
    probs = None if record["probs"] is None else record["probs"].double().requires_grad_(True)
    y = forward(cfg, leaves, x, record["splits"], probs)
    y.backward(record["dy"].double())
    assert x.grad is not None
    wgrads = {n: torch.zeros_like(w) if w.grad is None else w.grad for n, w in leaves.items()}
    return MicroReference(y.detach(), x.grad, None if probs is None else probs.grad, wgrads)


@dataclass
class Reference:
    """The whole run recomputed in fp64 from the ranks' saved inputs.

    Attributes:
        micro: ``micro[rank][i]`` for the i-th micro-batch (all steps in order).
        reduced: ``reduced[i]``: the ranks' gradients of micro-batch ``i``,
            summed or averaged as the scenario says (full shapes).
        main_grads: ``main_grads[i]``: what the full ``main_grad`` should hold
            right after micro-batch ``i``.
        after_step: Full weights after each SGD step.
        bf16_reduced: Like ``main_grads``, but as a bf16 reduce-scatter would
            have left them (each rank's gradient rounded to bf16, the
            reduction's result rounded to bf16), for the precision test.
    """

    micro: list[list[MicroReference]] = field(default_factory=list)
    reduced: list[dict[str, Tensor]] = field(default_factory=list)
    main_grads: list[dict[str, Tensor]] = field(default_factory=list)
    after_step: list[dict[str, Tensor]] = field(default_factory=list)
    bf16_reduced: list[dict[str, Tensor]] = field(default_factory=list)


def build_reference(ranks: list[dict[str, Any]]) -> Reference:
    cfg = ranks[0]["config"]
    world = len(ranks)
    weights = {n: w.double() for n, w in ranks[0]["init"].items()}
    ref = Reference(micro=[[] for _ in ranks])
    per_step = cfg["micro_batches"]
    for index in range(cfg["steps"] * per_step):
        if index % per_step == 0:
            running = {n: torch.zeros_like(w) for n, w in weights.items()}
            running_bf16 = {n: torch.zeros_like(w) for n, w in weights.items()}
        micros = [reference_micro(cfg, weights, rank["micro"][index]) for rank in ranks]
        for rank, micro in enumerate(micros):
            ref.micro[rank].append(micro)
        scale = 1.0 / world if cfg["reduction"] == "mean" else 1.0
        reduced = {n: scale * torch.stack([m.wgrads[n] for m in micros]).sum(0) for n in weights}
        as_bf16 = {  # each rank's gradient rounded to bf16, and the reduction's result too
            n: (scale * torch.stack([m.wgrads[n].bfloat16().double() for m in micros]).sum(0))
            .bfloat16()
            .double()
            for n in weights
        }
        overwrite = cfg["mode"] == "overwrite"
        running = reduced if overwrite else {n: running[n] + reduced[n] for n in weights}
        running_bf16 = as_bf16 if overwrite else {n: running_bf16[n] + as_bf16[n] for n in weights}
        ref.reduced.append(reduced)
        ref.main_grads.append(running)
        ref.bf16_reduced.append(running_bf16)
        if index % per_step == per_step - 1:
            weights = {n: weights[n] - cfg["lr"] * running[n] for n in weights}
            ref.after_step.append(weights)
    return ref


def rows_of(full: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s rows of a full weight (or gradient), along dim -2."""
    rows = full.shape[-2] // world
    return full.narrow(-2, rank * rows, rows)
