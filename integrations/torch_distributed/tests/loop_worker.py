"""One rank of the training-loop tests: DDP, checkpoints, fp32 master weights, frozen members.

Run by ``test_training_loop.py`` through ``groupgrad_testsupport.launch`` (one
process per rank, gloo on CPU or NCCL on GPUs). Each scenario's ``"kind"``
picks a function below; it returns plain data and tensors that the test
compares with a single-process fp64 reference (``loop_reference.py``).

Legend: ``T`` tokens per rank, ``E`` experts, ``H`` hidden, ``F`` ffn hidden,
``K`` in_features, ``N`` out_features, ``W`` world size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from groupgrad.integrations import torch_distributed as td
from groupgrad.modules import GroupedLinear, GroupedMLP
from groupgrad_testsupport import Rank, run_worker


def cpu(tensor: Tensor) -> Tensor:
    return tensor.detach().cpu().clone()


class MoE(nn.Module):
    """A router (replicated, for DDP) in front of sharded experts; top-1 routing."""

    def __init__(self, cfg: dict[str, Any], device: torch.device) -> None:
        super().__init__()
        self.router = nn.Linear(cfg["hidden"], cfg["experts"], device=device)
        self.experts = GroupedMLP(cfg["experts"], cfg["hidden"], cfg["ffn"], device=device)

    def forward(self, x_TH: Tensor) -> tuple[Tensor, Tensor]:
        """Output in token order, and each token's expert."""
        probs_T, expert_T = self.router(x_TH).softmax(-1).max(-1)
        order_T = expert_T.argsort(stable=True)
        splits = torch.bincount(expert_T, minlength=self.experts.num_groups).tolist()
        y_TH = self.experts(x_TH[order_T], splits, probs_T[order_T])
        return torch.empty_like(y_TH).index_copy(0, order_T, y_TH), expert_T


def _record_buckets(ddp: DistributedDataParallel, names: dict[int, str], seen: set[str]) -> None:
    """A DDP comm hook that notes which parameters DDP all-reduces (then all-reduces as usual)."""

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        seen.update(names[id(p)] for p in bucket.parameters())
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0] / dist.get_world_size())

    ddp.register_comm_hook(None, hook)


