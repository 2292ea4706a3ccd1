"""Benchmark GroupedMLP forward+backward on one GPU against torch._grouped_mm and our own GEMMs.

For each config (E, H, F, T) and split distribution (uniform, mild, heavy), in the
same run, on the same random bf16 inputs (two input sets, rotated between
calls), with fp32 ``main_grad`` on both weights:

* ``ours``: ``GroupedMLP(..., single_grouped_weight=True,
  accumulate_into_main_grad=True)`` forward + backward (wgrads accumulated
  into ``main_grad`` by the GEMM epilogue; autograd's dummy ``.grad`` dropped
  after each step, as Megatron's hooks do);
* (a) ``grouped_mm_mlp``: the same MLP from ``torch._grouped_mm`` + PyTorch
  SwiGLU × probs under autograd, then ``main_grad.add_(w.grad)``;
* (b) ``gemm_sum``: the sum of our six grouped GEMMs timed one by one with the
  same shapes (fc1/fc2 fprop, fc2 dgrad, fc2 wgrad into fp32, fc1 dgrad, fc1
  wgrad into fp32) — the floor for ours; the fused SwiGLU kernels are timed
  on their own too, and all eight kernels of a step back to back without
  autograd (``swiglu_ms["kernel_sequence"]``: what is left of the overhead
  once the kernels themselves are counted is bookkeeping).

Also timed: ``ours_per_expert``, the same MLP with one parameter and one fp32
``main_grad`` per expert and layer (``single_grouped_weight=False``, listed
groups), and the CPU time per step of each (``host_us_per_step``, steps enqueued
back to back): where it exceeds the GPU time, the host is the bottleneck.

Reported: speed-up ``(a) / ours`` (target >= 1.3), overhead ``ours / (b) - 1``
(target <= 8 %), TFLOP/s (``18·T·H·F`` FLOPs per step), peak memory of one step
beside (a), and the relative error of ours against (a). CUDA events, warm-up,
median of ``--reps`` calls. Any fallback (CUTLASS or Triton unavailable, a
call on the reference path) is printed, recorded in the JSON, and makes the
exit status 2. ``--out DIR`` writes ``mlp_<gpu>.json`` and ``mlp_<gpu>.png``.

Usage (H200): ``python benchmarks/bench_mlp.py --out benchmarks/results``;
smoke test: ``python benchmarks/bench_mlp.py --quick`` (``--device cpu`` on a
machine without a GPU: perf_counter timings, not meaningful).

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
import kernels_timing as kt  # splits and error helpers shared with bench_kernels.py
import mlp_report
import results_files

from groupgrad.kernels import (
    grouped_dgrad,
    grouped_fprop,
    grouped_wgrad,
    swiglu_probs,
    swiglu_probs_backward,
    tuning,
)
from groupgrad.modules import GroupedMLP

CONFIGS = [
    (8, 4096, 14336, 16384),
    (32, 7168, 2048, 65536),
    (128, 2048, 768, 32768),
    (64, 2048, 1408, 32768),  # held out: never used to choose tiles (DeepSeek-V2-Lite's experts)
]
QUICK_CONFIGS = [(4, 256, 512, 2048)]
N_SETS = 2
TARGETS = {"speedup_vs_grouped_mm": 1.3, "overhead_vs_gemm_sum": 0.08}


class _Recorder(logging.Handler):
    """Collects the library's warnings (fallbacks to the reference path) during the run."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.note(record.getMessage())

    def note(self, message: str) -> None:
        """Record (and print) one fallback message, once."""
        if message not in self.messages:
            self.messages.append(message)
            print(f"!! FALLBACK: {message}", flush=True)


def median_ms(fn: Callable[[int], object], device: torch.device, reps: int, warmup: int) -> float:
    """Median time of ``fn(i)`` in ms, ``i`` cycling over the input sets (CUDA events on a GPU)."""
    if device.type != "cuda":
        return kt.median_ms_cpu(fn, N_SETS, reps, warmup)
    return kt.median_ms(fn, N_SETS, reps, warmup)


def host_us(fn: Callable[[int], object], device: torch.device, calls: int = 5) -> float | None:
    """CPU time (µs) per call of ``fn``, calls enqueued back to back (CUDA only)."""
    if device.type != "cuda":
        return None
    return kt.host_us(fn, N_SETS, calls)


