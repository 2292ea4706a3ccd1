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
  its fc1 / fc2 slots, ``gradient_accumulation_fusion`` on;
* ``groupgrad_fused_fp8``: the fused experts with ``config.fp8="e4m3"``,
  ``config.fp8_recipe="blockwise"`` (blockwise FP8 GEMMs, wgrads into the
  fp32 ``main_grad``), every step quantizing the weights afresh — the first
  micro-batch after an optimizer step (Megatron's schedule sets the experts'
  ``is_first_microbatch``), i.e. one micro-batch per step;
* ``groupgrad_fused_fp8_cached``: the same layer, its weights served from the
  FP8 cache (``is_first_microbatch=False``: the later micro-batches of a step).

The FP8 backends run only where ``H`` and ``F`` are multiples of 128
(blockwise FP8's blocks); elsewhere the row says why in ``fp8_skipped``.

Timed per backend, in interleaved rounds (CUDA events, warm-up, median):
``layer`` — one training step of the MoE layer (zero the grad buffers,
forward, backward, DDP's gradient sync), and ``experts`` — forward + backward
of the experts module alone on the tokens the dispatcher produced. Reported:
the ratios ``sequential / groupgrad_fused`` and ``sequential / groupgrad``
(measured in the same run), TFLOP/s of the experts (``18·T·H·F`` FLOPs per
step over the routed tokens ``T``), and the largest relative difference of
each backend's layer output and input gradient against ``sequential``. For
FP8: ``fp8_vs_bf16_fused`` (bf16 ``groupgrad_fused``'s time over each FP8
backend's, ``layer`` and ``experts``), and for every backend
``outside_experts_share`` = (``layer`` − ``experts``) / ``layer``: the share
of the step spent outside the experts' forward + backward (router,
permutation, dispatch, combine, DDP's buffer zeroing and sync) — the
non-GEMM part of the layer beyond the experts' own SwiGLU and quantization
kernels. Tables and plot: ``megatron_moe_report.py``.

Usage (H200, megatron-core 0.19)::

    python benchmarks/bench_megatron_moe.py --out benchmarks/results

``--smoke``: tiny shapes on the CPU (the test-only CUDA shim of
``integrations/megatron_core/tests/cpu_shim.py``; ``perf_counter`` timings,
not meaningful; FP8 through groupgrad's reference kernels, in the first shape
only) — what the CPU test runs. ``--out DIR`` writes
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
import megatron_moe_report as report
import results_files

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "integrations" / "megatron_core" / "tests" / "cpu_shim.py"
FP8 = "groupgrad_fused_fp8"
FP8_CACHED = "groupgrad_fused_fp8_cached"  # FP8's layer, weights from its FP8 cache
BACKENDS = ("sequential", "groupgrad_fused", "groupgrad", FP8)  # one layer each
FP8_BLOCK = 128
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
    Shape("E4 smoke", E=4, H=128, F=128, k=2, S=12),  # FP8 on the reference kernels
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


def fp8_skipped(shape: Shape) -> str | None:
    """Why the FP8 backends skip ``shape`` (``None``: they run it)."""
    if shape.H % FP8_BLOCK or shape.F % FP8_BLOCK:
        return (
            f"FP8 skipped: H={shape.H}, F={shape.F}; blockwise FP8 needs multiples of {FP8_BLOCK}"
        )
    return None


def make_config(shape: Shape, backend: str, device: torch.device) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = TransformerConfig(
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
    if backend == FP8:
        # Set after construction: TransformerConfig's own checks demand Transformer Engine for
        # any MoE config with fp8; the fused experts read both fields when they are built.
        config.fp8, config.fp8_recipe = "e4m3", "blockwise"
    return config


def build_layer(shape: Shape, backend: str, device: torch.device) -> Any:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from groupgrad.integrations.megatron_core import get_moe_module_groupgrad_spec

    config = make_config(shape, backend, device)
    if backend == "sequential":
        spec = get_moe_module_spec(use_te=False, num_experts=shape.E, moe_grouped_gemm=False)
    else:
        spec = get_moe_module_groupgrad_spec(shape.E, fused=backend != "groupgrad")
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
    """One backend's layer in Megatron DDP, with its timed steps.

    ``first_microbatch`` (FP8 only) is set as the experts' ``is_first_microbatch``
    before each forward, as Megatron's schedule does: ``True`` quantizes the
    weights afresh, ``False`` serves them from the FP8 cache.
    """

    layer: Any
    ddp: Any
    inputs: list[tuple[torch.Tensor, torch.Tensor]]
    expert_inputs: list[tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]]
    first_microbatch: bool | None = None

    def _mark_microbatch(self) -> None:
        if self.first_microbatch is not None:
            self.layer.experts.is_first_microbatch = self.first_microbatch

    def layer_step(self, i: int) -> torch.Tensor:
        """One training step of the MoE layer: zero grads, forward, backward, gradient sync."""
        x, dy = self.inputs[i]
        self.ddp.zero_grad_buffer()
        x.grad = None
        self._mark_microbatch()
        out, _ = self.ddp(x)
        out.backward(dy)
        self.ddp.finish_grad_sync()
        return out

    def experts_step(self, i: int) -> torch.Tensor:
        """Forward + backward of the experts module alone on dispatched tokens."""
        x, tokens_per_expert, probs, dy = self.expert_inputs[i]
        self._mark_microbatch()
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
    """Every backend's runner (without FP8 where :func:`fp8_skipped`), sharing weights and inputs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    backends = [b for b in BACKENDS if b != FP8 or fp8_skipped(shape) is None]
    layers = {b: build_layer(shape, b, device) for b in backends}
    for backend in backends[1:]:
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
    if FP8 in runners:
        fresh = runners[FP8]
        fresh.first_microbatch = True
        runners[FP8_CACHED] = dataclasses.replace(fresh, first_microbatch=False)
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
    others = [b for b in runners if b != "sequential"]
    row = {
        **dataclasses.asdict(shape),
        "routed_tokens": routed,
        "layer_ms": layer_ms,
        "experts_ms": experts_ms,
        "experts_tflops": {b: flops / (ms * 1e9) for b, ms in experts_ms.items()},
        "speedup_layer": {b: layer_ms["sequential"] / layer_ms[b] for b in others},
        "speedup_experts": {b: experts_ms["sequential"] / experts_ms[b] for b in others},
        "outside_experts_share": {b: (layer_ms[b] - experts_ms[b]) / layer_ms[b] for b in runners},
        "rel_diff_vs_sequential": {
            b: {
                "output": rel_diff(outputs[b][0], ref_out),
                "input_grad": rel_diff(outputs[b][1], ref_dx),
            }
            for b in others
        },
    }
    skipped = fp8_skipped(shape)
    if skipped is not None:
        return {**row, "fp8_skipped": skipped}
    bf16 = "groupgrad_fused"
    row["fp8_vs_bf16_fused"] = {
        b: {"layer": layer_ms[bf16] / layer_ms[b], "experts": experts_ms[bf16] / experts_ms[b]}
        for b in (FP8, FP8_CACHED)
    }
    return row


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
        print(report.one_line(row), flush=True)
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
    print(report.markdown_table(result))
    dist.destroy_process_group()
    if args.out is not None:
        stem = results_files.gpu_stem("megatron_moe_", result["gpu"])
        if not results_files.write_results(args.out, stem, result, report.plot):
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
