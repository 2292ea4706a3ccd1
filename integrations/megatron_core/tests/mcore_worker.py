"""One rank of the Megatron-Core scenarios; the parent tests compare what the ranks return.

Every scenario builds real Megatron-Core modules (``MoELayer`` with its router
and token dispatcher, ``DistributedDataParallel``, ``dist_checkpointing``) on
the process group the launcher set up, with Megatron's parallel state for the
scenario's expert-parallel size. Results are plain tensors and values (CPU),
keyed by name; nothing here decides pass or fail.

Run by ``groupgrad_testsupport.launch`` (one process per rank, gloo on CPU
with the test-only ``cpu_shim``, NCCL on GPUs). Kinds (``scenario["kind"]``):

* ``layer`` — the same MoE layer with Megatron's ``SequentialMLP`` and with
  groupgrad experts (``backend``: ``fused`` or ``unfused``), the same weights,
  the same inputs, two micro-batches under Megatron's DDP (the first under
  ``no_sync``), optionally ``delay_wgrad_compute`` (``backward_dw()`` called
  after every backward, as Megatron's schedule does) and
  ``gradient_accumulation_fusion``; in bf16 also the ``SequentialMLP`` layer
  in fp64. Returns outputs, input gradients and every ``main_grad`` (expert
  names mapped to ``SequentialMLP``'s).
* ``checkpoint`` — distributed checkpoints saved by one backend and loaded by
  the other (``SequentialMLP`` ↔ fused ↔ unfused), weights returned.
* ``layout`` — the sharded-state-dict entries (checkpoint key, shapes,
  offsets, replica ids; SwiGLU factories built) of every backend.
* ``init`` — parameters as built: which init method touched which expert,
  Megatron attributes.
* ``errors`` — setups that must be refused; the messages.
* ``param_gather`` — three ``DistributedOptimizer`` steps with Megatron's
  ``overlap_param_gather`` off and on; each step's output (a launch of its own).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

SEED = 1234
SHAPE = {"experts": 4, "hidden": 16, "ffn": 8, "seq": 6, "batch": 2, "topk": 2}
_EXPERT = re.compile(
    r"(.*\.?experts\.)(?:grouped_mlp\.(fc[12])|linear_(fc[12]))\.(weight|bias)(\d+)$"
)


# ---------------------------------------------------------------- building


def setup_parallel(ep: int, etp: int = 1) -> None:
    """Megatron's parallel state for ``ep`` (and expert tensor parallelism ``etp``), seeded RNGs."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    model_parallel_cuda_manual_seed(SEED)


def make_config(sc: dict[str, Any], dtype: torch.dtype, **overrides: Any) -> Any:
    """The scenario's ``TransformerConfig`` in ``dtype`` (delay/fusion set after Megatron's checks)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    delay = overrides.pop("delay_wgrad_compute", False)
    options: dict[str, Any] = {
        "num_layers": 1,
        "hidden_size": SHAPE["hidden"],
        "ffn_hidden_size": SHAPE["ffn"],
        "num_attention_heads": 2,
        "num_moe_experts": SHAPE["experts"],
        "moe_ffn_hidden_size": SHAPE["ffn"],
        "moe_router_topk": SHAPE["topk"],
        "moe_router_dtype": "fp32",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": sc.get("dispatcher", "allgather"),
        "expert_model_parallel_size": sc["ep"],
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": sc.get("bias", False),
        "bias_dropout_fusion": False,
        "init_method": partial(torch.nn.init.normal_, mean=0.0, std=0.3),
        "output_layer_init_method": partial(torch.nn.init.normal_, mean=0.0, std=0.2),
        "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "use_cpu_initialization": sc.get("device", "cpu") == "cpu",
        **sc.get("config", {}),
        **overrides,
    }
    config = TransformerConfig(**options)
    # Megatron accepts delay_wgrad_compute only with its EP-overlap schedule (CUDA streams,
    # alltoall, bf16); the layer-level scenarios call backward_dw() themselves.
    config.delay_wgrad_compute = delay
    return config


def build_layer(backend: str, config: Any, device: str) -> Any:
    """A Megatron ``MoELayer`` with ``sequential`` (SequentialMLP), ``fused`` or ``unfused`` experts."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from groupgrad.integrations.megatron_core import get_moe_module_groupgrad_spec

    if backend == "sequential":
        spec = get_moe_module_spec(
            use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False
        )
    else:
        spec = get_moe_module_groupgrad_spec(config.num_moe_experts, fused=backend == "fused")
    return build_from_spec(spec, config).to(device)


