"""Where one GroupedMLP training step's time goes on the host: bf16 and FP8, packed and per-expert.

For one config of ``bench_mlp.py`` (default: Qwen3-30B-A3B's E = 128, where
the FP8 step is slower than its kernels add up to) and each variant —
``bf16`` and ``fp8`` (weights quantized at every forward) and ``fp8_cached``
(``is_first_microbatch=False`` after one ``True``), each with packed weights
(``single_grouped_weight=True``) and per-expert weights — one forward +
backward with fp32 ``main_grad`` accumulated, and:

* ``step_ms``: CUDA-event time of a step (median of 10);
* ``host_ms``: wall time to issue a step from an idle GPU (median of 5; a
  step whose ``host_ms`` is near its ``step_ms`` waits on the host);
* ``kernels``: the CUDA kernels one step runs (``torch.profiler``);
* ``groupgrad_ops``: how often the step calls each ``groupgrad::`` op;
* ``top``: the operators with the most self CPU time in that step;
* ``host_functions``: calls and inclusive host ms per step of groupgrad's
  functions on the way (``host_functions.py``: wrapped by ``perf_counter``
  pairs, not profiled, so many small calls are not inflated).

Usage (H200, kernels prebuilt): ``python benchmarks/profile_fp8_step.py [--config 2]
[--out benchmarks/results]``; ``--quick --device cpu`` is a smoke run (reference
kernels, no CUDA numbers). Legend: ``T`` tokens, ``E`` experts, ``H``
hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_fp8_mlp
import bench_mlp
import host_functions
import results_files

from groupgrad.modules import GroupedMLP

VARIANTS = {  # name: (packed weights, fp8_recipe, is_first_microbatch at every timed step)
    "bf16 packed": (True, None, None),
    "fp8 packed": (True, "blockwise", None),
    "fp8_cached packed": (True, "blockwise", False),
    "bf16 per-expert": (False, None, None),
    "fp8 per-expert": (False, "blockwise", None),
    "fp8_cached per-expert": (False, "blockwise", False),
}
QUICK_CONFIG = (4, 256, 256, 512)
HOST_STEPS = 10  # steps timed with host_functions' wrappers


def make_step(case: bench_mlp.Case, mlp: GroupedMLP, flag: bool | None) -> Callable[[int], None]:
    """One forward + backward of ``mlp`` on the case's set ``i``; a cached variant warms its cache."""

    def step(i: int, first: bool | None = flag) -> None:
        kwargs = {} if first is None else {"is_first_microbatch": first}
        mlp(case.x[i], case.splits_dev, case.probs[i], **kwargs).backward(case.dy[i])
        for t in (case.x[i], case.probs[i], *mlp.parameters()):
            t.grad = None

    if flag is False:
        step(0, True)
    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_ms(step: Callable[[int], None], device: torch.device, reps: int = 10) -> float | None:
    """Median CUDA-event time of a step (``None`` on the CPU)."""
    if device.type != "cuda":
        return None
    step(0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps):
        start.record()
        step(i % bench_mlp.N_SETS)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profile(step: Callable[[int], None], device: torch.device, top: int) -> dict:
    """Kernels one step runs and its operators with the most self CPU time (µs)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    step(0)
    _sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        step(1)
        _sync(device)
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "kernels": kernels,
        "groupgrad_ops": {e.key: e.count for e in ops if e.key.startswith("groupgrad::")},
        "self_cpu_ms": sum(e.self_cpu_time_total for e in ops) / 1e3,
        "top": [
            {"op": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total} for e in ops[:top]
        ],
    }


def functions_ms(step: Callable[[int], None], device: torch.device) -> dict[str, dict]:
    """Inclusive host ms and calls per step of groupgrad's functions (``host_functions``)."""
    step(0)
    _sync(device)
    with host_functions.timed() as totals:
        for i in range(HOST_STEPS):
            step(i % bench_mlp.N_SETS)
        _sync(device)
    return host_functions.per_step(totals, HOST_STEPS)


def run(case: bench_mlp.Case, device: torch.device, top: int) -> dict[str, dict]:
    rows = {}
    for name, (packed, recipe, flag) in VARIANTS.items():
        mlp = bench_mlp.make_mlp(case, device, single_grouped_weight=packed, fp8_recipe=recipe)
        step = make_step(case, mlp, flag)
        rows[name] = {
            "step_ms": step_ms(step, device),
            "host_ms": bench_fp8_mlp.host_ms(step, device),
            **profile(step, device, top),
            "host_functions": functions_ms(step, device),
        }
        del mlp, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: dict[str, dict]) -> str:
    lines = ["| variant | step ms | host ms to issue it | CUDA kernels | profiled self-CPU ms |"]
    lines.append("|---|---|---|---|---|")
    for name, r in rows.items():
        ms = "—" if r["step_ms"] is None else f"{r['step_ms']:.3f}"
        lines.append(
            f"| {name} | {ms} | {r['host_ms']:.3f} | {r['kernels']} | {r['self_cpu_ms']:.2f} |"
        )
    for name, r in rows.items():
        ops = ", ".join(f"{o['op']} ×{o['calls']} {o['self_cpu_us'] / 1e3:.2f}" for o in r["top"])
        lines.append(f"- {name}, most self CPU (ms): {ops}")
    for name, r in rows.items():
        slowest = list(r["host_functions"].items())[: len(r["top"])]
        calls = ", ".join(f"{f} ×{v['calls']:g} {v['ms']:.2f}" for f, v in slowest)
        lines.append(f"- {name}, host ms per step (calls nested): {calls}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=int, default=2, help="index into bench_mlp.CONFIGS")
    parser.add_argument("--splits", default="uniform", choices=("uniform", "heavy"))
    parser.add_argument("--top", type=int, default=8, help="operators listed per variant")
    parser.add_argument("--quick", action="store_true", help=f"tiny smoke config {QUICK_CONFIG}")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with --quick")
    parser.add_argument("--out", type=Path, default=None, help="write profile_fp8_step_<gpu>.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not args.quick:
        raise SystemExit("CPU timings are meaningless: --device cpu only with --quick")
    E, H, F_, T = QUICK_CONFIG if args.quick else bench_mlp.CONFIGS[args.config]
    case = bench_mlp.make_case(E, H, F_, T, args.splits, device)
    rows = run(case, device, args.top)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"GroupedMLP step, E={E} H={H} F={F_} T={T} {args.splits}, {gpu}, torch {torch.__version__}"
    )
    print(table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = results_files.gpu_stem("profile_fp8_step_", gpu) + ("_smoke" if args.quick else "")
        result = {"gpu": gpu, "torch": torch.__version__, "config": [E, H, F_, T], "rows": rows}
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out / f'{stem}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