def run_ddp(cfg: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """Train the MoE under DDP (the router reduced by DDP, the experts sharded), or fail clearly."""
    torch.manual_seed(cfg["seed"])  # the same full weights on every rank
    model = MoE(cfg, rank.device)
    init = {n: cpu(p) for n, p in model.named_parameters()}
    if cfg["wrap"] == "whole":  # the usual order: shard the model DDP will wrap
        td.shard_expert_weights(model)
    else:  # DDP wraps a parent of the sharded module
        td.shard_expert_weights(model.experts)
        if cfg["wrap"] == "parent":
            td.ddp_ignore_sharded(model)
    shards_before = {n: cpu(p) for n, p in td.named_sharded_parameters(model)}
    ddp = DistributedDataParallel(model)
    shards_after_wrap = {n: cpu(p) for n, p in td.named_sharded_parameters(model)}
    untouched = all(torch.equal(shards_before[n], shards_after_wrap[n]) for n in shards_before)
    data = torch.Generator().manual_seed(cfg["seed"] * 100 + rank.rank)
    x = torch.randn(cfg["tokens"], cfg["hidden"], generator=data).to(rank.device)
    if cfg["wrap"] == "forgotten":
        try:
            ddp(x)
        except RuntimeError as error:
            return {"error": str(error), "untouched_by_wrap": untouched}
        return {"error": None, "untouched_by_wrap": untouched}

    names = {id(p): n for n, p in model.named_parameters()}
    reduced: set[str] = set()
    _record_buckets(ddp, names, reduced)
    masters = td.MasterWeights(p for _, p in td.named_sharded_parameters(model))
    optimizer = torch.optim.SGD(
        [*masters.parameters(), *model.router.parameters()], lr=cfg["lr"], momentum=0.9
    )
    steps = []
    for step in range(cfg["steps"]):
        if step:
            x = torch.randn(cfg["tokens"], cfg["hidden"], generator=data).to(rank.device)
        y, expert = ddp(x)
        y.square().mean().backward()
        expert_grads_zero = all(
            p.grad is None or not p.grad.any() for _, p in td.named_sharded_parameters(model)
        )
        masters.step(optimizer)
        optimizer.zero_grad()
        steps.append(
            {
                "x": cpu(x),
                "expert": cpu(expert),
                "router": {f"router.{n}": cpu(p) for n, p in model.router.named_parameters()},
                "experts": {n: cpu(w) for n, w in td.gather_full_weights(model).items()},
                "expert_grads_zero": expert_grads_zero,
            }
        )
    return {
        "init": init,
        "untouched_by_wrap": untouched,
        "reduced_by_ddp": sorted(reduced),
        "sharded": sorted(shards_before),
        "steps": steps,
    }


def run_ddp_root_layer(cfg: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """DDP around a GroupedLinear itself: its sharded weights sit at the root of DDP's module."""
    torch.manual_seed(cfg["seed"])
    layer = GroupedLinear(3, 8, 4 * rank.world_size, bias=True, device=rank.device)
    init = {n: cpu(p) for n, p in layer.named_parameters()}
    td.shard_expert_weights(layer)
    shards_before = {n: cpu(p) for n, p in td.named_sharded_parameters(layer)}
    ddp = DistributedDataParallel(layer)
    reduced: set[str] = set()
    _record_buckets(ddp, {id(p): n for n, p in layer.named_parameters()}, reduced)
    data = torch.Generator().manual_seed(cfg["seed"] * 100 + rank.rank)
    x = torch.randn(10, 8, generator=data).to(rank.device)
    dy = torch.randn(10, 4 * rank.world_size, generator=data).to(rank.device)
    ddp(x, cfg["splits"]).backward(dy)
    return {
        "init": init,
        "x": cpu(x),
        "dy": cpu(dy),
        "untouched_by_wrap": all(
            torch.equal(shards_before[n], cpu(p)) for n, p in td.named_sharded_parameters(layer)
        ),
        "reduced_by_ddp": sorted(reduced),
        "bias_grads": {f"bias{e}": cpu(getattr(layer, f"bias{e}").grad) for e in range(3)},
        "main_grads": {n: cpu(p.main_grad) for n, p in td.named_sharded_parameters(layer)},
    }


def integer_data(gen: torch.Generator, rows: int, cols: int, device: torch.device) -> Tensor:
    """Small integers in bf16: every product and sum of the wgrad GEMM is exact in fp32."""
    return torch.randint(-4, 5, (rows, cols), generator=gen).to(device, torch.bfloat16)


def run_masters(cfg: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """bf16 shards, fp32 masters, torch.optim.AdamW stepping the masters from main_grad."""
    torch.manual_seed(cfg["seed"])
    E, K, N = cfg["experts"], cfg["in_features"], cfg["out_features"]
    layer = GroupedLinear(
        E,
        K,
        N,
        bias=False,
        dtype=torch.bfloat16,
        device=rank.device,
        single_grouped_weight=cfg["packed"],
    )
    init = {n: cpu(p) for n, p in layer.named_parameters()}
    td.shard_expert_weights(layer)
    masters = td.MasterWeights(p for _, p in td.named_sharded_parameters(layer))
    optimizer = torch.optim.AdamW(
        masters.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"]
    )
    data = torch.Generator().manual_seed(cfg["seed"] * 100 + rank.rank)
    steps = []
    for _ in range(cfg["steps"]):
        micro = []
        for _ in range(cfg["micro_batches"]):
            x = integer_data(data, cfg["tokens"], K, rank.device)
            dy = integer_data(data, cfg["tokens"], N, rank.device)
            layer(x, cfg["splits"]).backward(dy)
            micro.append({"x": cpu(x), "dy": cpu(dy)})
        main_grads = {n: cpu(p.main_grad) for n, p in td.named_sharded_parameters(layer)}
        masters.step(optimizer)
        steps.append(
            {
                "micro": micro,
                "main_grads": main_grads,
                "weights": {n: cpu(w) for n, w in td.gather_full_weights(layer).items()},
                "shards": {n: cpu(p) for n, p in td.named_sharded_parameters(layer)},
                "masters": [cpu(m) for m in masters.parameters()],
                "main_grads_zeroed": all(
                    not p.main_grad.any() for _, p in td.named_sharded_parameters(layer)
                ),
            }
        )
    return {
        "init": init,
        "names": [n for n, _ in td.named_sharded_parameters(layer)],
        "steps": steps,
    }


def run_masters_resume(cfg: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """bf16 shards and fp32 masters with AdamW: 2 steps, against 1 step, a checkpoint (model,
    masters and optimizer, ``torch.save`` per rank), a fresh model loading it, 1 step."""
    E, K, N = cfg["experts"], cfg["in_features"], cfg["out_features"]
    folder = Path(cfg["folder"])

    def build(seed: int) -> tuple[GroupedLinear, td.MasterWeights, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        layer = GroupedLinear(E, K, N, bias=False, dtype=torch.bfloat16, device=rank.device)
        td.shard_expert_weights(layer)
        masters = td.MasterWeights(p for _, p in td.named_sharded_parameters(layer))
        optimizer = torch.optim.AdamW(masters.parameters(), lr=cfg["lr"], weight_decay=0.1)
        return layer, masters, optimizer

    def step(layer: GroupedLinear, masters: td.MasterWeights, opt: Any, seed: int) -> None:
        data = torch.Generator().manual_seed(seed * 100 + rank.rank)
        x = torch.randn(cfg["tokens"], K, generator=data).to(rank.device, torch.bfloat16)
        dy = torch.randn(cfg["tokens"], N, generator=data).to(rank.device, torch.bfloat16)
        layer(x, cfg["splits"]).backward(dy)
        masters.step(opt)

    def state(layer: GroupedLinear, masters: td.MasterWeights) -> dict[str, Any]:
        shards = [cpu(p) for _, p in td.named_sharded_parameters(layer)]
        return {"shards": shards, "masters": [cpu(m) for m in masters.parameters()]}

    straight = build(cfg["seed"])
    for seed in (1, 2):
        step(*straight, seed)
    first = build(cfg["seed"])
    step(*first, 1)
    layer, masters, optimizer = first
    saved = state(layer, masters)
    path = folder / f"masters-rank{rank.rank}.pt"
    torch.save(
        {"model": layer.state_dict(), "masters": masters.state_dict(),
         "optimizer": optimizer.state_dict()},
        path,
    )  # fmt: skip
    dist.barrier()
    resumed = build(cfg["seed"] + 1)  # other initial weights: everything must come from the file
    checkpoint = torch.load(path, map_location=rank.device, weights_only=False)
    resumed[0].load_state_dict(checkpoint["model"])
    resumed[1].load_state_dict(checkpoint["masters"])
    resumed[2].load_state_dict(checkpoint["optimizer"])
    step(*resumed, 2)
    other = torch.load(folder / f"masters-rank{1 - rank.rank}.pt", weights_only=False)
    try:
        resumed[1].load_state_dict(other["masters"])
        other_error = None
    except ValueError as error:
        other_error = str(error)
    return {
        "saved": saved,
        "straight": state(*straight[:2]),
        "resumed": state(*resumed[:2]),
        "other_file_error": other_error,
    }


def run_frozen(cfg: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """Frozen members of a sharded group: never written, need no main_grad, get ``None``."""
    torch.manual_seed(cfg["seed"])
    E, K, N = 3, 8, 4 * rank.world_size
    layer = GroupedLinear(
        E, K, N, bias=False, device=rank.device, single_grouped_weight=cfg["packed"],
        delay_wgrad_compute=cfg["delay"],
    )  # fmt: skip
    init = {n: cpu(p) for n, p in layer.named_parameters()}
    td.shard_expert_weights(layer)
    params = dict(td.named_sharded_parameters(layer))
    for name, param in params.items():
        param.overwrite_main_grad = cfg["overwrite"]  # type: ignore[attr-defined]
        if name in cfg["frozen"]:
            param.requires_grad_(False)
            param.main_grad.fill_(7.0)  # type: ignore[attr-defined]  # a sentinel an add or copy moves
    if cfg["without_main_grad"]:
        params[cfg["without_main_grad"]].main_grad = None  # type: ignore[attr-defined]
    data = torch.Generator().manual_seed(cfg["seed"] * 100 + rank.rank)
    x = torch.randn(10, K, generator=data).to(rank.device).requires_grad_(True)
    dy = torch.randn(10, N, generator=data).to(rank.device)
    layer(x, cfg["splits"]).backward(dy)
    if cfg["delay"]:
        layer.backward_dw()
    return {
        "init": init,
        "x": cpu(x),
        "dy": cpu(dy),
        "dx": cpu(x.grad),
        "main_grads": {
            n: None if p.main_grad is None else cpu(p.main_grad)  # type: ignore[attr-defined]
            for n, p in params.items()
        },
        "flags": {n: p.grad_added_to_main_grad for n, p in params.items()},  # type: ignore[attr-defined]
        "grads": {n: None if p.grad is None else cpu(p.grad) for n, p in params.items()},
    }


def _checkpoint_model(seed: int, device: torch.device) -> nn.ModuleDict:
    """An MLP (per-expert, fp32, biases) and a packed bf16 linear, sharded as one module."""
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {
            "mlp": GroupedMLP(4, 8, 12, bias=True, device=device),
            "lin": GroupedLinear(
                3,
                8,
                12,
                bias=False,
                dtype=torch.bfloat16,
                device=device,
                single_grouped_weight=True,
            ),
        }
    )


def run_checkpoint_save(cfg: dict[str, Any], rank: Rank) -> dict[str, Any]:
    folder = Path(cfg["folder"])
    model = _checkpoint_model(cfg["seed"], rank.device)
    truth = {n: cpu(t) for n, t in model.state_dict().items()}
    td.shard_expert_weights(model)
    state = model.state_dict()
    kinds = {n: type(v).__name__ for n, v in state.items()}
    placements = {n: str(v.placements) for n, v in state.items() if isinstance(v, DTensor)}
    dcp.save(state, checkpoint_id=folder / "dcp")
    torch.save(model.state_dict(), folder / f"rank{rank.rank}.pt")
    full = td.full_state_dict(model)
    if rank.rank == 0:
        torch.save(full, folder / "full.pt")
    return {
        "truth": truth,
        "kinds": kinds,
        "placements": placements,
        "full": {n: cpu(t) for n, t in full.items()},
    }


def _loaded(model: nn.Module) -> dict[str, Any]:
    return {
        "full": {n: cpu(t) for n, t in td.full_state_dict(model).items()},
        "shard_shapes": {n: tuple(p.shape) for n, p in td.named_sharded_parameters(model)},
        "main_grad_shapes": {
            n: tuple(p.main_grad.shape)  # type: ignore[attr-defined]
            for n, p in td.named_sharded_parameters(model)
        },
    }


def run_checkpoint_load(cfg: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """Load what the 2-rank launch saved into a model built from another seed."""
    folder = Path(cfg["folder"])
    model = _checkpoint_model(cfg["seed"] + 1, rank.device)
    td.shard_expert_weights(model)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=folder / "dcp")
    model.load_state_dict(state)
    found: dict[str, Any] = {"dcp": _loaded(model)}

    model = _checkpoint_model(cfg["seed"] + 2, rank.device)
    td.shard_expert_weights(model)
    td.load_full_state_dict(model, torch.load(folder / "full.pt", map_location=rank.device))
    found["full_file"] = _loaded(model)

    if rank.world_size == cfg["saved_on"]:  # per-rank torch.save files: same world size only
        model = _checkpoint_model(cfg["seed"] + 3, rank.device)
        td.shard_expert_weights(model)
        model.load_state_dict(torch.load(folder / f"rank{rank.rank}.pt", map_location=rank.device))
        found["own_file"] = _loaded(model)
        other = (rank.rank + 1) % rank.world_size
        other_state = torch.load(folder / f"rank{other}.pt", map_location=rank.device)
        try:
            model.load_state_dict(other_state)
            found["other_file_error"] = None
        except RuntimeError as error:
            found["other_file_error"] = str(error)
        # the sharded module below a parent loaded first: refused before the router is written
        parent = nn.ModuleDict({"router": nn.Linear(2, 2, device=rank.device), "experts": model})
        kept = {n: p.detach().clone() for n, p in parent.router.named_parameters()}
        state = {
            f"router.{n}": torch.full_like(p, 7.0) for n, p in parent.router.named_parameters()
        }
        state.update((f"experts.{k}", v) for k, v in other_state.items())
        try:
            td.load_full_state_dict(parent, state)
            found["other_file_full_error"] = None
        except RuntimeError as error:
            found["other_file_full_error"] = str(error)
        found["router_kept"] = all(
            torch.equal(p, kept[n]) for n, p in parent.router.named_parameters()
        )
    return found


def run_clip(cfg: dict[str, Any], rank: Rank) -> dict[str, Any]:
    """``MasterWeights.clip_grad_norm_`` over a sharded layer's masters and a whole router."""
    torch.manual_seed(cfg["seed"])  # the same weights on every rank before sharding
    layer = GroupedLinear(3, 8, 12, bias=False, dtype=torch.bfloat16, device=rank.device)
    router = nn.Linear(8, 3, device=rank.device)
    td.shard_expert_weights(layer)
    masters = td.MasterWeights(p for _, p in td.named_sharded_parameters(layer))
    data = torch.Generator().manual_seed(cfg["seed"] * 100 + rank.rank)
    x = integer_data(data, 12, 8, rank.device)
    layer(x, [5, 0, 7]).backward(integer_data(data, 12, 12, rank.device))
    router(x.float()).sum().backward()  # the same router gradient on every rank: a stand-in
    dist.all_reduce(router.weight.grad)  # for DDP's average, identical on the ranks
    masters.grads_from_main_grad()
    before = [cpu(m.grad) for m in masters.parameters()]
    router_before = cpu(router.weight.grad)
    norm = masters.clip_grad_norm_(cfg["max_norm"], others=[router.weight])
    return {
        "norm": float(norm),
        "before": before,
        "after": [cpu(m.grad) for m in masters.parameters()],
        "router_before": router_before,
        "router_after": cpu(router.weight.grad),
    }


KINDS: dict[str, Callable[[dict[str, Any], Rank], dict[str, Any]]] = {
    "clip": run_clip,
    "ddp": run_ddp,
    "ddp_root_layer": run_ddp_root_layer,
    "masters": run_masters,
    "masters_resume": run_masters_resume,
    "frozen": run_frozen,
    "checkpoint_save": run_checkpoint_save,
    "checkpoint_load": run_checkpoint_load,
}


def run_scenario(cfg: dict[str, Any], rank: Rank) -> dict[str, Any]:
    return KINDS[cfg["kind"]](cfg, rank)


if __name__ == "__main__":
    run_worker(run_scenario)