def build_from_spec(spec: Any, config: Any) -> Any:
    """The module of an MoE spec: megatron-core 0.16's ``ModuleSpec`` through ``build_module``,
    0.19's builder called."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    if isinstance(spec, ModuleSpec):  # megatron-core 0.16
        return build_module(spec, config=config)
    return spec(config=config, pg_collection=None)  # 0.19: a builder


def sequential_name(name: str) -> str:
    """The ``SequentialMLP`` name of a groupgrad expert parameter (other names unchanged)."""
    match = _EXPERT.match(name)
    if match is None:
        return name
    prefix, fc_fused, fc_linear, kind, expert = match.groups()
    return f"{prefix}local_experts.{expert}.linear_{fc_fused or fc_linear}.{kind}"


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Give ``dst`` the parameters of ``src`` (names mapped to ``SequentialMLP``'s), cast."""
    source = dict(src.named_parameters())
    with torch.no_grad():
        for name, param in dst.named_parameters():
            param.copy_(source[sequential_name(name)])


# ---------------------------------------------------------------- layer


def _data(sc: dict[str, Any], micro: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 100 * dist.get_rank() + micro)
    shape = (SHAPE["seq"], SHAPE["batch"], SHAPE["hidden"])
    return torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(
        device
    )


def _train_layer(
    layer: Any, config: Any, sc: dict[str, Any], *, delay: bool, dtype: torch.dtype
) -> dict[str, Any]:
    """Two micro-batches under Megatron's DDP; outputs, input grads, main_grads, flags."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype != torch.float64, delay_wgrad_compute=delay
    )
    ddp = DistributedDataParallel(config, ddp_config, layer)
    device = sc.get("device", "cpu")
    result: dict[str, Any] = {"out": [], "dx": []}
    for micro in range(2):
        x, dy = _data(sc, micro, device)
        # every run starts from the same values: those of the scenario's dtype (the fp64 truth
        # of a bf16 run computes from the bf16 inputs)
        low = getattr(torch, sc.get("dtype", "float32"))
        x, dy = x.to(low).to(dtype), dy.to(low).to(dtype)
        x.requires_grad_()
        with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
            out, _ = ddp(x)
            out.backward(dy)
            if delay:
                layer.backward_dw()
        result["out"].append(out.detach().cpu())
        result["dx"].append(x.grad.detach().cpu())
    ddp.finish_grad_sync()
    trainable = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    result["main_grad"] = {sequential_name(n): p.main_grad.detach().cpu() for n, p in trainable}
    result["grad_added"] = {
        sequential_name(n): bool(p.grad_added_to_main_grad)
        for n, p in trainable
        if ".experts." in f".{n}" and sequential_name(n).endswith(".weight")  # biases: autograd
    }
    result["untouched"] = all(  # a frozen parameter gets no gradient of any kind
        p.grad is None and getattr(p, "main_grad", None) is None
        for p in layer.parameters()
        if not p.requires_grad
    )
    return result


def run_layer(sc: dict[str, Any]) -> dict[str, Any]:
    setup_parallel(sc["ep"])
    dtype = getattr(torch, sc.get("dtype", "float32"))
    device = sc.get("device", "cpu")
    reference = build_layer("sequential", make_config(sc, dtype), device)
    config = make_config(
        sc,
        dtype,
        gradient_accumulation_fusion=sc.get("fusion", False),
        delay_wgrad_compute=sc.get("delay", False),
    )
    layer = build_layer(sc["backend"], config, device)
    copy_weights(reference, layer)
    if sc.get("frozen_experts"):
        for module in (reference, layer):
            for name, param in module.named_parameters():
                if name.startswith("experts."):
                    param.requires_grad_(False)
    results = {
        "groupgrad": _train_layer(layer, config, sc, delay=sc.get("delay", False), dtype=dtype),
        "sequential": _train_layer(reference, reference.config, sc, delay=False, dtype=dtype),
    }
    if dtype != torch.float32:  # the fp64 truth both are measured against
        fp64 = build_layer("sequential", make_config(sc, torch.float64), device)
        copy_weights(reference, fp64)
        results["fp64"] = _train_layer(fp64, fp64.config, sc, delay=False, dtype=torch.float64)
    results["experts_type"] = type(layer.experts).__name__
    return results


def run_param_gather(sc: dict[str, Any]) -> dict[str, Any]:
    """Three ``DistributedOptimizer`` steps of one backend with Megatron's
    ``overlap_param_gather`` (and ``overlap_grad_reduce``) off, then on: each step's output.

    ``expert_buffers``: the experts' parameters in Megatron's expert-data-parallel
    buffers (``allreduce=False``, as expert parallelism sets them); ``bucket_size``:
    small buckets spread the experts over several. The optimizer's CUDA factories go
    to the CPU (``fp8_worker._optimizer_on_cpu``: this kind runs in a launch of its own).
    """
    import fp8_worker  # a sibling: the worker's folder is sys.path[0]
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    fp8_worker._optimizer_on_cpu()
    device = sc.get("device", "cpu")
    outputs: dict[str, Any] = {}
    for overlap in (False, True):
        setup_parallel(1)
        config = make_config(sc, torch.float32, gradient_accumulation_fusion=True)
        layer = build_layer(sc["backend"], config, device)
        setup_parallel(1)
        copy_weights(build_layer("sequential", make_config(sc, torch.float32), device), layer)
        if sc["expert_buffers"]:
            for name, param in layer.named_parameters():
                if name.startswith("experts."):
                    param.allreduce = False
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=True,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
            bucket_size=sc.get("bucket_size"),
        )
        ddp = DistributedDataParallel(config, ddp_config, layer)
        optimizer_config = OptimizerConfig(
            optimizer="adam", lr=0.05, use_distributed_optimizer=True, clip_grad=0.0
        )
        optimizer = get_megatron_optimizer(optimizer_config, [ddp])
        steps = []
        for step in range(3):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            x, dy = _data(sc, step, device)
            out, _ = ddp(x.requires_grad_())
            out.backward(dy)
            ddp.finish_grad_sync()
            optimizer.step()
            steps.append(out.detach().cpu())
        outputs["overlapped" if overlap else "plain"] = steps
    return outputs


# ---------------------------------------------------------------- checkpoints


def _expert_weights(layer: Any) -> dict[str, torch.Tensor]:
    return {
        sequential_name(n): p.detach().cpu().clone()
        for n, p in layer.named_parameters()
        if ".experts." in f".{n}" or n.startswith("router")
    }


def _save(layer: Any, path: Path) -> None:
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(layer.sharded_state_dict(prefix="mlp."), str(path))
    dist.barrier()


def _load(layer: Any, path: Path) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(layer.sharded_state_dict(prefix="mlp."), str(path))
    layer.load_state_dict({k.removeprefix("mlp."): v for k, v in loaded.items()}, strict=True)


def run_checkpoint(sc: dict[str, Any]) -> dict[str, Any]:
    """Save with each backend, load into the others; the weights each layer ends with.

    ``sc["backends"]`` (default: all three) are built with different weights
    (one RNG stream); every pair is saved by one and loaded by a fresh other.
    """
    setup_parallel(sc["ep"])
    backends = sc.get("backends", ["sequential", "fused", "unfused"])
    root = Path(sc["workdir"]) / sc["name"]
    device = sc.get("device", "cpu")
    config = make_config(sc, torch.float32)
    layers = {b: build_layer(b, config, device) for b in backends}
    with torch.no_grad():  # biases start at zero: give them values a lost load would show
        for layer in layers.values():
            for name, param in layer.named_parameters():
                if ".bias" in name:
                    param.normal_()
    saved = {}
    for name, layer in layers.items():
        saved[name] = _expert_weights(layer)
        _save(layer, root / name)
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for target in backends:
        for source in backends:
            if source != target:
                fresh = build_layer(target, make_config(sc, torch.float32), device)
                _load(fresh, root / source)
                loaded[f"{source}->{target}"] = _expert_weights(fresh)
    return {"saved": saved, "loaded": loaded}


# ---------------------------------------------------------------- layout


def _describe(entry: Any) -> list[dict[str, Any]]:
    """Checkpoint-level facts of one sharded entry (a factory is built first)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        parts = built if isinstance(built, list) else [built]
        return [fact for part in parts for fact in _describe(part)]
    common = {"key": entry.key, "replica_id": tuple(entry.replica_id)}
    if isinstance(entry, ShardedObject):
        return [
            {
                **common,
                "type": "object",
                "global_shape": tuple(entry.global_shape),
                "global_offset": tuple(entry.global_offset),
            }
        ]
    return [
        {
            **common,
            "type": "tensor",
            "local_shape": tuple(entry.local_shape),
            "global_shape": tuple(entry.global_shape),
            "global_offset": tuple(entry.global_offset),
            "axis_fragmentations": tuple(entry.axis_fragmentations),
            "data": entry.data.detach().cpu().clone(),
        }
    ]


