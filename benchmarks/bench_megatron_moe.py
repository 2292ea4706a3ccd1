"""Benchmark Megatron-Core's MoE layer with groupgrad experts against its SequentialMLP, on one GPU.

For each shape, one Megatron-Core ``MoELayer`` per expert backend, all with
the same weights (copied from the ``SequentialMLP`` layer) and the same
router, each wrapped in Megatron's ``DistributedDataParallel`` with fp32
gradient buffers, run on the same random bf16 inputs (two input sets,
rotated between calls):

* ``sequential``: Megatron's ``SequentialMLP`` (its experts without
  Transformer Engine: one MLP per expert in a Python loop);
  ``gradient_accumulation_fusion`` off (it needs APEX): DDP's hook adds each
  wgrad into ``main_grad``;
* ``groupgrad_fused``: :class:`GroupgradFusedExperts` (fc1 → SwiGLU × probs →
  fc2 fused), ``gradient_accumulation_fusion`` on: wgrads straight into
  ``main_grad`` from the GEMM epilogue;
* ``groupgrad``: Megatron's ``TEGroupedMLP`` with groupgrad grouped linears in
  its fc1 / fc2 slots, ``gradient_accumulation_fusion`` on.

Timed per backend, in interleaved rounds (CUDA events, warm-up, median):
``layer`` — one training step of the MoE layer (zero the grad buffers,
forward, backward, DDP's gradient sync), and ``experts`` — forward + backward
of the experts module alone on the tokens the dispatcher produced. Reported:
the ratios ``sequential / groupgrad_fused`` and ``sequential / groupgrad``
(measured in the same run), TFLOP/s of the experts (``18·T·H·F`` FLOPs per
step over the routed tokens ``T``), and the largest relative difference of
each backend's layer output and input gradient against ``sequential``.

Usage (H200, megatron-core 0.19)::

    python benchmarks/bench_megatron_moe.py --out benchmarks/results

``--smoke``: tiny shapes on the CPU (the test-only CUDA shim of
``integrations/megatron_core/tests/cpu_shim.py``; ``perf_counter`` timings,
not meaningful) — what the CPU test runs. ``--out DIR`` writes
``megatron_moe_<gpu>.json`` and ``.png``.

Legend: ``E`` experts, ``H`` hidden size, ``F`` expert ffn hidden size,
``k`` router top-k, ``S`` tokens per step, ``T = S·k`` routed tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import runpy
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
import kernels_timing as kt  # interleaved CUDA-event timing shared with the other benchmarks
import results_files

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "integrations" / "megatron_core" / "tests" / "cpu_shim.py"
BACKENDS = ("sequential", "groupgrad_fused", "groupgrad")
N_SETS = 2


@dataclasses.dataclass(frozen=True)
class Shape:
    """One MoE layer shape: ``E`` experts of width ``F`` on ``H``, top-``k`` of ``S`` tokens."""

    name: str
    E: int
    H: int
    F: int
    k: int
    S: int


SHAPES = [
    Shape("E8 (Mixtral-8x7B-like)", E=8, H=4096, F=14336, k=2, S=4096),
    Shape("E128 (Qwen3-30B-A3B-like)", E=128, H=2048, F=768, k=8, S=4096),
]
SMOKE_SHAPES = [
    Shape("E4 smoke", E=4, H=16, F=8, k=2, S=12),
    Shape("E16 smoke", E=16, H=8, F=4, k=4, S=8),
]


def load_cpu_shim() -> None:
    """Install the test-only CUDA shim (CPU smoke mode only)."""
    runpy.run_path(str(SHIM))["install"]()  # a file by its path, not an importable module


def setup(device: torch.device) -> None:
    """A one-rank process group and Megatron's parallel state (EP = 1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    init_file = Path(tempfile.mkdtemp()) / "init"
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=0,
        world_size=1,
    )
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def make_config(shape: Shape, backend: str, device: torch.device) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return TransformerConfig(
        num_layers=1,
        hidden_size=shape.H,
        ffn_hidden_size=shape.F,
        num_attention_heads=8,
        num_moe_experts=shape.E,
        moe_ffn_hidden_size=shape.F,
        moe_router_topk=shape.k,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
        gradient_accumulation_fusion=backend != "sequential",
    )


def build_layer(shape: Shape, backend: str, device: torch.device) -> Any:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from groupgrad.integrations.megatron_core import get_moe_module_groupgrad_spec

    config = make_config(shape, backend, device)
    if backend == "sequential":
        spec = get_moe_module_spec(use_te=False, num_experts=shape.E, moe_grouped_gemm=False)
    else:
        spec = get_moe_module_groupgrad_spec(shape.E, fused=backend == "groupgrad_fused")
    if isinstance(spec, ModuleSpec):  # megatron-core 0.16
        return build_module(spec, config=config).to(device)
    return spec(config=config, pg_collection=None).to(device)  # 0.19: a builder