def peak_bytes(fn: Callable[[int], object], device: torch.device) -> int | None:
    """Peak memory one call allocates beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    return kt.peak_bytes(fn, N_SETS)


@dataclasses.dataclass
class Case:
    E: int
    H: int
    F: int
    T: int
    split_kind: str
    splits: list[int]
    splits_dev: torch.Tensor  # int64 on the device: no host sync anywhere
    offs: torch.Tensor  # int32 cumulative ends, for torch._grouped_mm
    x: list[torch.Tensor]  # (T, H) bf16, requires grad
    probs: list[torch.Tensor]  # (T,) fp32, requires grad
    dy: list[torch.Tensor]  # (T, H) bf16

    @property
    def label(self) -> str:
        return f"E={self.E} H={self.H} F={self.F} T={self.T} {self.split_kind}"

    @property
    def flops(self) -> float:
        return 18.0 * self.T * self.H * self.F

    def columns(self) -> dict:
        """The case as a result row's leading fields (shared by the MLP benchmarks)."""
        return {
            "case": self.label,
            "E": self.E,
            "H": self.H,
            "F": self.F,
            "T": self.T,
            "split_kind": self.split_kind,
            "splits_min_max": [min(self.splits), max(self.splits)],
        }


def make_case(E: int, H: int, F_: int, T: int, split_kind: str, device: torch.device) -> Case:
    splits = kt.splits_for(split_kind, T, E, seed=E)
    gen = torch.Generator(device=device).manual_seed(T + E)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen, dtype=torch.bfloat16)

    splits_dev = torch.tensor(splits, device=device, dtype=torch.int64)
    return Case(
        E,
        H,
        F_,
        T,
        split_kind,
        splits,
        splits_dev,
        torch.cumsum(splits_dev, 0).to(torch.int32),
        [randn(T, H).requires_grad_() for _ in range(N_SETS)],
        [torch.rand(T, device=device, generator=gen).requires_grad_() for _ in range(N_SETS)],
        [randn(T, H) for _ in range(N_SETS)],
    )


def make_mlp(
    case: Case,
    device: torch.device,
    single_grouped_weight: bool = True,
    fp8_recipe: str | None = None,
) -> GroupedMLP:
    mlp = GroupedMLP(
        case.E,
        case.H,
        case.F,
        dtype=torch.bfloat16,
        device=device,
        single_grouped_weight=single_grouped_weight,
        accumulate_into_main_grad=True,
        fp8_recipe=fp8_recipe,
    )
    for w in mlp.parameters():
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
        w.grad_added_to_main_grad = False
    return mlp


def per_expert_step(case: Case, device: torch.device) -> Callable[[int], torch.Tensor]:
    """Ours with one parameter (and one fp32 ``main_grad``) per expert and layer, as
    Megatron's default expert layout holds them: listed groups instead of packed."""
    mlp = make_mlp(case, device, single_grouped_weight=False)
    params = list(mlp.parameters())

    def step(i: int) -> torch.Tensor:
        y = mlp(case.x[i], case.splits_dev, case.probs[i])
        y.backward(case.dy[i])
        _clear(case.x[i], case.probs[i], *params)
        return y

    return step


