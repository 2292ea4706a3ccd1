"""Benchmark a Hugging Face Qwen3-MoE layer's experts: groupgrad vs transformers' grouped_mm and eager.

One MoE layer of Qwen3-30B-A3B's size (E = 128 experts, hidden H = 2048,
expert width F = 768, top-8, T = 16384 tokens: S = T·8 = 131072 routed rows),
bf16 weights, forward + backward of the experts module of a real
``Qwen3MoeForCausalLM`` (one layer, small vocabulary), switched with
``model.set_experts_implementation(name)`` between:

* ``groupgrad`` (this repository, ``groupgrad.integrations.transformers``);
* ``groupgrad_fp8``: the same experts with blockwise FP8 GEMMs
  (``fp8_recipe="blockwise"``: weights quantized in every forward, wgrads
  into the fp32 ``.grad`` where ``grad_dtype`` is fp32); only where ``H`` and
  ``F`` are multiples of 128 (else the row says why in ``fp8_skipped``);
  ``--skip-fp8`` leaves it out;
* ``groupgrad_unrouted``: groupgrad's previous route for these experts
  (gather, ``grouped_mlp``, combine as three steps; defined here), to show
  what the one routed op changes;
* ``grouped_mm``: transformers' own ``torch.nn.functional.grouped_mm`` path
  (its default on GPUs);
* ``eager``: transformers' per-expert loop.

Each runs with the model's default bf16 ``.grad`` and again with
``grad_dtype = torch.float32`` on the expert weights (groupgrad writes the
fp32 wgrad from the GEMM epilogue; the others compute it in bf16 and
autograd upcasts it). Reported: median ms of forward+backward (CUDA events,
warm-up, interleaved rounds, two rotated input sets), TFLOP/s
(``18·S·H·F`` FLOPs), peak memory of one step, ratios against groupgrad
measured in the same run (for ``groupgrad_fp8``: FP8's time over bf16's),
and groupgrad's and groupgrad_fp8's errors against grouped_mm.

Routing (fixed seed 0, the same for every implementation): expert popularity
``p = softmax(z)``, ``z ~ N(0, σ²)`` per expert (log-normal shares; σ = 1
is the skew of earlier runs, 0.5 lighter, 2 heavier); each
token's logits are ``log p + Gumbel noise``, its top-8 are its experts (8
distinct experts drawn without replacement ∝ ``p``), and its router weights
are the softmax of those 8 logits (``norm_topk_prob``). The JSON records the
resulting tokens per expert (min / median / max, coefficient of variation).

The default run sweeps T ∈ {4096, 16384} × σ ∈ {0.5, 1, 2} × gradient
checkpointing off / on (``torch.utils.checkpoint``, non-reentrant, around the
experts call: the peak then includes the recomputed forward); transformers'
eager loop runs only in the σ = 1 rows without checkpointing (it is slow).
Peak memory (``max_memory_allocated`` during one forward + backward minus
``memory_allocated`` just before it, grads cleared before) is reported beside
the time for every row.

FSDP2 variant (``torchrun --nproc-per-node 2 benchmarks/bench_hf_moe.py
--fsdp``): one Qwen3-30B-A3B-sized decoder layer (attention + MoE, T tokens
per rank as 8 sequences) sharded per layer and at the root, fp32 master
weights, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=…)``;
forward + backward step time (median, synchronized wall clock, which
includes the reduce-scatter) and bytes reduce-scattered per step for:
groupgrad experts under ``groupgrad.integrations.fsdp2.fully_shard``
(fp32 wgrads → fp32 reduce-scatter), the same experts under plain
``fully_shard`` (bf16 wgrads upcast → fp32 reduce-scatter; bf16 → bf16
reduce-scatter), and transformers' grouped_mm experts under plain
``fully_shard`` (fp32 reduce-scatter).

``--out DIR`` writes ``hf_moe_<gpu>.json`` / ``.png`` (``hf_moe_fsdp2_<gpu>.*``
with ``--fsdp``). ``--smoke`` runs a tiny size on any device (CPU timings are
perf_counter and meaningless; it checks that the script works).

Usage (H200; prebuild the CUTLASS kernels first with ``python -m
groupgrad.kernels.build`` so no warm-up call compiles):
``python benchmarks/bench_hf_moe.py --out benchmarks/results`` and
``torchrun --nproc-per-node 2 benchmarks/bench_hf_moe.py --fsdp --out
benchmarks/results``. Any fallback to groupgrad's reference path on a GPU is
printed, recorded in the JSON and makes the exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.moe import ExpertsInterface

sys.path.insert(0, str(Path(__file__).parent))
import hf_moe_report as report
import kernels_timing as kt  # the peak-memory measurement shared with bench_mlp.py
import results_files

import groupgrad.integrations.transformers  # noqa: F401  (registers "groupgrad", "groupgrad_fp8")
from groupgrad.modules import grouped_mlp

FP8 = "groupgrad_fp8"
IMPLEMENTATIONS = ("groupgrad", FP8, "groupgrad_unrouted", "grouped_mm", "eager")
FP8_BLOCK = 128


def unrouted_experts_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """groupgrad's experts before ``routed_grouped_mlp``: gather, ``grouped_mlp``, combine.

    The previous route of the fused experts (public API only), timed beside
    the current one: what the routed op changes in time and peak memory.
    """
    tokens, top_k = top_k_index.shape
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    if sorted_ids.device.type == "cuda":
        splits = torch.histc(
            sorted_ids.int(), bins=self.num_experts, min=0, max=self.num_experts - 1
        )
    else:
        splits = torch.bincount(sorted_ids, minlength=self.num_experts)
    probs = top_k_weights.reshape(-1)[perm]
    y = grouped_mlp(hidden_states[perm // top_k], self.gate_up_proj, self.down_proj, splits, probs)
    y = torch.where((sorted_ids < self.num_experts).unsqueeze(-1), y, 0)
    unsorted = torch.empty_like(y).index_copy(0, perm, y)
    return unsorted.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(hidden_states.dtype)


ExpertsInterface.register("groupgrad_unrouted", unrouted_experts_forward)


class _Fallbacks(logging.Handler):
    """Collects groupgrad's warnings (work that fell back to the reference path) during the run."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.messages:
            self.messages.append(message)
            print(f"!! FALLBACK: {message}", flush=True)


