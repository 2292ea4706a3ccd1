"""One rank of a Megatron-FSDP training run; the parent test compares what it returns to a reference.

Launched by ``test_training.py`` and ``test_gpu.py`` through
``groupgrad_testsupport.launch`` (one process per rank); on CPU it installs
the test-only CUDA shim (``cpu_shim.py``) first. For each scenario it builds
:class:`Net` from the scenario's seed (the same full weights on every rank),
shards it with ``shard_model`` (or, for the ``"unfixed"`` scenarios,
Megatron-FSDP's bare ``fully_shard_model``), trains ``steps`` SGD steps of
``micro_batches`` micro-batches on data of its own (seeded by scenario, rank,
step and micro-batch), and returns: the initial weights, the data, the full
weights after every step (assembled here, and by the package's
``gather_full_weights``), each step's full reduced gradients
(``gather_full_grads``, read after ``optimizer.step()`` and before
``zero_grad()``), the size of this rank's shard of every parameter, every
``get_main_grad()`` call (parameter, dtype, and the ``overwrite_main_grad``
flag it saw) and the dtype of every gradient
collective. Any failure exits non-zero with a traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import cpu_shim
import torch
import torch.distributed as dist
from torch import Tensor, nn

from groupgrad_testsupport import Rank, run_worker


class Net(nn.Module):
    """``GroupedMLP(tanh(GroupedLinear(x)))``: per-expert weights with bias, then a fused MLP.

    ``cfg["fp8"]``: both layers FP8 (``fp8_recipe="blockwise"``).
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        from groupgrad.modules import GroupedLinear, GroupedMLP

        super().__init__()
        e, h, f = cfg["experts"], cfg["hidden"], cfg["ffn_hidden"]
        dtype = getattr(torch, cfg.get("dtype", "float32"))
        options = {
            "dtype": dtype,
            "accumulate_into_main_grad": cfg.get("main_grad", True),
            "fp8_recipe": "blockwise" if cfg.get("fp8") else None,
        }
        self.proj = GroupedLinear(e, h, h, bias=True, **options)
        self.mlp = GroupedMLP(e, h, f, single_grouped_weight=cfg["packed"], **options)

    def forward(
        self, x: Tensor, splits: list[int], probs: Tensor, is_first_microbatch: bool | None = None
    ) -> Tensor:
        cache = {} if is_first_microbatch is None else {"is_first_microbatch": is_first_microbatch}
        h = torch.tanh(self.proj(x, splits, **cache))
        return self.mlp(h, splits, probs, **cache)


def make_data(cfg: dict[str, Any], rank: int, step: int, micro: int) -> dict[str, Any]:
    """This rank's micro-batch: ``x`` (T, H), ``splits`` (E,), ``probs`` (T,), ``dy`` (T, H)."""
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank * 100 + step * 10 + micro)
    t, e, h = cfg["tokens"], cfg["experts"], cfg["hidden"]
    cuts = sorted(torch.randint(0, t + 1, (e - 1,), generator=gen).tolist())
    splits = [b - a for a, b in zip([0, *cuts], [*cuts, t], strict=True)]
    return {
        "x": torch.randn(t, h, generator=gen),
        "splits": splits,
        "probs": torch.rand(t, generator=gen),
        "dy": torch.randn(t, h, generator=gen),
    }


def record_grad_collectives(log: list[dict[str, Any]]) -> Callable[[], None]:
    """Log the dtype of every reduce-scatter / all-reduce; return a function that undoes it."""
    originals = {n: getattr(dist, n) for n in ("reduce_scatter_tensor", "all_reduce")}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            key, position = ("input", 1) if name == "reduce_scatter_tensor" else ("tensor", 0)
            tensor = kwargs[key] if key in kwargs else args[position]
            log.append({"kind": name, "dtype": str(tensor.dtype), "numel": tensor.numel()})
            return original(*args, **kwargs)

        return recorded

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))

    def undo() -> None:
        for name, original in originals.items():
            setattr(dist, name, original)

    return undo


def count_get_main_grad(model: Any, names: list[str], log: list[dict[str, Any]]) -> None:
    """Wrap each named raw parameter's ``get_main_grad`` to log every call."""
    for name in names:
        param = model.raw_param[name]
        getter = param.get_main_grad

        def logged(param: Any = param, name: str = name, getter: Any = getter) -> Tensor:
            buffer = getter()
            log.append(
                {
                    "param": name,
                    "dtype": str(buffer.dtype),
                    "overwrite": bool(getattr(param, "overwrite_main_grad", False)),
                }
            )
            return buffer

        param.get_main_grad = logged


