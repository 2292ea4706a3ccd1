"""The MoE model the FSDP2 tests train, its data, and its plain-PyTorch reference.

Legend: ``T`` tokens, ``k`` experts per token, ``E`` experts, ``H`` hidden,
``F`` expert width.

:class:`MoEModel` is two :class:`MoEBlock` s (a router ``nn.Linear`` with bias
and groupgrad experts — a ``GroupedMLP``, or two ``GroupedLinear`` s around a
SwiGLU — per-expert or packed, with biases) and a dense ``nn.Linear`` head,
as a user would write it; ``cfg["fp8"]`` makes the experts FP8
(``fp8_recipe="blockwise"``). Which experts each token visits is data (the
``idx`` tensors), so every precision routes the same way; the router's
softmax probability of each visit scales it, so the router trains too.
With ``cfg["fp8"]`` the router and the head multiply in fp64 (rounded back
to their dtype): in fp32 their matmuls' last bit depends on where the weights
sit in memory (FSDP2's all-gather buffer on a rank, the model's own
parameters in the single-process replay; seen on an AVX-512 CPU), and the
FP8 quantizations downstream turn a one-ulp difference into a whole e4m3
step, which the replay oracle would report as a mismatch of groupgrad's.

:func:`reference_forward` computes the same function from a plain dict of
parameters with ``torch.nn.functional`` only (a loop over experts), in any
dtype: the independent oracle (fp64), and PyTorch's own bf16 computation of
the same thing for the bf16 rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from groupgrad.modules import GroupedLinear, GroupedMLP

SHAPE = {"hidden": 16, "ffn": 8, "experts": 4, "top_k": 2, "tokens": 32, "blocks": 2}


def _linear(layer: nn.Linear, x: Tensor, fp64: bool) -> Tensor:
    """``layer(x)``, or with ``fp64`` the same product in fp64 rounded to ``x``'s dtype."""
    if not fp64:
        return layer(x)
    return F.linear(x.double(), layer.weight.double(), layer.bias.double()).to(x.dtype)


class MoEBlock(nn.Module):
    """Router + groupgrad experts (SwiGLU × router probability) + residual."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        H, F_, E = cfg["hidden"], cfg["ffn"], cfg["experts"]
        options = {
            "bias": cfg["bias"],
            "single_grouped_weight": cfg["packed"],
            "fp8_recipe": "blockwise" if cfg.get("fp8") else None,
        }
        self.kind = cfg["module"]
        self.num_experts = E
        self.fp64_dense = bool(cfg.get("fp8"))  # see the module docstring
        self.router = nn.Linear(H, E)
        if self.kind == "mlp":
            self.experts = GroupedMLP(E, H, F_, **options)
        else:
            self.fc1 = GroupedLinear(E, H, 2 * F_, **options)
            self.fc2 = GroupedLinear(E, F_, H, **options)

    def forward(
        self, x_TH: Tensor, idx_Tk: Tensor, is_first_microbatch: bool | None = None
    ) -> Tensor:
        T, k = idx_Tk.shape
        cache = {} if is_first_microbatch is None else {"is_first_microbatch": is_first_microbatch}
        logits = _linear(self.router, x_TH, self.fp64_dense)
        probs_Tk = torch.softmax(logits.float(), dim=-1).gather(1, idx_Tk)
        flat = idx_Tk.reshape(-1)
        order = torch.argsort(flat, stable=True)
        splits = torch.bincount(flat, minlength=self.num_experts)
        rows = x_TH[order // k]
        p_S = probs_Tk.reshape(-1)[order]
        if self.kind == "mlp":
            y = self.experts(rows, splits, p_S, **cache)
        else:
            h = self.fc1(rows, splits, **cache)
            gate, up = h.float().chunk(2, dim=-1)
            y = self.fc2((F.silu(gate) * up * p_S[:, None]).to(h.dtype), splits, **cache)
        unsorted = torch.zeros_like(y).index_copy(0, order, y)
        return x_TH + unsorted.view(T, k, -1).float().sum(1).to(x_TH.dtype)


class MoEModel(nn.Module):
    """``blocks`` MoE blocks and a dense head."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg["blocks"]))
        self.head = nn.Linear(cfg["hidden"], cfg["hidden"])
        self.fp64_dense = bool(cfg.get("fp8"))  # see the module docstring

    def forward(self, x_TH: Tensor, idx: Tensor, is_first_microbatch: bool | None = None) -> Tensor:
        """``idx``: ``(blocks, T, k)`` expert ids; ``is_first_microbatch`` reaches the experts."""
        for block, idx_Tk in zip(self.blocks, idx.unbind(0), strict=True):
            x_TH = block(x_TH, idx_Tk, is_first_microbatch)
        return _linear(self.head, x_TH, self.fp64_dense)


