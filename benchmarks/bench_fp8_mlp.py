"""Benchmark GroupedMLP in FP8 (``fp8_recipe="blockwise"``) beside the same MLP in bf16.

For each config of ``bench_mlp.py`` (Mixtral E = 8, DeepSeek-V3 EP8 E = 32,
Qwen3-30B-A3B E = 128) and split distribution (uniform, heavy), in one run,
on the same random bf16 inputs (two sets, rotated), with fp32 ``main_grad``
on both packed weights (accumulated by the GEMM epilogue), timed interleaved
(CUDA events, median):

* ``bf16``: ``GroupedMLP(..., single_grouped_weight=True, accumulate_into_main_grad=True)``;
* ``fp8``: the same module with ``fp8_recipe="blockwise"``, weights quantized
  at every forward (``is_first_microbatch=None``; the layer keeps them for its
  dgrad): every quantization kernel of a step is in the time;
* ``fp8_cached``: weights quantized once and reused (``is_first_microbatch=False``
  after one ``True``), as the micro-batches after the first of a step run.

Also: peak memory of one step (bytes beyond those allocated before it), the
relative error of the FP8 step's output and ``main_grad`` against the bf16
step's, and a per-kernel decomposition of one FP8 and one bf16 step
(``torch.profiler``: CUDA time per kernel family — FP8 GEMMs, bf16 GEMMs,
quantization, the fused FP8 SwiGLU, SwiGLU, other). ``--out DIR`` writes ``fp8_mlp_<gpu>.json``
and ``.png``; any fallback to the reference path is printed and makes the
exit status 2. ``--quick --device cpu`` is a smoke run (reference kernels).

Usage (H200, kernels prebuilt): ``python benchmarks/bench_fp8_mlp.py --out benchmarks/results``.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_mlp
import kernels_timing as kt
import results_files

from groupgrad.modules import GroupedMLP

CONFIGS = bench_mlp.CONFIGS[:3]
QUICK_CONFIGS = [(4, 256, 256, 512)]
SPLITS = ("uniform", "heavy")
VARIANTS = ("bf16", "fp8", "fp8_cached")
FAMILIES = (  # (family, substrings of a kernel name), first match wins
    ("swiglu_fp8", ("swiglu_fp8",)),  # the fused FP8 SwiGLU (Triton; CUDA), before "fp8", "swiglu"
    # the quantizers (Triton's; the CUDA one-read quantize_segments_kernel, whose signature
    # names Fp8SegmentsParams, so before "Fp8") and the offsets of the (128, 1) form
    ("quantize", ("_rows_kernel", "_weights_kernel", "_segments_kernel", "_offsets_kernel")),
    ("fp8_gemm", ("fp8", "Fp8", "e4m3", "FP8")),
    ("gemm", ("cutlass", "gemm", "Gemm", "nvjet", "sm90")),
    ("swiglu", ("swiglu",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce")),
    ("copy", ("copy", "Memcpy", "Memset", "fill")),
)


def _family(name: str) -> str:
    for family, parts in FAMILIES:
        if any(p in name for p in parts):
            return family
    return "other"


def make_step(
    case: bench_mlp.Case, device: torch.device, variant: str, bf16: GroupedMLP
) -> tuple[Callable[[int], torch.Tensor], GroupedMLP]:
    """One forward + backward of ``variant`` (``bf16``'s weights); fp32 ``main_grad`` accumulated."""
    mlp = bf16 if variant == "bf16" else _as_fp8(bf16, case, device)
    flag = {"bf16": None, "fp8": None, "fp8_cached": False}[variant]
    w1, w2 = mlp.fc1.weight, mlp.fc2.weight
    if variant == "fp8_cached":  # the first micro-batch quantizes and caches
        mlp(case.x[0], case.splits_dev, case.probs[0], is_first_microbatch=True).backward(
            case.dy[0]
        )

    def step(i: int) -> torch.Tensor:
        kwargs = {} if flag is None else {"is_first_microbatch": flag}
        y = mlp(case.x[i], case.splits_dev, case.probs[i], **kwargs)
        y.backward(case.dy[i])
        for t in (case.x[i], case.probs[i], w1, w2):
            t.grad = None
        return y

    return step, mlp


def _as_fp8(bf16: GroupedMLP, case: bench_mlp.Case, device: torch.device) -> GroupedMLP:
    """An FP8 GroupedMLP with ``bf16``'s weights and its own zeroed fp32 ``main_grad``."""
    mlp = bench_mlp.make_mlp(case, device, fp8_recipe="blockwise")
    with torch.no_grad():
        mlp.fc1.weight.copy_(bf16.fc1.weight)
        mlp.fc2.weight.copy_(bf16.fc2.weight)
    return mlp


def kernel_ms(step: Callable[[int], torch.Tensor], device: torch.device) -> dict[str, float]:
    """CUDA time (ms) per kernel family in one step (after a warm-up step)."""
    step(0)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step(1)
        torch.cuda.synchronize(device)
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[_family(event.name)] += event.device_time_total / 1e3
    return dict(totals)


def _errors(steps: dict, mlps: dict) -> dict[str, float]:
    """FP8 against bf16 from zeroed ``main_grad``: output and both ``main_grad``s (set 0)."""
    outs, grads = {}, {}
    for name in ("bf16", "fp8"):
        for w in mlps[name].parameters():
            w.main_grad.zero_()
        outs[name] = steps[name](0).detach()
        grads[name] = [w.main_grad.clone() for w in (mlps[name].fc1.weight, mlps[name].fc2.weight)]
    return {
        "y": kt.rel_error(outs["fp8"], outs["bf16"]),
        "fc1_main_grad": kt.rel_error(grads["fp8"][0], grads["bf16"][0]),
        "fc2_main_grad": kt.rel_error(grads["fp8"][1], grads["bf16"][1]),
    }


def bench_case(case: bench_mlp.Case, device: torch.device, rounds: int, per_round: int) -> dict:
    bf16 = bench_mlp.make_mlp(case, device)
    built = {v: make_step(case, device, v, bf16) for v in VARIANTS}
    steps = {v: s for v, (s, _) in built.items()}
    mlps = {v: m for v, (_, m) in built.items()}
    cuda = device.type == "cuda"
    if cuda:
        times = kt.interleaved_ms(steps, bench_mlp.N_SETS, rounds, per_round)
    else:
        times = {v: kt.median_ms_cpu(s, bench_mlp.N_SETS, 2, 1) for v, s in steps.items()}
    row = {
        **case.columns(),
        "times_ms": times,
        "speedup_vs_bf16": {v: times["bf16"] / times[v] for v in VARIANTS},
        "tflops": {v: case.flops / (ms * 1e-3) / 1e12 for v, ms in times.items()},
        "peak_bytes": {
            v: kt.peak_bytes(s, bench_mlp.N_SETS) if cuda else None for v, s in steps.items()
        },
        "rel_err_vs_bf16": _errors(steps, mlps),
    }
    if cuda:
        row["kernel_ms"] = {v: kernel_ms(steps[v], device) for v in VARIANTS}
        row["host_ms"] = {v: host_ms(steps[v], device) for v in VARIANTS}
    return row


def host_ms(step: Callable[[int], object], device: torch.device, reps: int = 5) -> float:
    """Median wall time to issue one step from an idle GPU (no sync inside): the host's share.

    A step whose ``host_ms`` is near its CUDA-event time waits on the host, not the GPU.
    On the CPU (smoke runs) it is the step's whole time.
    """
    cuda = device.type == "cuda"
    times = []
    for i in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step(i % bench_mlp.N_SETS)
        times.append((time.perf_counter() - start) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
    return statistics.median(times)


def table(result: dict) -> str:
    lines = [
        f"GPU: {result['gpu']}, torch {result['torch']}, {result['date']}; GroupedMLP forward + "
        "backward, packed bf16 weights, fp32 main_grad accumulated; median of interleaved rounds.",
        "",
        "| config | splits | bf16 ms | FP8 ms (× bf16) | FP8 cached weights ms (× bf16) | "
        "peak MiB bf16 / FP8 | FP8 error y, fc1, fc2 vs bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        t, s, p, e = (
            row["times_ms"],
            row["speedup_vs_bf16"],
            row["peak_bytes"],
            row["rel_err_vs_bf16"],
        )
        peaks = "n/a" if p["bf16"] is None else f"{p['bf16'] / 2**20:.0f} / {p['fp8'] / 2**20:.0f}"
        lines.append(
            f"| E={row['E']} H={row['H']} F={row['F']} T={row['T']} | {row['split_kind']} | "
            f"{t['bf16']:.3f} | {t['fp8']:.3f} ({s['fp8']:.2f}×) | "
            f"{t['fp8_cached']:.3f} ({s['fp8_cached']:.2f}×) | {peaks} | "
            f"{e['y']:.1e}, {e['fc1_main_grad']:.1e}, {e['fc2_main_grad']:.1e} |"
        )
    for row in result["rows"]:
        if "kernel_ms" in row:
            parts = "; ".join(
                f"{v}: "
                + ", ".join(f"{k} {ms:.3f}" for k, ms in sorted(row["kernel_ms"][v].items()))
                for v in row["kernel_ms"]
            )
            lines.append(f"- kernels (ms) {row['case']} {row['split_kind']}: {parts}")
        if "host_ms" in row:
            host = ", ".join(f"{v} {ms:.3f}" for v, ms in row["host_ms"].items())
            lines.append(f"- host ms to issue one step {row['case']} {row['split_kind']}: {host}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.38
    for offset, v in zip((-width / 2, width / 2), ("fp8", "fp8_cached"), strict=True):
        ax.bar(
            [i + offset for i in range(len(rows))],
            [r["speedup_vs_bf16"][v] for r in rows],
            width,
            label=v,
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"E={r['E']}\n{r['split_kind']}" for r in rows], fontsize=8)
    ax.set_title(f"GroupedMLP FP8 speed-up over bf16 ({result['gpu']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write JSON + PNG into this folder")
    parser.add_argument("--quick", action="store_true", help=f"tiny smoke config {QUICK_CONFIGS}")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds")
    parser.add_argument("--per-round", type=int, default=3, help="timed calls per round")
    parser.add_argument("--configs", type=str, default="", help="indices into CONFIGS, e.g. 0,2")
    parser.add_argument("--device", type=str, default="cuda", help="cuda, or cpu with --quick")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not args.quick:
        raise SystemExit("CPU timings are meaningless: --device cpu only with --quick")
    recorder = bench_mlp._Recorder()
    logging.getLogger("groupgrad").addHandler(recorder)
    env = bench_mlp._environment(device, recorder)
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    if args.configs:
        configs = [configs[int(i)] for i in args.configs.split(",")]
    rows = []
    for E, H, F_, T in configs:
        for split_kind in SPLITS:
            case = bench_mlp.make_case(E, H, F_, T, split_kind, device)
            rows.append(bench_case(case, device, args.rounds, args.per_round))
            print(rows[-1]["case"], split_kind, rows[-1]["speedup_vs_bf16"], flush=True)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = {**env, "rounds": args.rounds, "per_round": args.per_round, "rows": rows}
    result["fallbacks"] = recorder.messages
    print(table(result))
    if args.out is not None:
        stem = results_files.gpu_stem("fp8_mlp_", env["gpu"]) + ("_smoke" if args.quick else "")
        results_files.write_results(args.out, stem, result, plot)
    if recorder.messages and device.type == "cuda":
        print("!! some work ran on a fallback path; the timings above are not the fast path")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