GRAD_DTYPES = {"bf16_grad": None, "fp32_grad": torch.float32}
N_SETS = 2


@dataclass(frozen=True)
class Shape:
    """One MoE layer: ``E`` experts of width ``F``, hidden ``H``, top-``k``, ``T`` tokens."""

    E: int
    H: int
    F: int
    k: int
    T: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs of the experts: three GEMMs of ``2·S·H·2F`` / ``2·S·F·H`` each way."""
        return 18.0 * self.T * self.k * self.H * self.F


QWEN3_30B_A3B = Shape(E=128, H=2048, F=768, k=8, T=16384, heads=32, kv_heads=4, head_dim=128)
SMOKE = Shape(E=8, H=128, F=128, k=2, T=128, heads=4, kv_heads=2, head_dim=16)  # FP8: ×128


def fp8_skipped(shape: Shape) -> str | None:
    """Why ``groupgrad_fp8`` skips ``shape`` (``None``: it runs)."""
    if shape.H % FP8_BLOCK or shape.F % FP8_BLOCK:
        return (
            f"FP8 skipped: H={shape.H}, F={shape.F}; blockwise FP8 needs multiples of {FP8_BLOCK}"
        )
    return None


def qwen3_moe(shape: Shape, device: torch.device, dtype: torch.dtype) -> Qwen3MoeForCausalLM:
    """A one-layer Qwen3-MoE of ``shape`` (vocabulary 1024), random init, on ``device``."""
    config = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=shape.H,
        intermediate_size=3 * shape.H,
        moe_intermediate_size=shape.F,
        num_hidden_layers=1,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_experts=shape.E,
        num_experts_per_tok=shape.k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    return model.to(dtype)


def skewed_routing(
    shape: Shape, seed: int, device: torch.device, sigma: float = 1.0
) -> tuple[Tensor, Tensor, dict]:
    """``(top_k_index, top_k_weights, stats)``: Gumbel-top-k over log-normal expert popularity.

    ``sigma`` is the spread of the popularity logits (larger: heavier skew).
    """
    generator = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(sigma * torch.randn(shape.E, generator=generator), dim=0)
    uniform = torch.rand(shape.T, shape.E, generator=generator).clamp_min(1e-12)
    logits = log_p + (-torch.log(-torch.log(uniform)))
    top_logits, index = logits.topk(shape.k, dim=-1)
    weights = torch.softmax(top_logits, dim=-1)
    counts = torch.bincount(index.flatten(), minlength=shape.E).double()
    stats = {
        "tokens_per_expert_min": int(counts.min()),
        "tokens_per_expert_median": float(counts.median()),
        "tokens_per_expert_max": int(counts.max()),
        "tokens_per_expert_cv": float(counts.std() / counts.mean()),
        "experts_without_tokens": int((counts == 0).sum()),
    }
    return index.to(device), weights.to(device), stats


def clear_grads(module: nn.Module) -> None:
    for param in module.parameters():
        param.grad = None


def set_grad_dtype(experts: nn.Module, dtype: torch.dtype | None) -> None:
    """``grad_dtype`` of the expert weights: ``dtype``, or the weights' own (``None``)."""
    for param in experts.parameters():
        param.grad_dtype = dtype if dtype is not None else param.dtype


