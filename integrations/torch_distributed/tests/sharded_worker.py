"""One rank of a sharded-training run; the parent test compares what it returns to a reference.

Launched by ``test_sharded_training.py`` through ``groupgrad_testsupport.launch``
(one process per rank). For each scenario it builds the module from the
scenario's seed (the same full weights on every rank), shards it, trains
``steps`` optimizer steps of ``micro_batches`` micro-batches each on data of
its own (seeded by rank, step and micro-batch), and returns: the initial full
weights, every micro-batch's inputs, outputs, input gradients, ``main_grad``
shards, flags and the collectives it ran (name, dtype, numel, op), and the
gathered full weights after every step. The scenario named ``"errors"``
checks the errors that need a real multi-rank group instead. Any failure
exits non-zero with a traceback, which fails the parent test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from groupgrad.integrations.torch_distributed import (
    ShardedExpertWeight,
    gather_full_weights,
    shard_expert_weights,
)
from groupgrad.modules import GroupedLinear, GroupedMLP
from groupgrad.protocol import DistributedWeight
from groupgrad_testsupport import Rank, poison_, run_worker

COLLECTIVES = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
}


def record_collectives(log: list[dict[str, Any]]) -> None:
    """Wrap torch.distributed's single-tensor collectives to log what each call saw."""

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(output: Tensor, input: Tensor, *args: Any, **kwargs: Any) -> Any:
            log.append(
                {
                    "kind": COLLECTIVES[name],
                    "input_dtype": str(input.dtype),
                    "output_dtype": str(output.dtype),
                    "input_numel": input.numel(),
                    "op": str(kwargs.get("op", args[0] if args else None)),
                }
            )
            return original(output, input, *args, **kwargs)

        return recorded

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, wrap(name, original))


def build_module(cfg: dict[str, Any], device: torch.device) -> nn.Module:
    dtype = getattr(torch, cfg["dtype"])
    torch.manual_seed(cfg["seed"])  # the same full weights on every rank
    common = {
        "dtype": dtype,
        "device": device,
        "single_grouped_weight": cfg["packed"],
        "accumulate_into_main_grad": True,  # a distributed group takes its own route anyway
        "delay_wgrad_compute": cfg["delay"],
        "bias": False,
    }
    if cfg["module"] == "linear":
        return GroupedLinear(cfg["experts"], cfg["in_features"], cfg["out_features"], **common)
    return GroupedMLP(cfg["experts"], cfg["hidden"], cfg["ffn_hidden"], **common)


def make_splits(gen: torch.Generator, tokens: int, experts: int, force_empty: bool) -> list[int]:
    cuts = torch.randint(0, tokens + 1, (experts - 1,), generator=gen).sort().values.tolist()
    splits = [b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True)]
    if force_empty:  # expert 1 gets no token: its wgrad on this rank must be exactly zero
        splits[0] += splits[1]
        splits[1] = 0
    return splits


def cpu(tensor: Tensor | None) -> Tensor | None:
    return None if tensor is None else tensor.detach().cpu().clone()


