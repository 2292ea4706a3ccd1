"""One rank of a Hugging Face Qwen3-MoE training run with groupgrad experts under FSDP2.

A ``groupgrad_testsupport`` worker script; the test imports it too, for
:func:`replay`.

The model is a tiny random-init ``Qwen3MoeForCausalLM`` built in code (no
download) with ``experts_implementation="groupgrad"``, sharded per decoder
layer and at the root with ``groupgrad.integrations.fsdp2.fully_shard``
(``MixedPrecisionPolicy(param_dtype=bf16 or None, reduce_dtype=fp32)``). Each
rank trains ``steps`` SGD steps of ``micro_batches`` micro-batches (all but
the last without gradient sync) on token ids of its own and returns the
logits, the reduced gradients (gathered whole), the weights after each step
and every reduce-scatter input per unit. :func:`replay` recomputes the same
in one process with transformers' own eager experts, in fp64 (the oracle) or
in bf16 with fp32 master weights (PyTorch's own bf16 computation).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import groupgrad.integrations.transformers  # noqa: F401  (registers "groupgrad")
from groupgrad.integrations.fsdp2 import fully_shard
from groupgrad_testsupport import Rank, load_sibling, run_worker

VOCAB = 64


reduce_scatter = load_sibling(
    Path(__file__).resolve().parents[1] / "integrations" / "fsdp2" / "tests" / "reduce_scatter.py",
    "reduce_scatter",
)  # the FSDP2 tests' recorder and buffer layout


def config(experts_implementation: str) -> Qwen3MoeConfig:
    """Two layers, 4 experts of width 16, top-2, hidden 32: every layer sparse."""
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        experts_implementation=experts_implementation,
    )


def build(seed: int, experts_implementation: str, device: torch.device | str = "cpu") -> nn.Module:
    """The seeded random-init model (the same weights on every rank and in the replay), fp32."""
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config(experts_implementation)).to(device)


def tokens(cfg: Mapping[str, Any], step: int, micro: int, rank: int) -> Tensor:
    """``(2, 16)`` token ids of one rank's micro-batch."""
    gen = torch.Generator().manual_seed(hash((cfg["seed"], step, micro, rank)) % 2**31)
    return torch.randint(0, VOCAB, (2, 16), generator=gen)


def _full(t: Tensor) -> Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def train(cfg: Mapping[str, Any], rank: int, device: torch.device) -> dict[str, Any]:
    """One scenario on this rank (the process group is initialised by the caller)."""
    model = build(cfg["seed"], "groupgrad", device)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cfg["bf16"] else None, reduce_dtype=torch.float32
    )
    log: list[dict[str, Any]] = []
    units = [f"model.layers.{i}" for i in range(len(model.model.layers))] + [""]
    for name in units:
        fully_shard(model.get_submodule(name), mp_policy=policy)
    reduce_scatter.record(model, units, log)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    result: dict[str, Any] = {"logits": [], "grads": [], "weights": []}
    for step in range(cfg["steps"]):
        for micro in range(cfg["micro_batches"]):
            model.set_requires_gradient_sync(micro == cfg["micro_batches"] - 1)
            ids = tokens(cfg, step, micro, rank).to(device)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            result["logits"].append(out.logits.detach().float().cpu())
        result["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result["weights"].append({n: _full(p) for n, p in model.named_parameters()})
    result["reduce_scatters"] = log
    result["unit_params"] = {name: reduce_scatter.unit_param_names(model, name) for name in units}
    return result


def replay(cfg: Mapping[str, Any], world: int, compute: torch.dtype) -> dict[str, Any]:
    """Every rank's steps in one process with transformers' eager experts.

    fp64: fp64 master weights and compute. bf16: fp32 master weights, a bf16
    copy computes each micro-batch (bf16 wgrads), gradients summed in fp64.
    The reduced gradient is the mean over ranks of the sum over micro-batches
    of each rank's loss gradient, as FSDP2 reduces it.
    """
    master_dtype = torch.float64 if compute == torch.float64 else torch.float32
    master = build(cfg["seed"], "eager").to(master_dtype)
    worker = build(cfg["seed"], "eager").to(compute)
    logits: dict[tuple[int, int, int], Tensor] = {}
    grads, weights = [], []
    for step in range(cfg["steps"]):
        total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in master.named_parameters()}
        for rank in range(world):
            worker.load_state_dict(master.state_dict())
            for micro in range(cfg["micro_batches"]):
                ids = tokens(cfg, step, micro, rank)
                worker.zero_grad(set_to_none=True)
                out = worker(input_ids=ids, labels=ids)
                out.loss.backward()
                logits[step, rank, micro] = out.logits.detach()
                for name, param in worker.named_parameters():
                    total[name] += param.grad.double()
        reduced = {name: value / world for name, value in total.items()}
        grads.append(reduced)
        with torch.no_grad():
            for name, param in master.named_parameters():
                param -= cfg["lr"] * reduced[name].to(master_dtype)
        weights.append({n: p.detach().clone() for n, p in master.named_parameters()})
    return {"logits": logits, "grads": grads, "weights": weights}


def run_scenario(scenario: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """One scenario on this rank (``run_worker`` has joined the process group)."""
    return train(scenario, rank.rank, rank.device)


if __name__ == "__main__":
    run_worker(run_scenario)