def copy_from_sequential(sequential: Any, layer: Any) -> None:
    """Give ``layer`` the router and expert weights of the ``SequentialMLP`` layer."""
    with torch.no_grad():
        layer.router.weight.copy_(sequential.router.weight)
        experts = layer.experts
        for e, mlp in enumerate(sequential.experts.local_experts):
            for fc in ("fc1", "fc2"):
                owner = getattr(experts, "grouped_mlp", None)
                target = (
                    getattr(owner, fc) if owner is not None else getattr(experts, f"linear_{fc}")
                )
                getattr(target, f"weight{e}").copy_(getattr(mlp, f"linear_{fc}").weight)


@dataclasses.dataclass
class Runner:
    """One backend's layer in Megatron DDP, with its timed steps."""

    layer: Any
    ddp: Any
    inputs: list[tuple[torch.Tensor, torch.Tensor]]
    expert_inputs: list[tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]]

    def layer_step(self, i: int) -> torch.Tensor:
        """One training step of the MoE layer: zero grads, forward, backward, gradient sync."""
        x, dy = self.inputs[i]
        self.ddp.zero_grad_buffer()
        x.grad = None
        out, _ = self.ddp(x)
        out.backward(dy)
        self.ddp.finish_grad_sync()
        return out

    def experts_step(self, i: int) -> torch.Tensor:
        """Forward + backward of the experts module alone on dispatched tokens."""
        x, tokens_per_expert, probs, dy = self.expert_inputs[i]
        out, _ = self.layer.experts(x, tokens_per_expert, probs)
        out.backward(dy)
        return out