def run_scenario(
    cfg: dict[str, Any], rank: int, world: int, device: torch.device, log: list[dict[str, Any]]
) -> dict:
    dtype = getattr(torch, cfg["dtype"])
    module = build_module(cfg, device)
    init = {name: cpu(p) for name, p in module.named_parameters()}
    groups = shard_expert_weights(
        module, grad_reduction=cfg["reduction"], leader_only=cfg["leader_only"]
    )
    params = dict(module.named_parameters())
    overwrite = cfg["mode"] == "overwrite"
    for param in params.values():
        param.overwrite_main_grad = overwrite  # type: ignore[attr-defined]
        param.zero_out_wgrad = cfg["zero_out"]  # type: ignore[attr-defined]
    is_mlp = cfg["module"] == "mlp"
    width_in = cfg["hidden"] if is_mlp else cfg["in_features"]
    width_out = cfg["hidden"] if is_mlp else cfg["out_features"]

    micro_results, after_step = [], []
    for step in range(cfg["steps"]):
        for micro in range(cfg["micro_batches"]):
            gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank * 100 + step * 10 + micro)
            splits = make_splits(gen, cfg["tokens"], cfg["experts"], rank == 1 and micro == 0)
            x = torch.randn(cfg["tokens"], width_in, generator=gen).to(device, dtype)
            dy = torch.randn(cfg["tokens"], width_out, generator=gen).to(device, dtype)
            probs = torch.rand(cfg["tokens"], generator=gen).to(device) if is_mlp else None
            x.requires_grad_(True)
            if probs is not None:
                probs.requires_grad_(True)
            for param in params.values():
                param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
                if overwrite:  # overwriting must never read the old contents
                    poison_(param.main_grad)  # type: ignore[attr-defined]
            first_call = len(log)

            y = module(x, splits, probs) if is_mlp else module(x, splits)
            y.backward(dy)
            if cfg["delay"]:
                module.backward_dw()  # type: ignore[operator]

            micro_results.append(
                {
                    "step": step,
                    "micro": micro,
                    "splits": splits,
                    "x": cpu(x),
                    "dy": cpu(dy),
                    "probs": cpu(probs),
                    "y": cpu(y),
                    "dx": cpu(x.grad),
                    "dprobs": None if probs is None else cpu(probs.grad),
                    "main_grads": {n: cpu(p.main_grad) for n, p in params.items()},  # type: ignore[attr-defined]
                    "flags": {n: p.grad_added_to_main_grad for n, p in params.items()},  # type: ignore[attr-defined]
                    "grads": {n: cpu(p.grad) for n, p in params.items()},
                    "collectives": log[first_call:],
                }
            )
            if cfg["zero_out"]:  # a framework adds into the dummy; the next one must be zero again
                for param in params.values():
                    assert param.grad is not None
                    param.grad.add_(7.0)
                    param.grad = None
        with torch.no_grad():  # plain SGD on the shards, from main_grad
            for param in params.values():
                param.add_(param.main_grad.to(param.dtype), alpha=-cfg["lr"])  # type: ignore[attr-defined]
                param.main_grad.zero_()  # type: ignore[attr-defined]
        after_step.append({n: cpu(w) for n, w in gather_full_weights(module).items()})
    return {
        "config": cfg,
        "rank": rank,
        "world_size": world,
        "init": init,
        "micro": micro_results,
        "after_step": after_step,
        "types": {n: type(p).__name__ for n, p in params.items()},
        "leaders_are_protocol": [isinstance(g.members[0], DistributedWeight) for g in groups],
        "shard_shapes": {n: tuple(p.shape) for n, p in params.items()},
    }


def run_error_checks(world: int, device: torch.device) -> dict:
    """Errors that need a real multi-rank group; ``pytest.raises`` failures exit non-zero."""
    bad_rows = GroupedLinear(2, 4, world + 1, bias=False, device=device)
    with pytest.raises(ValueError, match=rf"'weight0' has {world + 1} rows .* world size {world}"):
        shard_expert_weights(bad_rows)
    layer = GroupedLinear(2, 4, 2 * world, bias=False, device=device)
    shard_expert_weights(layer)
    with pytest.raises(ValueError, match=r"'weight0' is already a DistributedWeight"):
        shard_expert_weights(layer)
    leader = layer.weight0
    assert isinstance(leader, ShardedExpertWeight)
    leader.main_grad = None
    y = layer(torch.randn(3, 4, device=device), [1, 2])
    with pytest.raises(RuntimeError, match=r"'weight0' has no main_grad tensor"):
        y.sum().backward()
    return {"errors_checked": 3}


COLLECTIVE_LOG: list[dict[str, Any]] = []


def run(cfg: dict[str, Any], rank: Rank) -> dict:
    """One scenario on this rank (``run_worker``'s callback)."""
    if cfg["name"] == "errors":
        return run_error_checks(rank.world_size, rank.device)
    return run_scenario(cfg, rank.rank, rank.world_size, rank.device, COLLECTIVE_LOG)


if __name__ == "__main__":
    run_worker(run, setup=lambda rank: record_collectives(COLLECTIVE_LOG))
