"""Device spike: FP8 blockwise-scaled grouped wgrad (CUTLASS 4.2, sm_90a) via ctypes.

Builds ``fp8_wgrad_spike.cu`` with nvcc into a cache under $HOME (once), then
  (a) checks it against an fp64 product of the dequantized operands (ragged
      experts, an empty one, overwrite and accumulate, determinism, CUDA graph),
      beside cuBLASLt's blockwise ``scaled_mm`` on the same quantized data;
  (b) times it on DeepGEMM's wgrad shapes against a per-expert loop of ``scaled_mm``
      (1x128 x 1x128 blocks, fp32 out) and a per-expert bf16 loop into fp32.
Every section catches its own failure, prints it and lets the next one run.

    python3 benchmarks/fp8_spike/run_spike.py --out $OUT      # on the GPU machine
    python3 benchmarks/fp8_spike/run_spike.py --cpu-selftest  # quantizer + references, no GPU

Legend: E experts, T tokens, N out_features, K in_features, splits_E tokens per expert.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import Bf16Wgrad, ScaledMm, padded_expert_operands, pick_bf16_wgrad, pick_scaled_mm
from fp8_layout import (
    Quantized,
    SegmentLayout,
    quantize,
    random_operand,
    reference_wgrad,
    relative_errors,
    selftest,
)

HERE = Path(__file__).resolve().parent
DEVICE = "cuda"  # a module constant so that a CPU dry run of the driver logic can swap it
SOURCE = HERE / "fp8_wgrad_spike.cu"
NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-arch=sm_90a",
    "--expt-relaxed-constexpr",
    "-DNDEBUG",
    "-Xcompiler",
    "-fPIC",
    "-shared",
]
#: Required relative Frobenius error against the fp64 product of the dequantized operands.
FRO_TOLERANCE = 2.5e-4
CORRECTNESS_CASES = (  # (N, K, splits_E)
    (256, 384, (150, 0, 4113, 77)),
    (512, 1024, (4113, 150, 0, 4096)),
    (256, 256, (1, 128, 129, 0, 17)),
)
TIMING_SHAPES = ((4096, 7168), (7168, 2048))  # (N, K), DeepGEMM's wgrad shapes
TIMING_EXPERTS = (4, 8, 16)


# --------------------------------------------------------------------------- build + load


def cutlass_include_dir(override: str | None) -> Path:
    if override:
        path = Path(override)
    else:
        import cutlass_library  # the nvidia-cutlass wheel

        path = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    if not (path / "cutlass" / "cutlass.h").is_file():
        raise FileNotFoundError(f"--cutlass-include {path} has no cutlass/cutlass.h")
    return path


def build_library(include: Path, cache_root: Path) -> tuple[Path, float | None]:
    """Compiles the spike into cache_root/<hash>/ unless there; returns (path, build seconds)."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([*NVCC_FLAGS, str(include)]).encode())
    out_dir = cache_root / digest.hexdigest()[:16]
    library = out_dir / "fp8_wgrad_spike.so"
    if library.is_file():
        print(f"[build] cached: {library}")
        return library, None
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [nvcc, *NVCC_FLAGS, f"-I{include}", "-o", str(library), str(SOURCE)]
    print("[build] " + " ".join(command), flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        library.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed after {seconds:.1f} s:\n{result.stderr[-6000:]}")
    print(f"[build] {seconds:.1f} s -> {library}", flush=True)
    return library, seconds


class Fp8Wgrad:
    """ctypes binding of the spike's entry points."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        lib.fp8_wgrad_workspace_size.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.fp8_wgrad_workspace_size.restype = ctypes.c_size_t
        lib.fp8_wgrad_last_error.argtypes = []
        lib.fp8_wgrad_last_error.restype = ctypes.c_char_p
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.fp8_wgrad.argtypes = [i32, ptr, i64, i64, i64, i32, i32, ptr, ptr, ptr, ptr, ptr, i32]
        lib.fp8_wgrad.argtypes += [ptr, ctypes.c_size_t, i32, ptr]
        lib.fp8_wgrad.restype = ctypes.c_int
        self.lib = lib
        self.sm_count = torch.cuda.get_device_properties(0).multi_processor_count

    def workspace(self, experts: int) -> torch.Tensor:
        size = self.lib.fp8_wgrad_workspace_size(experts, self.sm_count)
        if size == 0:
            raise RuntimeError(self.lib.fp8_wgrad_last_error().decode())
        return torch.empty(size, dtype=torch.uint8, device=DEVICE)

    def __call__(
        self,
        splits_E: torch.Tensor,
        dyq: Quantized,
        xq: Quantized,
        out_ptrs_E: torch.Tensor,
        accumulate: bool,
        workspace: torch.Tensor,
    ) -> None:
        layout = dyq.layout
        code = self.lib.fp8_wgrad(
            len(layout.splits),
            splits_E.data_ptr(),
            layout.tokens,
            layout.padded_tokens,
            layout.scale_rows,
            dyq.data.shape[0],
            xq.data.shape[0],
            dyq.data.data_ptr(),
            dyq.scales.data_ptr(),
            xq.data.data_ptr(),
            xq.scales.data_ptr(),
            out_ptrs_E.data_ptr(),
            int(accumulate),
            workspace.data_ptr(),
            workspace.numel(),
            self.sm_count,
            torch.cuda.current_stream().cuda_stream,
        )
        if code != 0:
            raise RuntimeError(
                f"fp8_wgrad returned {code}: {self.lib.fp8_wgrad_last_error().decode()}"
            )


# --------------------------------------------------------------------------- problems


class Problem:
    """Quantized operands, per-expert fp32 outputs (separate allocations) and device args."""

    def __init__(
        self, N: int, K: int, splits: tuple[int, ...], seed: int, keep_bf16: bool = False
    ) -> None:
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        self.layout = SegmentLayout.from_splits(splits)
        self.N, self.K, self.splits = N, K, tuple(splits)
        dy_TN = random_operand(self.layout.tokens, N, generator, DEVICE)
        x_TK = random_operand(self.layout.tokens, K, generator, DEVICE)
        self.dyq = quantize(dy_TN, self.layout)
        self.xq = quantize(x_TK, self.layout)
        self.dy_TN = dy_TN if keep_bf16 else None
        self.x_TK = x_TK if keep_bf16 else None
        self.splits_E = torch.tensor(splits, dtype=torch.int64, device=DEVICE)
        self.outputs = [torch.empty(N, K, dtype=torch.float32, device=DEVICE) for _ in splits]
        self.out_ptrs_E = torch.tensor(
            [o.data_ptr() for o in self.outputs], dtype=torch.int64, device=DEVICE
        )

    @property
    def flops(self) -> int:
        return 2 * self.N * self.K * sum(self.splits)

    def poison(self) -> None:
        for out in self.outputs:
            out.fill_(float("nan"))


def nonempty_errors(
    outputs: list[torch.Tensor], expected: list[torch.Tensor | None]
) -> tuple[float, float]:
    """Relative errors over all non-empty experts together."""
    pairs = [(o, r) for o, r in zip(outputs, expected, strict=True) if r is not None]
    if not pairs:
        return 0.0, 0.0
    out = torch.cat([o.flatten().to(torch.float64) for o, _ in pairs])
    ref = torch.cat([r.flatten() for _, r in pairs])
    return relative_errors(out, ref)


# --------------------------------------------------------------------------- (a) correctness


def check_case(fp8: Fp8Wgrad, N: int, K: int, splits: tuple[int, ...], seed: int) -> dict:
    p = Problem(N, K, splits, seed)
    workspace = fp8.workspace(len(splits))
    refs = [reference_wgrad(p.dyq, p.xq, e) if t > 0 else None for e, t in enumerate(splits)]
    empty = [e for e, t in enumerate(splits) if t == 0]
    row: dict[str, Any] = {"N": N, "K": K, "splits": list(splits)}
    checks: dict[str, bool] = {}

    def run(accumulate: bool) -> list[torch.Tensor]:
        fp8(p.splits_E, p.dyq, p.xq, p.out_ptrs_E, accumulate, workspace)
        torch.cuda.synchronize()
        return [o.clone() for o in p.outputs]

    # Overwrite into NaN-poisoned outputs: every element must be written, empty experts zeroed.
    p.poison()
    first = run(accumulate=False)
    row["overwrite_rel_inf"], row["overwrite_rel_fro"] = nonempty_errors(first, refs)
    checks["overwrite_fro_ok"] = row["overwrite_rel_fro"] <= FRO_TOLERANCE
    checks["overwrite_finite"] = all(bool(o.isfinite().all()) for o in first)
    checks["overwrite_empty_zero"] = all(bool((first[e] == 0).all()) for e in empty)
    row["per_expert_rel_fro"] = [
        relative_errors(o, r)[1] if r is not None else None
        for o, r in zip(first, refs, strict=True)
    ]
    p.poison()
    checks["overwrite_deterministic"] = all(
        torch.equal(a, b) for a, b in zip(first, run(accumulate=False), strict=True)
    )

    # Accumulate onto random values: C + product, empty experts untouched (bitwise).
    generator = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    init = [torch.randn(N, K, generator=generator, device=DEVICE) for _ in splits]
    for out, start in zip(p.outputs, init, strict=True):
        out.copy_(start)
    accumulated = run(accumulate=True)
    want = [s.double() + r if r is not None else None for s, r in zip(init, refs, strict=True)]
    row["accumulate_rel_inf"], row["accumulate_rel_fro"] = nonempty_errors(accumulated, want)
    checks["accumulate_fro_ok"] = row["accumulate_rel_fro"] <= FRO_TOLERANCE
    checks["accumulate_empty_untouched"] = all(torch.equal(accumulated[e], init[e]) for e in empty)
    for out, start in zip(p.outputs, init, strict=True):
        out.copy_(start)
    checks["accumulate_deterministic"] = all(
        torch.equal(a, b) for a, b in zip(accumulated, run(accumulate=True), strict=True)
    )

    # CUDA graph: capture one overwrite call, replay into poisoned outputs.
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fp8(p.splits_E, p.dyq, p.xq, p.out_ptrs_E, False, workspace)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            fp8(p.splits_E, p.dyq, p.xq, p.out_ptrs_E, False, workspace)
        p.poison()
        graph.replay()
        torch.cuda.synchronize()
        checks["cuda_graph_replay_bitwise"] = all(
            torch.equal(a, b) for a, b in zip(first, p.outputs, strict=True)
        )
    except Exception as exc:
        row["cuda_graph_error"] = f"{type(exc).__name__}: {exc}"[:600]
        checks["cuda_graph_replay_bitwise"] = False

    # cuBLASLt blockwise scaled_mm on the largest expert (tokens zero-padded to 128).
    big = max(range(len(splits)), key=lambda e: splits[e])
    log: list[dict] = []
    fn = pick_scaled_mm(p.dyq, p.xq, big, refs[big], log)
    row["scaled_mm_attempts"] = log
    if fn is not None:
        smm_fro = next(a["rel_fro"] for a in reversed(log) if "rel_fro" in a)
        ours = row["per_expert_rel_fro"][big]
        row["scaled_mm_expert"] = big
        row["scaled_mm_rel_fro"] = smm_fro
        row["cutlass_over_scaled_mm_error"] = ours / smm_fro if smm_fro > 0 else None
    row["checks"] = checks
    row["passed"] = all(checks.values())
    return row


def section_correctness(fp8: Fp8Wgrad) -> dict:
    rows = []
    for i, (N, K, splits) in enumerate(CORRECTNESS_CASES):
        print(f"[correctness] N={N} K={K} splits={list(splits)}", flush=True)
        try:
            row = check_case(fp8, N, K, splits, seed=100 + i)
        except Exception as exc:
            traceback.print_exc()
            row = {"N": N, "K": K, "splits": list(splits), "passed": False}
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        rows.append(row)
        _print_case(row)
    return {"cases": rows, "passed": all(r["passed"] for r in rows)}


def _print_case(row: dict) -> None:
    if "error" in row:
        print(f"  FAILED: {row['error']}")
        return
    ratio = row.get("cutlass_over_scaled_mm_error")
    ratio_text = f"{ratio:.2f}" if ratio is not None else "n/a"
    print(
        f"  overwrite rel_inf {row['overwrite_rel_inf']:.3e} rel_fro {row['overwrite_rel_fro']:.3e}"
        f" | accumulate rel_inf {row['accumulate_rel_inf']:.3e}"
        f" rel_fro {row['accumulate_rel_fro']:.3e} | error / scaled_mm's {ratio_text}"
    )
    failed = [name for name, ok in row["checks"].items() if not ok]
    print(f"  checks: {'all passed' if not failed else 'FAILED ' + ', '.join(failed)}")
    if "cuda_graph_error" in row:
        print(f"  cuda graph: {row['cuda_graph_error']}")


# --------------------------------------------------------------------------- (b) timing


def time_interleaved(
    fns: dict[str, Callable[[], Any]], iters: int, warmup: int
) -> dict[str, list[float]]:
    """Milliseconds per call of each fn, measured round-robin with CUDA events."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: [s.elapsed_time(e) for s, e in pairs] for name, pairs in events.items()}


def time_cell(
    fp8: Fp8Wgrad,
    E: int,
    N: int,
    K: int,
    ragged: bool,
    args: argparse.Namespace,
    smm: ScaledMm | None,
    bf16: Bf16Wgrad | None,
) -> dict:
    generator = torch.Generator().manual_seed(1000 * E + N + K)
    if ragged:
        splits = tuple(int(t) for t in torch.randint(4096, 8193, (E,), generator=generator))
    else:
        splits = (4096,) * E
    p = Problem(N, K, splits, seed=E * 31 + N, keep_bf16=True)
    workspace = fp8.workspace(E)
    for out in p.outputs:
        out.zero_()
    fns: dict[str, Callable[[], Any]] = {
        "cutlass_fp8": lambda: fp8(p.splits_E, p.dyq, p.xq, p.out_ptrs_E, True, workspace)
    }
    if smm is not None and not ragged:  # cuBLASLt wants tokens in multiples of 128
        ops = [padded_expert_operands(p.dyq, p.xq, e) for e in range(E)]
        fns["scaled_mm_loop"] = lambda: [smm(*o) for o in ops]
        fns["scaled_mm_loop+add"] = lambda: [
            out.add_(smm(*o)) for out, o in zip(p.outputs, ops, strict=True)
        ]
    if bf16 is not None:
        segments = [
            (p.dy_TN[s : s + t].t(), p.x_TK[s : s + t])
            for s, t in zip(p.layout.token_start, splits, strict=True)
        ]
        fns["bf16_loop"] = lambda: [
            bf16(out, a, b) for out, (a, b) in zip(p.outputs, segments, strict=True)
        ]
    host = []
    for _ in range(5):
        start = time.perf_counter()
        fns["cutlass_fp8"]()
        host.append((time.perf_counter() - start) * 1e6)
    times = time_interleaved(fns, args.iters, args.warmup)
    row: dict[str, Any] = {
        "E": E,
        "N": N,
        "K": K,
        "tokens": "ragged[4096,8192]" if ragged else "uniform 4096",
        "splits": list(splits),
        "flops": p.flops,
        "cutlass_host_us": statistics.median(host),
    }
    for name, ms in times.items():
        median = statistics.median(ms)
        row[name] = {"median_ms": median, "min_ms": min(ms), "tflops": p.flops / median / 1e9}
    return row


def section_timing(fp8: Fp8Wgrad, args: argparse.Namespace) -> dict:
    log: list[dict] = []
    smm = None
    try:  # pick the scaled_mm call form on a small uniform problem
        probe = Problem(256, 512, (256, 384), seed=5)
        ref = reference_wgrad(probe.dyq, probe.xq, 1)
        smm = pick_scaled_mm(probe.dyq, probe.xq, 1, ref, log)
    except Exception as exc:
        log.append({"error": f"{type(exc).__name__}: {exc}"[:600]})
    bf16_log: list[dict] = []
    bf16_pick = pick_bf16_wgrad(bf16_log, DEVICE)
    print(f"[timing] bf16 baseline: {bf16_pick[0] if bf16_pick else 'none'} {bf16_log}")
    print(
        "[timing] xR = that method's median time / cutlass_fp8's (R > 1: the FP8 kernel is faster)"
    )
    rows = []
    for N, K in TIMING_SHAPES:
        for E in TIMING_EXPERTS:
            for ragged in (False, True):
                try:
                    row = time_cell(
                        fp8, E, N, K, ragged, args, smm, bf16_pick[1] if bf16_pick else None
                    )
                except Exception as exc:
                    traceback.print_exc()
                    row = {"E": E, "N": N, "K": K, "ragged": ragged}
                    row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                rows.append(row)
                _print_timing_row(row)
                torch.cuda.empty_cache()
    return {
        "scaled_mm_attempts": log,
        "bf16_baseline": bf16_pick[0] if bf16_pick else None,
        "bf16_attempts": bf16_log,
        "rows": rows,
    }


def _print_timing_row(row: dict) -> None:
    head = f"E={row['E']:>2} N={row['N']} K={row['K']} {row.get('tokens', '')}"
    if "error" in row:
        print(f"{head}: FAILED {row['error']}")
        return
    parts = [head]
    ours = row["cutlass_fp8"]["median_ms"]
    for name in ("cutlass_fp8", "scaled_mm_loop", "scaled_mm_loop+add", "bf16_loop"):
        if name in row:
            cell = row[name]
            speedup = cell["median_ms"] / ours
            parts.append(
                f"{name} {cell['median_ms']:.3f} ms {cell['tflops']:.0f} TF/s x{speedup:.2f}"
            )
    parts.append(f"host {row['cutlass_host_us']:.0f} us")
    print(" | ".join(parts), flush=True)


# --------------------------------------------------------------------------- main


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="JSON output dir ($OUT)")
    parser.add_argument("--cutlass-include", default=None, help="CUTLASS include dir override")
    parser.add_argument(
        "--cache",
        default=str(Path.home() / ".cache" / "groupgrad_fp8_spike"),
        help="build cache dir",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--cpu-selftest", action="store_true", help="quantizer checks only")
    return parser.parse_args()


def main() -> int:
    args = _parse_args()
    if args.cpu_selftest:
        return 0 if selftest() else 1
    started = time.perf_counter()
    results: dict[str, Any] = {"torch": torch.__version__, "nvcc_flags": NVCC_FLAGS}
    fp8 = None
    try:
        results["device"] = torch.cuda.get_device_name(0)
        include = cutlass_include_dir(args.cutlass_include)
        library, seconds = build_library(include, Path(args.cache))
        results["build"] = {"library": str(library), "seconds": seconds, "include": str(include)}
        fp8 = Fp8Wgrad(library)
    except Exception as exc:
        traceback.print_exc()
        results["build"] = {"error": f"{type(exc).__name__}: {exc}"[:4000]}
    if fp8 is not None:
        try:
            results["correctness"] = section_correctness(fp8)
        except Exception as exc:
            traceback.print_exc()
            results["correctness"] = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
        if not args.skip_timing:
            try:
                results["timing"] = section_timing(fp8, args)
            except Exception as exc:
                traceback.print_exc()
                results["timing"] = {"error": f"{type(exc).__name__}: {exc}"}
    results["wall_seconds"] = time.perf_counter() - started
    out_dir = Path(args.out) if args.out else Path(args.cache)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fp8_wgrad_spike.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"[done] {results['wall_seconds']:.0f} s; JSON in {out_dir / 'fp8_wgrad_spike.json'}")
    passed = fp8 is not None and results.get("correctness", {}).get("passed", False)
    print(f"[done] correctness {'PASSED' if passed else 'FAILED'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