def timed_rounds(
    fns: dict[str, Callable[[int], object]],
    prepare: Callable[[str], None],
    device: torch.device,
    rounds: int,
    per_round: int,
    warmup: int,
) -> dict[str, float]:
    """Median ms per function, interleaved rounds (each round starts at another function).

    ``prepare(name)`` runs before each call, outside the timed region
    (switching the implementation and ``grad_dtype``). CUDA events on a GPU,
    ``perf_counter`` elsewhere.
    """
    names = list(fns)
    for name in names:
        prepare(name)
        for i in range(warmup):
            fns[name](i % N_SETS)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    samples: dict[str, list] = {name: [] for name in names}
    call = 0
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            prepare(name)
            for _ in range(per_round):
                if cuda:
                    start, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    start.record()
                    fns[name](call % N_SETS)
                    end.record()
                    samples[name].append((start, end))
                else:
                    begin = time.perf_counter()
                    fns[name](call % N_SETS)
                    samples[name].append((time.perf_counter() - begin) * 1e3)
                call += 1
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return {n: statistics.median(s.elapsed_time(e) for s, e in samples[n]) for n in names}
    return {n: statistics.median(samples[n]) for n in names}


def peak_bytes(fn: Callable[[int], object], device: torch.device) -> int | None:
    """Memory one call allocates beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    return kt.peak_bytes(fn, N_SETS)


def rel_err(ours: Tensor, ref: Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def bench_experts(
    shape: Shape,
    device: torch.device,
    args: argparse.Namespace,
    sigma: float = 1.0,
    checkpointed: bool = False,
    with_eager: bool = True,
) -> dict:
    """One row of the single-device comparison: the implementations × 2 gradient dtypes."""
    model = qwen3_moe(shape, device, torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(1)
    hidden = [
        (0.5 * torch.randn(shape.T, shape.H, generator=generator)).to(device, torch.bfloat16)
        for _ in range(N_SETS)
    ]
    dys = [
        torch.randn(shape.T, shape.H, generator=generator).to(device, torch.bfloat16)
        for _ in range(N_SETS)
    ]
    routes = [skewed_routing(shape, seed, device, sigma) for seed in range(N_SETS)]

    def step(i: int) -> Tensor:
        x = hidden[i].detach().requires_grad_(True)
        weights = routes[i][1].to(torch.bfloat16).requires_grad_(True)
        if checkpointed:
            out = checkpoint(experts, x, routes[i][0], weights, use_reentrant=False)
        else:
            out = experts(x, routes[i][0], weights)
        out.backward(dys[i])
        clear_grads(experts)
        return out

    left_out = set()
    if args.skip_eager or not with_eager:
        left_out.add("eager")
    fp8_note = "FP8 skipped: --skip-fp8" if args.skip_fp8 else fp8_skipped(shape)
    if fp8_note is not None:
        left_out.add(FP8)
    variants = {
        f"{impl}/{grad}": step
        for impl in IMPLEMENTATIONS
        if impl not in left_out
        for grad in GRAD_DTYPES
    }

    def prepare(name: str) -> None:
        impl, grad = name.split("/")
        model.set_experts_implementation(impl)
        set_grad_dtype(experts, GRAD_DTYPES[grad])

    times = timed_rounds(variants, prepare, device, args.rounds, args.per_round, args.warmup)
    peaks = {}
    for name, fn in variants.items():
        prepare(name)
        peaks[name] = peak_bytes(fn, device)
    errors = cross_check(model, experts, hidden[0], routes[0], dys[0], fp8_note is None)
    ratios = {
        name: times[name] / times[f"groupgrad/{name.split('/')[1]}"]
        for name in times
        if name.split("/")[0] != "groupgrad"
    }
    row = {
        "shape": asdict(shape),
        "sigma": sigma,
        "checkpointing": checkpointed,
        "routing": routes[0][2],
        "times_ms": times,
        "tflops": {name: shape.flops / (ms * 1e-3) / 1e12 for name, ms in times.items()},
        "peak_bytes": peaks,
        "ratio_vs_groupgrad": ratios,
        "rel_err_groupgrad_vs_grouped_mm": errors["groupgrad"],
    }
    if fp8_note is not None:
        return {**row, "fp8_skipped": fp8_note}
    return {**row, "rel_err_groupgrad_fp8_vs_grouped_mm": errors[FP8]}


def cross_check(
    model: nn.Module, experts: nn.Module, x: Tensor, route: tuple, dy: Tensor, fp8: bool
) -> dict:
    """groupgrad (and groupgrad_fp8) against grouped_mm on one input set: output and wgrads.

    Returns:
        Per groupgrad implementation, the relative error (norm) of the
        output and each weight gradient (fp32 ``grad_dtype``).
    """
    results = {}
    for impl in ("groupgrad", *((FP8,) if fp8 else ()), "grouped_mm"):
        model.set_experts_implementation(impl)
        set_grad_dtype(experts, torch.float32)
        out = experts(x, route[0], route[1].to(torch.bfloat16))
        out.backward(dy)
        results[impl] = {"out": out.detach()} | {
            f"d_{n}": p.grad.detach().clone() for n, p in experts.named_parameters()
        }
        clear_grads(experts)
    set_grad_dtype(experts, None)
    theirs = results.pop("grouped_mm")
    return {
        impl: {key: rel_err(ours[key], theirs[key]) for key in ours}
        for impl, ours in results.items()
    }


# ------------------------------------------------------------------ FSDP2


class _RecordingReduceScatter:
    """A reduce-scatter comm for ``FSDPModule.set_custom_reduce_scatter`` that counts bytes.

    It wraps FSDP2's default comm (imported from PyTorch's private module,
    present in 2.10 through 2.13) and records each input's dtype and bytes;
    with ``probe`` set it also records the fraction of input elements that
    are exactly bf16 values (a host sync: not in timed steps).
    """

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        self.inner = DefaultReduceScatter()
        self.bytes = 0
        self.dtypes: set[str] = set()
        self.probe = False
        self.bf16_fractions: list[float] = []

    def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
        self.bytes += input_tensor.numel() * input_tensor.element_size()
        self.dtypes.add(str(input_tensor.dtype))
        if self.probe:
            exact = input_tensor.to(torch.bfloat16).to(input_tensor.dtype) == input_tensor
            self.bf16_fractions.append(float(exact.double().mean()))
        return self.inner(output_tensor, input_tensor, group, op, async_op)


def bench_fsdp2(shape: Shape, device: torch.device, args: argparse.Namespace) -> dict | None:
    """Step time and reduce-scatter bytes of one decoder layer under FSDP2 (run under torchrun)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as plain_fully_shard

    from groupgrad.integrations.fsdp2 import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    variants = {
        "groupgrad_fsdp2_fp32_wgrad/fp32_reduce": ("groupgrad", fully_shard, torch.float32),
        "groupgrad_plain_fsdp2_bf16_wgrad/fp32_reduce": (
            "groupgrad",
            plain_fully_shard,
            torch.float32,
        ),
        "groupgrad_plain_fsdp2_bf16_wgrad/bf16_reduce": (
            "groupgrad",
            plain_fully_shard,
            torch.bfloat16,
        ),
        "grouped_mm_plain_fsdp2_bf16_wgrad/fp32_reduce": (
            "grouped_mm",
            plain_fully_shard,
            torch.float32,
        ),
    }
    seq = min(2048, shape.T)
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [
        torch.randint(0, 1024, (shape.T // seq, seq), generator=generator).to(device)
        for _ in range(N_SETS)
    ]
    models, comms = {}, {}
    for name, (impl, shard_fn, reduce_dtype) in variants.items():
        model = qwen3_moe(shape, device, torch.float32)
        model.set_experts_implementation(impl)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        comm = _RecordingReduceScatter()
        for unit in (*model.model.layers, model):
            shard_fn(unit, mp_policy=policy)
            unit.set_custom_reduce_scatter(comm)
        models[name], comms[name] = model, comm

    def make_step(name: str) -> Callable[[int], object]:
        model = models[name]

        def step(i: int) -> None:
            model(input_ids=batches[i], labels=batches[i]).loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    steps = {name: make_step(name) for name in variants}
    for name, step in steps.items():  # one probe step: dtype and bf16-exact fraction
        comms[name].probe = True
        step(0)
        comms[name].probe = False
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for step in steps.values():
        for i in range(args.warmup):
            step(i % N_SETS)
    for r in range(args.rounds):
        names = list(variants)
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            for _ in range(args.per_round):
                comms[name].bytes = 0
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                begin = time.perf_counter()
                steps[name](len(samples[name]) % N_SETS)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - begin) * 1e3)
    step_bytes = {name: comms[name].bytes for name in variants}
    result = {
        "shape": asdict(shape),
        "world_size": world,
        "tokens_per_rank": shape.T,
        "sequence_length": seq,
        "step_ms": {name: statistics.median(s) for name, s in samples.items()},
        "reduce_scatter_bytes_per_step": step_bytes,
        "reduce_scatter_dtypes": {name: sorted(c.dtypes) for name, c in comms.items()},
        "reduce_scatter_input_bf16_exact_fraction": {
            name: c.bf16_fractions for name, c in comms.items()
        },
    }
    base = result["step_ms"]["groupgrad_plain_fsdp2_bf16_wgrad/fp32_reduce"]
    result["step_ratio_vs_plain_fp32_reduce"] = {n: t / base for n, t in result["step_ms"].items()}
    return result if rank == 0 else None


