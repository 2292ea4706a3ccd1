"""One rank of an FSDP2 training run (a ``groupgrad_testsupport`` worker script).

For each scenario it builds :class:`moe_model.MoEModel` from the scenario's
seed (the same full weights on every rank), shards it per block and at the
root with ``groupgrad.integrations.fsdp2.fully_shard`` (or, to show what the
integration changes, with plain ``torch.distributed.fsdp.fully_shard``),
trains ``steps`` SGD steps of ``micro_batches`` micro-batches (all but the
last without gradient sync) on data of its own, and returns: every
micro-batch's output and input gradient, the reduced gradients (gathered
whole) and the weights after every step, and every reduce-scatter input
FSDP2 ran, per unit, with the unit's parameter names in FSDP2's order.

FP8 scenarios with ``fp8_cache="stale"`` also pin FSDP2's allocator to its
worst case (:func:`same_address`): each unit's re-gathered weights land at
the address the layers' cached FP8 weights were quantized from.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import moe_model  # siblings: this script's folder is sys.path[0]
import reduce_scatter
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as plain_fully_shard

from groupgrad.integrations.fsdp2 import fully_shard
from groupgrad_testsupport import Rank, run_worker
from groupgrad_testsupport.calls import weight_quantizations


def _full(t: Tensor) -> Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().cpu().clone()


def shard(
    model: nn.Module, cfg: Mapping[str, Any], device: torch.device
) -> tuple[nn.Module, list[str]]:
    """Shard per block (and the experts alone when asked) then the root, compiled as asked.

    ``cfg["compile"]``: ``"block"`` compiles each block (``fullgraph=True``)
    before sharding it, as torchtitan does; ``"block_ac"`` wraps each block
    in activation checkpointing first; ``"root"`` compiles the sharded model.

    Returns:
        The model to train (the compiled wrapper for ``"root"``) and the
        units' names.
    """
    shard_fn = fully_shard if cfg["integration"] else plain_fully_shard
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cfg["bf16"] else None, reduce_dtype=torch.float32
    )
    options = {"mp_policy": policy, "reshard_after_forward": cfg["reshard"]}
    compiled = cfg.get("compile")
    units: list[str] = []
    for b, block in enumerate(model.blocks):
        if cfg["experts_unit"]:
            shard_fn(block.experts, **options)
            units.append(f"blocks.{b}.experts")
        if compiled == "block_ac":
            block = checkpoint_wrapper(block)
        if compiled in ("block", "block_ac"):
            block = torch.compile(block, fullgraph=True)
            model.blocks[b] = block
        shard_fn(block, **options)
        units.append(f"blocks.{b}")
    shard_fn(model, **options)
    units.append("")
    if cfg.get("fp8_cache") == "stale":
        same_address(model)
    return (torch.compile(model) if compiled == "root" else model), units


def same_address(model: nn.Module) -> None:
    """At each forward of a unit, any FP8 weight a layer still caches is made to look current.

    A cached FP8 weight is served while its parameters keep their identity,
    version, shape, strides and ``data_ptr`` and no ``torch.optim`` step ran
    since. Under FSDP2 the unsharded parameter is the same object at every
    unshard, the all-gather copies into it under
    ``_unsafe_preserve_version_counter``, and its shape and strides never
    change; the address is the allocator's choice (after the post-backward
    reshard freed the storage it may hand out the same one), and an optimizer
    outside ``torch.optim`` counts no step. This forward pre-hook on every
    unit, after FSDP2's unshard, makes every run that worst case: an entry
    that outlived the unit's last forward gets the re-gathered storage's
    address and the current step count (version, shape and strides stay as
    cached). The layers never cache under FSDP, so the hook finds nothing; a
    layer that cached would serve weights quantized before the optimizer step
    at the next ``is_first_microbatch=False``.
    """
    names = dict(model.named_modules())
    units = [name for name, module in names.items() if isinstance(module, FSDPModule)]
    for unit in units:
        inner = [u for u in units if u != unit and _inside(u, unit)]
        layers = [
            module
            for name, module in names.items()
            if hasattr(module, "_fp8_weights")
            and _inside(name, unit)
            and not any(_inside(name, u) for u in inner)
        ]
        if layers:
            names[unit].register_forward_pre_hook(functools.partial(_re_gathered_in_place, layers))


def _inside(name: str, unit: str) -> bool:
    return unit == "" or name == unit or name.startswith(unit + ".")


def _re_gathered_in_place(layers: Sequence[nn.Module], module: nn.Module, args: Any) -> None:
    for layer in layers:
        cache = layer._fp8_weights
        entry = cache._entry  # groupgrad.modules._fp8_cache: a cached weight and its stamps
        if entry is None:
            continue
        params = list(entry.params)
        stamps = [  # the cache's own form: a list of (data_ptr, version, shape, strides)
            (p.data_ptr(), version, shape, strides)
            for p, (_, version, shape, strides) in zip(params, entry.stamps, strict=True)
        ]
        probe = type(cache)()  # the cache's own optimizer-step count, read off a fresh entry
        probe.put([], entry.dtype, entry.blocks)
        cache._entry = dataclasses.replace(entry, stamps=stamps, steps=probe._entry.steps)
        # the point of the hook: the moved entry looks current to the cache's own checks
        assert cache._entry.serves(params, entry.dtype), "same_address no longer mimics reuse"


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers compile and checkpointing put in it."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def train(
    cfg: Mapping[str, Any], rank: int, world: int, device: torch.device, checkpoint_dir: Path
) -> dict[str, Any]:
    """One scenario on this rank; everything the parent compares, on the CPU."""
    model, units = shard(moe_model.build(cfg, device), cfg, device)
    sharded = getattr(model, "_orig_mod", model)  # the FSDP root under a compiled root
    log: list[dict[str, Any]] = []
    reduce_scatter.record(sharded, units, log)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    names = [name for name, _ in model.named_parameters()]
    result: dict[str, Any] = {"outs": [], "dxs": [], "grads": [], "weights": []}
    result["unit_params"] = {
        name: [plain_name(n) for n in reduce_scatter.unit_param_names(sharded, name)]
        for name in units
    }
    for step in range(cfg["steps"]):
        if cfg["dcp"] and step == cfg["steps"] - 1:
            model, optimizer = _reload(model, optimizer, cfg, device, checkpoint_dir, log)
        for micro in range(cfg["micro_batches"]):
            model.set_requires_gradient_sync(micro == cfg["micro_batches"] - 1)
            data = moe_model.batch(cfg, step, micro, rank)
            x = data["x"].to(device).requires_grad_(True)
            forward = functools.partial(
                model, x, data["idx"].to(device), *first_microbatch(cfg, step, micro)
            )
            if cfg.get("fp8") and step == micro == 0:  # weight quantizations: forward, backward
                outs: list[Tensor] = []
                counts = [weight_quantizations(functools.partial(_append, outs, forward))]
                loss = moe_model.loss_of(outs[0], data["target"])
                counts.append(weight_quantizations(loss.backward))
                result["weight_quantizations"] = counts
                out = outs[0]
            else:
                out = forward()
                moe_model.loss_of(out, data["target"]).backward()
            result["outs"].append(out.detach().cpu().clone())
            result["dxs"].append(x.grad.detach().cpu().clone())
        params = dict(model.named_parameters())
        result["grads"].append({plain_name(n): _full(params[n].grad) for n in names})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result["weights"].append({plain_name(n): _full(p) for n, p in model.named_parameters()})
    result["reduce_scatters"] = log
    return result


def _append(outs: list[Tensor], forward: Any) -> None:
    outs.append(forward())


def first_microbatch(cfg: Mapping[str, Any], step: int, micro: int) -> tuple[bool, ...]:
    """The ``is_first_microbatch`` argument, if any, one forward passes (``cfg["fp8_cache"]``).

    ``"stale"``: ``True`` at the very first forward only, ``False`` at every
    later one, across optimizer steps too: a layer that cached its FP8
    weights across forwards would use step 0's weights at step 1.
    """
    if cfg.get("fp8_cache") != "stale":
        return ()
    return (step == 0 and micro == 0,)


def _reload(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: Mapping[str, Any],
    device: torch.device,
    checkpoint_dir: Path,
    log: list[dict[str, Any]],
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """DCP round trip: save model + optimizer, load them into a freshly built and sharded model."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(checkpoint_dir))
    fresh, units = shard(moe_model.build({**cfg, "seed": cfg["seed"] + 1000}, device), cfg, device)
    reduce_scatter.record(fresh, units, log)  # other weights
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    model_state, optim_state = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(checkpoint_dir))
    set_state_dict(
        fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for (name, old), (_, new) in zip(
        model.named_parameters(), fresh.named_parameters(), strict=True
    ):
        if not torch.equal(_full(old), _full(new)):
            raise AssertionError(f"DCP round trip changed {name}")
    dist.barrier()
    return fresh, fresh_optimizer


def run_scenario(scenario: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """One scenario on this rank (``run_worker`` has joined the process group)."""
    return train(
        scenario, rank.rank, rank.world_size, rank.device, rank.workdir / f"dcp_{scenario['name']}"
    )


if __name__ == "__main__":
    run_worker(run_scenario)