def build(cfg: Mapping[str, Any], device: torch.device | str = "cpu") -> MoEModel:
    """The model with the scenario's seeded initial weights (the same on every rank), fp32."""
    torch.manual_seed(cfg["seed"])
    return MoEModel(cfg).to(device)


def batch(cfg: Mapping[str, Any], step: int, micro: int, rank: int) -> dict[str, Tensor]:
    """One rank's micro-batch: input ``x``, expert ids ``idx`` and the loss weights ``target``.

    Every token visits ``top_k`` distinct experts. With ``cfg["empty_expert"]``
    rank 1 sends no token to expert 2 in block 0 (a zero-token expert on one
    rank, the others use it).
    """
    gen = torch.Generator().manual_seed(hash((cfg["seed"], step, micro, rank)) % 2**31)
    T, E, k, H = cfg["tokens"], cfg["experts"], cfg["top_k"], cfg["hidden"]
    idx = torch.rand(cfg["blocks"], T, E, generator=gen).argsort(dim=-1)[..., :k]
    if cfg.get("empty_expert") and rank == 1:
        allowed = torch.tensor([e for e in range(E) if e != 2])
        idx[0] = allowed[torch.rand(T, E - 1, generator=gen).argsort(dim=-1)[:, :k]]
    return {
        "x": torch.randn(T, H, generator=gen),
        "idx": idx,
        "target": torch.randn(T, H, generator=gen),
    }


def loss_of(out: Tensor, target: Tensor) -> Tensor:
    """A linear loss: its output gradient is ``target`` exactly, in any precision."""
    return (out.float() * target.to(out.device)).sum()


def expert_param(params: Mapping[str, Tensor], layer: str, what: str, e: int) -> Tensor:
    """Expert ``e``'s weight or bias of ``layer`` (e.g. ``blocks.0.experts.fc1``), either layout."""
    per_expert = f"{layer}.{what}{e}"
    return params[per_expert] if per_expert in params else params[f"{layer}.{what}"][e]


def _reference_block(
    params: Mapping[str, Tensor], cfg: Mapping[str, Any], b: int, x: Tensor, idx: Tensor
) -> Tensor:
    prefix = f"blocks.{b}"
    math = torch.promote_types(x.dtype, torch.float32)
    logits = F.linear(x, params[f"{prefix}.router.weight"], params[f"{prefix}.router.bias"])
    probs = torch.softmax(logits.to(math), dim=-1).gather(1, idx)
    fc1 = f"{prefix}.experts.fc1" if cfg["module"] == "mlp" else f"{prefix}.fc1"
    fc2 = f"{prefix}.experts.fc2" if cfg["module"] == "mlp" else f"{prefix}.fc2"
    total = torch.zeros(x.shape, dtype=math)
    for e in range(cfg["experts"]):
        token, slot = torch.nonzero(idx == e, as_tuple=True)
        if token.numel() == 0:
            continue
        bias1 = expert_param(params, fc1, "bias", e) if cfg["bias"] else None
        bias2 = expert_param(params, fc2, "bias", e) if cfg["bias"] else None
        h = F.linear(x[token], expert_param(params, fc1, "weight", e), bias1)
        gate, up = h.to(math).chunk(2, dim=-1)
        a = (F.silu(gate) * up * probs[token, slot][:, None]).to(x.dtype)
        y = F.linear(a, expert_param(params, fc2, "weight", e), bias2)
        total = total.index_add(0, token, y.to(math))
    return x + total.to(x.dtype)


def reference_forward(
    params: Mapping[str, Tensor], cfg: Mapping[str, Any], x: Tensor, idx: Tensor
) -> Tensor:
    """The model's function with ``torch.nn.functional`` only, in ``x``'s dtype (params alike)."""
    for b in range(cfg["blocks"]):
        x = _reference_block(params, cfg, b, x, idx[b])
    return F.linear(x, params["head.weight"], params["head.bias"])