def dispatched(layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """The experts' inputs for ``x``: the layer's own routing and dispatch, without autograd."""
    with torch.no_grad():
        probs, routing_map = layer.route(x)
        hidden, probs = layer.preprocess(x, probs, routing_map)
        hidden, probs = layer.dispatch(hidden, probs)
        out = layer.token_dispatcher.dispatch_postprocess(hidden, probs)
    tokens, tokens_per_expert, permuted_probs = out
    return tokens.detach().requires_grad_(), tokens_per_expert, permuted_probs.detach()


def make_runners(shape: Shape, device: torch.device) -> dict[str, Runner]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    layers = {b: build_layer(shape, b, device) for b in BACKENDS}
    for backend in BACKENDS[1:]:
        copy_from_sequential(layers["sequential"], layers[backend])
    dtype = layers["sequential"].config.params_dtype
    gen = torch.Generator(device=device).manual_seed(1)
    inputs = [
        (
            torch.randn(
                shape.S, 1, shape.H, device=device, dtype=dtype, generator=gen
            ).requires_grad_(),
            torch.randn(shape.S, 1, shape.H, device=device, dtype=dtype, generator=gen),
        )
        for _ in range(N_SETS)
    ]
    runners = {}
    for backend, layer in layers.items():
        expert_inputs = []
        for x, _ in inputs:
            tokens, counts, probs = dispatched(layer, x.detach())
            dy = torch.randn(tokens.shape, device=device, dtype=dtype, generator=gen)
            expert_inputs.append((tokens, counts, probs, dy))
        ddp = DistributedDataParallel(
            layer.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer
        )
        runners[backend] = Runner(layer, ddp, inputs, expert_inputs)
    return runners


def timed(
    fns: dict[str, Callable[[int], object]], device: torch.device, rounds: int
) -> dict[str, float]:
    """Median ms of each function: interleaved CUDA-event rounds on a GPU, perf_counter on CPU."""
    if device.type == "cuda":
        return kt.interleaved_ms(fns, N_SETS, rounds=rounds, per_round=3)
    return {name: kt.median_ms_cpu(fn, N_SETS, reps=rounds, warmup=1) for name, fn in fns.items()}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def bench_shape(shape: Shape, device: torch.device, rounds: int) -> dict:
    runners = make_runners(shape, device)
    outputs = {}
    for backend, runner in runners.items():  # correctness first, on input set 0
        out = runner.layer_step(0)
        outputs[backend] = (out.detach().clone(), runner.inputs[0][0].grad.clone())
    layer_ms = timed({b: r.layer_step for b, r in runners.items()}, device, rounds)
    experts_ms = timed({b: r.experts_step for b, r in runners.items()}, device, rounds)
    routed = int(sum(int(c) for c in runners["sequential"].expert_inputs[0][1]))
    flops = 18 * routed * shape.H * shape.F
    ref_out, ref_dx = outputs["sequential"]
    return {
        **dataclasses.asdict(shape),
        "routed_tokens": routed,
        "layer_ms": layer_ms,
        "experts_ms": experts_ms,
        "experts_tflops": {b: flops / (ms * 1e9) for b, ms in experts_ms.items()},
        "speedup_layer": {b: layer_ms["sequential"] / layer_ms[b] for b in BACKENDS[1:]},
        "speedup_experts": {b: experts_ms["sequential"] / experts_ms[b] for b in BACKENDS[1:]},
        "rel_diff_vs_sequential": {
            b: {
                "output": rel_diff(outputs[b][0], ref_out),
                "input_grad": rel_diff(outputs[b][1], ref_dx),
            }
            for b in BACKENDS[1:]
        },
    }


def one_line(row: dict) -> str:
    s = row["speedup_layer"]
    e = row["speedup_experts"]
    return (
        f"{row['name']}: layer step sequential {row['layer_ms']['sequential']:.3f} ms, "
        f"groupgrad_fused {row['layer_ms']['groupgrad_fused']:.3f} ms ({s['groupgrad_fused']:.2f}x), "
        f"groupgrad {row['layer_ms']['groupgrad']:.3f} ms ({s['groupgrad']:.2f}x); experts alone "
        f"{e['groupgrad_fused']:.2f}x / {e['groupgrad']:.2f}x"
    )


def markdown_table(result: dict) -> str:
    lines = [
        f"MoE layer step, {result['gpu']}, megatron-core {result['megatron_core']}, torch {result['torch']}",
        "",
        "| shape (E, H, F, top-k, tokens) | sequential ms | groupgrad_fused ms (×) | groupgrad ms (×) "
        "| experts alone: fused × / unfused × | experts TFLOP/s fused / seq |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        t, s, e, tf = (
            row["layer_ms"],
            row["speedup_layer"],
            row["speedup_experts"],
            row["experts_tflops"],
        )
        lines.append(
            f"| {row['E']}, {row['H']}, {row['F']}, {row['k']}, {row['S']} | {t['sequential']:.3f} | "
            f"{t['groupgrad_fused']:.3f} ({s['groupgrad_fused']:.2f}×) | {t['groupgrad']:.3f} "
            f"({s['groupgrad']:.2f}×) | {e['groupgrad_fused']:.2f}× / {e['groupgrad']:.2f}× | "
            f"{tf['groupgrad_fused']:.0f} / {tf['sequential']:.0f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Speed-ups over ``SequentialMLP``: whole layer step and experts alone, per shape."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = result["rows"]
    labels = [r["name"] for r in rows]
    xs = range(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(4 + 2.5 * len(rows), 4.2))
    width = 0.38
    for ax, key, title in zip(
        axes, ("speedup_layer", "speedup_experts"), ("MoE layer step", "experts alone"), strict=True
    ):
        ax.bar(
            [x - width / 2 for x in xs],
            [r[key]["groupgrad_fused"] for r in rows],
            width,
            label="groupgrad fused",
        )
        ax.bar(
            [x + width / 2 for x in xs],
            [r[key]["groupgrad"] for r in rows],
            width,
            label="groupgrad grouped linears",
        )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{title}: speed-up vs SequentialMLP")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Megatron-Core MoE layer, {result['gpu']}, megatron-core {result['megatron_core']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write JSON + PNG into this folder")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (not timings)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (10)")
    parser.add_argument("--shapes", type=str, default="", help="indices into SHAPES, e.g. 1")
    args = parser.parse_args(argv)

    if args.smoke:
        device = torch.device("cpu")
        load_cpu_shim()
    elif not torch.cuda.is_available():
        raise SystemExit("bench_megatron_moe.py needs a CUDA GPU (CPU smoke test: --smoke)")
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    setup(device)
    import megatron.core.package_info as megatron_info

    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    rounds = args.rounds or (2 if args.smoke else 10)
    rows = []
    for shape in shapes:
        row = bench_shape(shape, device, rounds)
        rows.append(row)
        print(one_line(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "megatron_core": megatron_info.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rounds": rounds,
        "n_sets": N_SETS,
        "rows": rows,
    }
    print(markdown_table(result))
    dist.destroy_process_group()
    if args.out is not None:
        stem = results_files.gpu_stem("megatron_moe_", result["gpu"])
        if not results_files.write_results(args.out, stem, result, plot):
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