def _clear(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.grad = None


def grouped_mm_step(
    case: Case, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[Callable[[int], torch.Tensor], torch.Tensor, torch.Tensor]:
    """Baseline (a): ``torch._grouped_mm`` + PyTorch SwiGLU × probs, then ``main_grad.add_``.

    Shares the bf16 weights (its own leaves, so its bf16 ``.grad`` is separate)
    and has its own fp32 ``main_grad`` buffers. Returns ``(step, main_grad1, main_grad2)``.
    """
    w1_a, w2_a = w1.detach().requires_grad_(), w2.detach().requires_grad_()
    mg1_a = torch.zeros(w1.shape, dtype=torch.float32, device=w1.device)
    mg2_a = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device)

    def step(i: int) -> torch.Tensor:
        h = torch._grouped_mm(case.x[i], w1_a.transpose(-2, -1), offs=case.offs)
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up * case.probs[i].to(h.dtype)[:, None]
        y = torch._grouped_mm(a, w2_a.transpose(-2, -1), offs=case.offs)
        y.backward(case.dy[i])
        mg1_a.add_(w1_a.grad)
        mg2_a.add_(w2_a.grad)
        _clear(case.x[i], case.probs[i], w1_a, w2_a)
        return y

    return step, mg1_a, mg2_a


def bench_case(case: Case, device: torch.device, reps: int, warmup: int) -> dict:
    mlp = make_mlp(case, device)
    w1, w2 = mlp.fc1.weight, mlp.fc2.weight  # (E, 2F, H), (E, H, F)

    def ours(i: int) -> torch.Tensor:
        y = mlp(case.x[i], case.splits_dev, case.probs[i])
        y.backward(case.dy[i])
        _clear(case.x[i], case.probs[i], w1, w2)  # Megatron's hooks drop the dummy .grad
        return y

    theirs, mg1_a, mg2_a = grouped_mm_step(case, w1, w2)
    errors = _cross_check(case, ours, theirs, (w1.main_grad, w2.main_grad, mg1_a, mg2_a))
    times = {"ours": median_ms(ours, device, reps, warmup)}
    peaks = {"ours": peak_bytes(ours, device)}
    times["grouped_mm_mlp"] = median_ms(theirs, device, reps, warmup)
    peaks["grouped_mm_mlp"] = peak_bytes(theirs, device)
    host = {"ours": host_us(ours, device), "grouped_mm_mlp": host_us(theirs, device)}
    del theirs, mg1_a, mg2_a
    per_expert = per_expert_step(case, device)
    times["ours_per_expert"] = median_ms(per_expert, device, reps, warmup)
    host["ours_per_expert"] = host_us(per_expert, device)
    del per_expert

    gemms, swiglu = _bench_parts(
        case, w1.detach(), w2.detach(), w1.main_grad, w2.main_grad, device, reps, warmup
    )
    times["gemm_sum"] = sum(gemms.values())
    return {
        **case.columns(),
        "flops": case.flops,
        "times_ms": times,
        "gemm_ms": gemms,
        "swiglu_ms": swiglu,
        "speedup_vs_grouped_mm": times["grouped_mm_mlp"] / times["ours"],
        "overhead_vs_gemm_sum": times["ours"] / times["gemm_sum"] - 1.0,
        "tflops": {k: case.flops / (v * 1e-3) / 1e12 for k, v in times.items()},
        "peak_bytes": peaks,
        "host_us_per_step": host,
        "rel_err_vs_grouped_mm": errors,
    }


def _cross_check(
    case: Case,
    ours: Callable[[int], torch.Tensor],
    theirs: Callable[[int], torch.Tensor],
    main_grads: tuple[torch.Tensor, ...],
) -> dict[str, float]:
    """One step of each on set 0 from zeroed ``main_grad``: relative errors of ours vs (a).

    ``main_grads`` is ``(ours fc1, ours fc2, theirs fc1, theirs fc2)``.
    """
    for mg in main_grads:
        mg.zero_()
    got = (*_run_capturing(ours, case), main_grads[0].clone(), main_grads[1].clone())
    want = (*_run_capturing(theirs, case), main_grads[2], main_grads[3])
    names = ("y", "dx", "dprobs", "fc1_main_grad", "fc2_main_grad")
    return {n: kt.rel_error(a, b) for n, a, b in zip(names, got, want, strict=True)}


def _run_capturing(fn: Callable[[int], torch.Tensor], case: Case) -> tuple[torch.Tensor, ...]:
    """Run ``fn(0)``; return ``(y, dx, dprobs)`` (``fn`` drops the input grads, so hook them)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        case.x[0].register_hook(lambda g: seen.__setitem__("dx", g.clone())),
        case.probs[0].register_hook(lambda g: seen.__setitem__("dp", g.clone())),
    ]
    try:
        y = fn(0).detach()
    finally:
        for hook in hooks:
            hook.remove()
    return y, seen["dx"], seen["dp"]


def _bench_parts(
    case: Case,
    w1: torch.Tensor,
    w2: torch.Tensor,
    mg1: torch.Tensor,
    mg2: torch.Tensor,
    device: torch.device,
    reps: int,
    warmup: int,
) -> tuple[dict[str, float], dict[str, float]]:
    """(b): each grouped GEMM of one step, timed alone; plus the two fused SwiGLU passes."""
    gen = torch.Generator(device=device).manual_seed(1)

    def randn(*shape: int) -> list[torch.Tensor]:
        return [
            torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(N_SETS)
        ]

    a, da = randn(case.T, case.F), randn(case.T, case.F)
    h, dh = randn(case.T, 2 * case.F), randn(case.T, 2 * case.F)
    x = [t.detach() for t in case.x]
    probs = [t.detach() for t in case.probs]
    s = case.splits_dev
    parts: dict[str, Callable[[int], object]] = {
        "fc1_fprop": lambda i: grouped_fprop(x[i], w1, s),
        "fc2_fprop": lambda i: grouped_fprop(a[i], w2, s),
        "fc2_dgrad": lambda i: grouped_dgrad(case.dy[i], w2, s),
        "fc2_wgrad_fp32": lambda i: grouped_wgrad(case.dy[i], a[i], s, out=mg2, accumulate=True),
        "fc1_dgrad": lambda i: grouped_dgrad(dh[i], w1, s),
        "fc1_wgrad_fp32": lambda i: grouped_wgrad(dh[i], x[i], s, out=mg1, accumulate=True),
    }
    gemms = {name: median_ms(fn, device, reps, warmup) for name, fn in parts.items()}

    def sequence(i: int) -> None:  # the step's kernels back to back, without autograd
        parts["fc1_fprop"](i)
        swiglu_probs(h[i], probs[i])
        for name in ("fc2_fprop", "fc2_dgrad"):
            parts[name](i)
        swiglu_probs_backward(da[i], h[i], probs[i])
        for name in ("fc2_wgrad_fp32", "fc1_dgrad", "fc1_wgrad_fp32"):
            parts[name](i)

    kernel_sequence_ms = median_ms(sequence, device, reps, warmup)
    swiglu = {
        "forward": median_ms(lambda i: swiglu_probs(h[i], probs[i]), device, reps, warmup),
        "backward": median_ms(
            lambda i: swiglu_probs_backward(da[i], h[i], probs[i]), device, reps, warmup
        ),
    }
    swiglu["kernel_sequence"] = kernel_sequence_ms
    return gemms, swiglu


def _environment(device: torch.device, recorder: _Recorder) -> dict:
    env: dict = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type != "cuda":
        return env
    _, build_s, compiled = tuning.build()
    env["cutlass_build_seconds"] = build_s
    print(f"CUTLASS extension ready in {build_s:.1f} s ({'compiled' if compiled else 'cached'})")
    reason = tuning.triton_unavailable_reason()
    if reason is not None:
        recorder.note(f"SwiGLU runs on the PyTorch reference: {reason}")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write JSON + PNG into this folder")
    parser.add_argument("--quick", action="store_true", help=f"tiny smoke config {QUICK_CONFIGS}")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per median (20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--configs", type=str, default="", help="indices into CONFIGS, e.g. 0,2")
    parser.add_argument(
        "--splits", type=str, default=",".join(kt.SPLIT_KINDS), help="split kinds (default: all)"
    )
    parser.add_argument("--device", type=str, default="cuda", help="cuda, or cpu with --quick")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_mlp.py needs a CUDA GPU (smoke test: --quick --device cpu)")
    if device.type != "cuda" and not args.quick:
        raise SystemExit("CPU timings are meaningless: --device cpu only with --quick")
    if not hasattr(torch, "_grouped_mm"):
        raise SystemExit(
            f"torch {torch.__version__} has no torch._grouped_mm: baseline (a) missing"
        )
    recorder = _Recorder()
    logging.getLogger("groupgrad").addHandler(recorder)
    env = _environment(device, recorder)

    configs = QUICK_CONFIGS if args.quick else CONFIGS
    if args.configs:
        configs = [configs[int(i)] for i in args.configs.split(",")]
    reps = args.reps or (5 if args.quick else 20)
    rows = []
    for E, H, F_, T in configs:
        for split_kind in args.splits.split(","):
            case = make_case(E, H, F_, T, split_kind, device)
            row = bench_case(case, device, reps, args.warmup)
            rows.append(row)
            print(mlp_report.one_line(row, TARGETS), flush=True)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()

    result = {**env, "reps": reps, "warmup": args.warmup, "n_sets": N_SETS, "targets": TARGETS}
    result.update({"rows": rows, "fallbacks": recorder.messages})
    print(mlp_report.markdown_table(result))
    if args.out is not None:
        stem = results_files.gpu_stem("mlp_", env["gpu"])
        if not results_files.write_results(args.out, stem, result, mlp_report.plot):
            return 3
    if recorder.messages:
        print("!! some work ran on a fallback path; the timings above are not the fast path:")
        for message in recorder.messages:
            print(f"!!   {message}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