def full_weights(model: Any) -> dict[str, Tensor]:
    """Every parameter's full value, assembled from each rank's chunk of the distributed parameter.

    Megatron-FSDP's parameters are unevenly sharded DTensors (a rank may hold an
    empty chunk, which gloo's all-gather refuses), so each rank's chunk and its
    offsets travel through ``all_gather_object`` instead.
    """
    from megatron_fsdp.uneven_dtensor import update_uneven_dtensor_chunk_metadata
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.module.named_parameters():
        if not isinstance(param, DTensor):
            out[name] = param.detach().to("cpu", torch.float64).clone()
            continue
        local = param._local_tensor
        if not hasattr(local, "__create_chunk_list__"):
            update_uneven_dtensor_chunk_metadata(param)
        (chunk,) = local.__create_chunk_list__()
        mine = (tuple(chunk.offsets), local.detach().to("cpu", torch.float64).clone())
        chunks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(chunks, mine)
        full = torch.full(tuple(param.shape), float("nan"), dtype=torch.float64)
        for offsets, piece in chunks:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape, strict=True))
            full[index] = piece
        out[name] = full
    return out


def run_scenario(cfg: dict[str, Any], this: Rank) -> dict[str, Any]:
    """Train one scenario; return this rank's results (``run_worker``'s callback)."""
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    from groupgrad.integrations.megatron_fsdp import (
        fp32_grad_policy,
        gather_full_grads,
        gather_full_weights,
        shard_model,
        shard_optimizer,
    )
    from groupgrad.modules import GroupedLinear, GroupedMLP

    rank, world, device = this.rank, this.world_size, this.device.type
    torch.manual_seed(cfg["seed"])
    net = Net(cfg)
    init = {n: p.detach().to(torch.float64).clone() for n, p in net.named_parameters()}
    weight_names = [n for n in init if ".weight" in n]
    mesh = init_device_mesh(device, (world, 1), mesh_dim_names=("fsdp", "tp"))
    common = {
        "device_mesh": mesh,
        "dp_shard_dim": "fsdp",
        "tp_dim": "tp",
        "zero_dp_strategy": cfg["strategy"],
        "fsdp_unit_modules": [GroupedLinear, GroupedMLP],
        "device": torch.device(device),
    }
    # Unsharded gradient buffers ("optim", "no_shard") are reduced in place, so
    # Megatron-FSDP wants them reduced once per step: no auto-sync, and every
    # micro-batch but the last under no_sync().
    unsharded = cfg["strategy"] in ("optim", "no_shard")
    if unsharded:
        common["sync_model_each_microbatch"] = False
    if cfg["fixed"]:
        model = shard_model(net, **common)
    else:
        model = megatron_fsdp.fully_shard_model(
            net, mixed_precision_policy=fp32_grad_policy(), **common
        )
    if device == "cpu":
        cpu_shim.use_unfused_grad_scaling(model)
    optimizer = shard_optimizer(torch.optim.SGD(model.parameters(), lr=cfg["lr"]))
    calls: list[dict[str, Any]] = []
    count_get_main_grad(model, weight_names, calls)
    collectives: list[dict[str, Any]] = []
    undo = record_grad_collectives(collectives)
    data, weights, calls_per_micro = [], [], []
    gathered_weights, gathered_grads = [], []
    try:
        for step in range(cfg["steps"]):
            for micro in range(cfg["micro_batches"]):
                batch = make_data(cfg, rank, step, micro)
                data.append(batch)
                before = len(calls)
                last = micro == cfg["micro_batches"] - 1
                dtype = getattr(torch, cfg.get("dtype", "float32"))
                x, probs, dy = (batch[k].to(device, dtype) for k in ("x", "probs", "dy"))
                # "stale": is_first_microbatch=False at every forward after the very first,
                # across optimizer steps too (a weight cached across forwards would be stale)
                cache = (step == 0 and micro == 0,) if cfg.get("fp8_cache") == "stale" else ()
                with contextlib.nullcontext() if last else model.no_sync():
                    y = model(x, batch["splits"], probs, *cache)
                    (y * dy).sum().backward()
                calls_per_micro.append(calls[before:])
            optimizer.step()
            gathered_grads.append(gather_full_grads(model))
            optimizer.zero_grad()
            weights.append(full_weights(model))
            gathered_weights.append(gather_full_weights(model))
    finally:
        undo()
    result = {
        "config": cfg,
        "init": init,
        "weight_names": weight_names,
        "data": data,
        "weights": weights,
        "gathered_weights": gathered_weights,
        "gathered_grads": gathered_grads,
        "shard_numels": {
            name: param.to_local().numel() if hasattr(param, "to_local") else param.numel()
            for name, param in model.module.named_parameters()
        },
        "calls": calls_per_micro,
        "collectives": collectives,
    }
    result["switched_delay_error"] = None
    if cfg["fixed"]:  # delay_wgrad_compute switched on after shard_model: refused at forward
        net.mlp.delay_wgrad_compute = True
        batch = make_data(cfg, rank, 0, 0)
        dtype = getattr(torch, cfg.get("dtype", "float32"))
        x, probs = (batch[k].to(device, dtype) for k in ("x", "probs"))
        try:
            model(x, batch["splits"], probs)
        except ValueError as error:
            result["switched_delay_error"] = str(error)
        net.mlp.delay_wgrad_compute = False
    return result


def setup(this: Rank) -> None:
    """Before the process group: the CUDA shim on CPU, deterministic algorithms everywhere."""
    if this.device.type == "cpu":
        cpu_shim.install()
    torch.use_deterministic_algorithms(True)


if __name__ == "__main__":
    run_worker(run_scenario, setup=setup)
