"""The single-process replay of an FP8 Megatron-FSDP run: the same FP8 layers, unsharded.

The blockwise quantization is a deterministic function of the tensor it
reads, and Megatron-FSDP's all-gather restores each rank's full fp32 weights
bit for bit, so an unsharded FP8 model in one process multiplies exactly the
FP8 operands every rank multiplies; only the reduction over ranks (fp64 here)
and the SGD update differ in rounding. (The FP8 GEMMs themselves are checked
against an fp64 chain of the dequantized operands in the modules' tests.) The
replay quantizes its weights at every forward (no ``is_first_microbatch``),
so a rank that served FP8 weights cached before an optimizer step differs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from groupgrad.modules import GroupedLinear, GroupedMLP


class Net(nn.Module):
    """The worker's ``Net`` (same parameter names), FP8, fp32, gradients in ``.grad``."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        e, h, f = cfg["experts"], cfg["hidden"], cfg["ffn_hidden"]
        self.proj = GroupedLinear(e, h, h, bias=True, fp8_recipe="blockwise")
        self.mlp = GroupedMLP(e, h, f, single_grouped_weight=cfg["packed"], fp8_recipe="blockwise")

    def forward(self, x: Tensor, splits: list[int], probs: Tensor) -> Tensor:
        return self.mlp(torch.tanh(self.proj(x, splits)), splits, probs)


def expected_steps(
    ranks: list[dict[str, Any]],
) -> list[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """Full weights after each SGD step and that step's reduced gradient (fp64 sums)."""
    cfg = ranks[0]["config"]
    world, micro = len(ranks), cfg["micro_batches"]
    net = Net(cfg)
    weights = {n: t.clone() for n, t in ranks[0]["init"].items()}
    after = []
    for step in range(cfg["steps"]):
        net.load_state_dict({n: t.float() for n, t in weights.items()})
        grads = {n: torch.zeros_like(t) for n, t in weights.items()}
        for result in ranks:
            for m in range(micro):
                batch = result["data"][step * micro + m]
                net.zero_grad(set_to_none=True)
                (net(batch["x"], batch["splits"], batch["probs"]) * batch["dy"]).sum().backward()
                for n, param in net.named_parameters():
                    if param.grad is not None:
                        grads[n] += param.grad.double()
        reduced = {n: g / world for n, g in grads.items()}
        # the ranks update fp32 weights with the fp32 reduced gradient
        weights = {n: (t - cfg["lr"] * reduced[n]).float().double() for n, t in weights.items()}
        after.append((weights, reduced))
    return after