def run_layout(sc: dict[str, Any]) -> dict[str, Any]:
    """Every backend's experts entries (default and singleton modes), state-dict key → facts."""
    setup_parallel(sc["ep"])
    config = make_config(sc, torch.float32)
    out: dict[str, Any] = {}
    for backend in ("sequential", "fused", "unfused"):
        layer = build_layer(backend, config, sc.get("device", "cpu"))
        for mode, metadata in (("default", None), ("singleton", {"singleton_local_shards": True})):
            entries = layer.sharded_state_dict(prefix="mlp.", metadata=metadata)
            out[f"{backend}/{mode}"] = {
                key: _describe(value)
                for key, value in entries.items()
                if key.startswith("mlp.experts.")
            }
        out[f"{backend}/weights"] = _expert_weights(layer)
    return out


# ---------------------------------------------------------------- init and attributes


def run_init(sc: dict[str, Any]) -> dict[str, Any]:
    """Which init method wrote which parameter; the Megatron attributes of every parameter."""
    setup_parallel(sc["ep"])
    calls: list[tuple[str, tuple[int, ...]]] = []

    def recording(tag: str, fill: float) -> Callable[[torch.Tensor], None]:
        def init(weight: torch.Tensor) -> None:
            calls.append((tag, tuple(weight.shape)))
            with torch.no_grad():
                weight.fill_(fill + len(calls))

        return init

    results: dict[str, Any] = {}
    for backend in ("fused", "unfused"):
        for cpu_init in (True, False):
            calls.clear()
            config = make_config(
                {**sc, "device": "cpu" if cpu_init else "device"},
                torch.float32,
                init_method=recording("fc1", 100.0),
                output_layer_init_method=recording("fc2", 200.0),
                delay_wgrad_compute=sc.get("delay", False),
            )
            layer = build_layer(backend, config, sc["device"])
            params = {
                sequential_name(n): {
                    "value": p.detach().cpu().clone(),
                    "allreduce": getattr(p, "allreduce", None),
                    "skip_backward_post_hook": getattr(p, "skip_backward_post_hook", False),
                    "tensor_model_parallel": getattr(p, "tensor_model_parallel", None),
                    "partition_dim": getattr(p, "partition_dim", None),
                    "dtype": str(p.dtype),
                }
                for n, p in layer.named_parameters()
                if n.startswith("experts.")
            }
            results[f"{backend}/{'cpu' if cpu_init else 'device'}"] = {
                "calls": list(calls),
                "params": params,
            }
    return results


