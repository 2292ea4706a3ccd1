"""Single-process references for ``test_training_loop.py``, computed from what the ranks saved.

Independent of the code under test: plain PyTorch autograd in fp64 on the
full weights (the DDP run), exact integer gradients fed to ``torch.optim`` on
full fp32 masters (the master-weights run), fp64 per-expert loops.

Legend: ``T`` tokens, ``E`` experts, ``N`` out_features, ``K`` in_features.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F


def wgrads(x_TK: Tensor, dy_TN: Tensor, splits: list[int]) -> Tensor:
    """``(E, N, K)``: every expert's weight gradient ``dy_e.T @ x_e``, in fp64."""
    xs, dys = x_TK.double().split(splits), dy_TN.double().split(splits)
    return torch.stack([dy.T @ x for x, dy in zip(xs, dys, strict=True)])


def mean_wgrads(ranks: list[dict[str, Any]], splits: list[int]) -> Tensor:
    """``(E, N, K)``: the ranks' mean weight gradient of one micro-batch each (``x``, ``dy``)."""
    return sum(wgrads(r["x"], r["dy"], splits) for r in ranks) / len(ranks)  # type: ignore[return-value]


def rows(full: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s rows of a full weight (or gradient), along dim -2."""
    count = full.shape[-2] // world
    return full.narrow(-2, rank * count, count)


def moe_steps(ranks: list[dict[str, Any]], cfg: dict[str, Any]) -> list[dict[str, Tensor]]:
    """The MoE trained under DDP, recomputed: fp64 SGD with momentum 0.9 on the full weights.

    Each step's gradient is that of the ranks' mean loss (DDP averages the
    router's gradient, the shard groups average the experts'), with each
    rank's own tokens and the experts its router chose (routing is discrete:
    taken from the run). Returns every parameter after every step.
    """
    params = {n: t.double().requires_grad_(True) for n, t in ranks[0]["init"].items()}
    optimizer = torch.optim.SGD(params.values(), lr=cfg["lr"], momentum=0.9)
    after = []
    for step in range(cfg["steps"]):
        losses = []
        for result in ranks:
            record = result["steps"][step]
            x_TH, expert_T = record["x"].double(), record["expert"]
            probs_TE = (x_TH @ params["router.weight"].T + params["router.bias"]).softmax(-1)
            probs_T = probs_TE.gather(1, expert_T[:, None])[:, 0]
            y_TH = torch.zeros_like(x_TH)
            for e in range(cfg["experts"]):
                rows_e = (expert_T == e).nonzero()[:, 0]
                h = x_TH[rows_e] @ params[f"experts.fc1.weight{e}"].T
                act = F.silu(h[:, : cfg["ffn"]]) * h[:, cfg["ffn"] :] * probs_T[rows_e, None]
                y_TH = y_TH.index_copy(0, rows_e, act @ params[f"experts.fc2.weight{e}"].T)
            losses.append(y_TH.square().mean())
        optimizer.zero_grad()
        torch.stack(losses).mean().backward()
        optimizer.step()
        after.append({n: p.detach().clone() for n, p in params.items()})
    return after


def adamw_masters(ranks: list[dict[str, Any]], cfg: dict[str, Any]) -> list[Tensor]:
    """``torch.optim.AdamW`` on full fp32 masters fed the exact mean gradient.

    The runs use small-integer bf16 data, so every wgrad (and its mean over
    2 ranks) is exact in fp32: the reference gradient is asserted exact.

    Returns:
        After each step, the masters stacked: ``(E, N, K)`` per-expert, or
        ``(1, E, N, K)`` packed.
    """
    init = ranks[0]["init"]
    names = ["weight"] if cfg["packed"] else [f"weight{e}" for e in range(cfg["experts"])]
    masters = [init[n].float().requires_grad_(True) for n in names]
    optimizer = torch.optim.AdamW(masters, lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    after = []
    for step in range(cfg["steps"]):
        grad_ENK = torch.zeros(cfg["experts"], *masters[0].shape[-2:], dtype=torch.float64)
        for micro in range(cfg["micro_batches"]):
            grad_ENK += mean_wgrads(
                [r["steps"][step]["micro"][micro] for r in ranks], cfg["splits"]
            )
        if not torch.equal(grad_ENK.float().double(), grad_ENK):
            raise AssertionError("the reference gradient is not exact in fp32; pick other data")
        grads = [grad_ENK] if cfg["packed"] else list(grad_ENK.unbind(0))
        for master, grad in zip(masters, grads, strict=True):
            master.grad = grad.float()
        optimizer.step()
        after.append(torch.stack([m.detach().clone() for m in masters]))
    return after