# ------------------------------------------------------------------ main


def environment(device: torch.device) -> dict:
    import transformers

    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write JSON + PNG into this folder")
    parser.add_argument("--smoke", action="store_true", help=f"tiny size {SMOKE} on any device")
    parser.add_argument("--fsdp", action="store_true", help="the FSDP2 variant (under torchrun)")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=None, help="T values (default 4096 16384)"
    )
    parser.add_argument(
        "--sigmas", type=float, nargs="+", default=None, help="routing skews (default 0.5 1 2)"
    )
    parser.add_argument(
        "--checkpointing",
        choices=("off", "on", "both"),
        default="both",
        help="gradient checkpointing around the experts call",
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (10)")
    parser.add_argument(
        "--per-round", type=int, default=2, help="timed calls per round and variant"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    parser.add_argument("--skip-eager", action="store_true", help="leave out the eager loop")
    parser.add_argument("--skip-fp8", action="store_true", help="leave out groupgrad_fp8")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.smoke else 10)

    shape = SMOKE if args.smoke else QWEN3_30B_A3B
    tokens = args.tokens or ([shape.T] if args.smoke or args.fsdp else [4096, 16384])
    if args.fsdp:
        shape = Shape(**{**asdict(shape), "T": tokens[0]})
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("bench_hf_moe.py needs a CUDA GPU (smoke test on CPU: --smoke)")
    if args.fsdp:
        dist.init_process_group("nccl" if cuda else "gloo")
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
    else:
        device = torch.device("cuda" if cuda else "cpu")
    env = environment(device)
    fallbacks = _Fallbacks()
    logging.getLogger("groupgrad").addHandler(fallbacks)

    if args.fsdp:
        result = bench_fsdp2(shape, device, args)
        dist.barrier()
        dist.destroy_process_group()
        if result is None:
            return 0
        result = {**env, **result, "rounds": args.rounds, "per_round": args.per_round}
        result["fallbacks"] = fallbacks.messages
        print(report.fsdp_table(result))
        stem = "hf_moe_fsdp2_"
    else:
        rows = []
        for T in tokens:
            for sigma in args.sigmas or [0.5, 1.0, 2.0]:
                for checkpointed in {"off": [False], "on": [True], "both": [False, True]}[
                    args.checkpointing
                ]:
                    row_shape = Shape(**{**asdict(shape), "T": T})
                    row = bench_experts(
                        row_shape,
                        device,
                        args,
                        sigma,
                        checkpointed,
                        sigma == 1 and not checkpointed,
                    )
                    print(report.row_line(row), flush=True)
                    rows.append(row)
        result = {**env, "rows": rows}
        result.update({"rounds": args.rounds, "per_round": args.per_round, "warmup": args.warmup})
        result["fallbacks"] = fallbacks.messages
        print(report.experts_table(result))
        stem = "hf_moe_"
    if args.out is not None:
        stem = results_files.gpu_stem(stem, env["gpu"]) + ("_smoke" if args.smoke else "")
        plot = report.plot_fsdp if args.fsdp else report.plot_experts
        results_files.write_results(args.out, stem, result, plot)  # goes on without the PNG
    if fallbacks.messages and device.type == "cuda":
        print("!! some work ran on a fallback path; the timings above are not the fast path")
        return 2
    return 0


if __name__ == "__main__":
    code = main()
    # Skip interpreter teardown: with --fsdp on gloo, a gloo thread that PyTorch keeps alive
    # past destroy_process_group() (torch.distributed.nn holds group.WORLD) can abort there.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