# ---------------------------------------------------------------- refused setups


def _message(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def run_errors(sc: dict[str, Any]) -> dict[str, Any]:
    """Messages of the setups that must fail (``"no error"`` where none was raised)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    out: dict[str, str] = {}
    # expert tensor parallelism through the process groups (the config says 1, the groups 2)
    setup_parallel(ep=1, etp=2)
    for backend in ("fused", "unfused"):
        config = make_config({**sc, "ep": 1}, torch.float32)
        config.expert_tensor_parallel_size = 1
        out[f"etp_groups/{backend}"] = _message(
            lambda c=config, b=backend: build_layer(b, c, sc["device"])
        )
    # delayed wgrad under a DDP that does not hand its hooks to the layer
    setup_parallel(ep=2)
    for backend in ("fused", "unfused"):
        config = make_config({**sc, "ep": 2}, torch.float32, delay_wgrad_compute=True)
        layer = build_layer(backend, config, sc["device"])
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer
        )
        x, dy = _data(sc, 0, sc["device"])
        out_, _ = ddp(x.requires_grad_())
        out_.backward(dy)
        out[f"ddp_without_delay/{backend}"] = _message(layer.backward_dw)
        out[f"ddp_without_delay_wrote/{backend}"] = (
            ", ".join(_expert_grads_written(layer)) or "nothing"
        )
    # delayed wgrad under two DDPs wrapped around the same layer (a DDP rebuilt)
    for backend in ("fused", "unfused"):
        config = make_config({**sc, "ep": 2}, torch.float32, delay_wgrad_compute=True)
        layer = build_layer(backend, config, sc["device"])
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, delay_wgrad_compute=True
        )
        DistributedDataParallel(config, ddp_config, layer)
        ddp = DistributedDataParallel(config, ddp_config, layer)
        x, dy = _data(sc, 0, sc["device"])
        out_, _ = ddp(x.requires_grad_())
        out_.backward(dy)
        out[f"ddp_twice/{backend}"] = _message(layer.backward_dw)
        out[f"ddp_twice_wrote/{backend}"] = ", ".join(_expert_grads_written(layer)) or "nothing"
    return out


def _expert_grads_written(layer: Any) -> list[str]:
    """The expert parameters with a ``.grad`` or a non-zero ``main_grad``."""
    return [
        name
        for name, p in layer.named_parameters()
        if "experts" in name
        and (p.grad is not None or bool(getattr(p, "main_grad", torch.zeros(1)).any()))
    ]


def run_atomics(sc: dict[str, Any]) -> dict[str, Any]:
    """Per backend (the unfused with biases), the ops one forward and backward of the layer's
    experts dispatch whose CUDA kernels add atomically (``groupgrad_testsupport.atomic_ops``)."""
    from groupgrad_testsupport import atomic_ops

    setup_parallel(sc["ep"])
    dtype, device = getattr(torch, sc["dtype"]), sc.get("device", "cpu")
    found: dict[str, Any] = {}
    for backend in ("fused", "unfused"):
        config = make_config({**sc, "bias": backend == "unfused"}, dtype)
        experts = build_layer(backend, config, device).experts
        counts = torch.arange(experts.num_local_experts) * 2  # expert 0 gets no token
        gen = torch.Generator().manual_seed(SEED)
        rows = int(counts.sum())
        x = torch.randn(rows, SHAPE["hidden"], generator=gen).to(device, dtype).requires_grad_()
        probs = torch.rand(rows, generator=gen).to(device).requires_grad_()

        def step() -> None:
            y, _ = experts(x, counts, probs)  # noqa: B023 (called at once)
            y.float().square().sum().backward()

        found[backend] = sorted(atomic_ops(step))
        found[f"{backend}/grads"] = all(
            p.grad is not None or getattr(p, "main_grad", None) is not None
            for p in experts.parameters()
        )
    return found


RUNNERS = {
    "atomics": run_atomics,
    "layer": run_layer,
    "checkpoint": run_checkpoint,
    "layout": run_layout,
    "init": run_init,
    "errors": run_errors,
    "param_gather": run_param_gather,
}


def run_scenario(scenario: dict[str, Any], rank: Any) -> dict[str, Any]:
    """One scenario on this rank (``rank``: the launch's ``groupgrad_testsupport.Rank``)."""
    where = {"device": rank.device.type, "workdir": str(rank.workdir / "checkpoints")}
    return RUNNERS[scenario["kind"]]({**scenario, **where})


def install_cpu_shim(rank: Any) -> None:
    """On CPU launches, the test-only shim for Megatron-Core's hard-coded CUDA calls."""
    if rank.device.type == "cpu":
        import cpu_shim  # a sibling: the worker's folder is sys.path[0]

        cpu_shim.install()


if __name__ == "__main__":
    from groupgrad_testsupport import run_worker

    run_worker(run_scenario, setup=install_cpu_shim)
