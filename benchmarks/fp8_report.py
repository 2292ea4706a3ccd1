"""The FP8 grouped GEMMs' table and plot, from ``bench_fp8_gemm.py``'s JSON.

Targets (the FP8 kernels issue), marked "(miss)" where a cell misses one:
fprop/dgrad ≥ 1.0× cuBLASLt's dense blockwise ``scaled_mm`` (E ≤ 32), and at
E = 128 ≥ 2.5× ``torch._scaled_grouped_mm`` rowwise and ≥ 1.4× our bf16; wgrad
into fp32 ``main_grad`` ≥ 1.15× cuBLASLt's per-expert loop with the add and
≥ 1.15× our bf16 (E ≤ 32), and for E ≥ 64 ≥ 0.75 of the floor and ≥ 1.0× our
bf16. Usage: ``python benchmarks/fp8_report.py results/fp8_gemm_h200.json
[--png PATH]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def ratios(row: dict) -> dict[str, float]:
    """Baseline time / our FP8 time (above 1: ours faster), and the floor share for wgrad."""
    fp8 = row["fp8_ms"]
    keys = {
        "bf16": "bf16_ms",
        "cublaslt": "cublaslt_dense_ms" if row["op"] != "wgrad_fp32" else "cublaslt_loop_add_ms",
        "cublaslt_no_add": "cublaslt_loop_ms",
        "rowwise": "scaled_grouped_rowwise_ms",
        "floor": "floor_ms",
    }
    return {name: row[key] / fp8 for name, key in keys.items() if key in row}


def misses(row: dict) -> list[str]:
    """The targets this cell misses, by ratio name."""
    r, small = ratios(row), row["E"] <= 32
    if row["op"] == "wgrad_fp32":
        goals = {"cublaslt": 1.15, "bf16": 1.15} if small else {"floor": 0.75, "bf16": 1.0}
    else:
        goals = {"cublaslt": 1.0} if small else {}
        if row["E"] >= 128:
            goals = {"rowwise": 2.5, "bf16": 1.4}
    return [name for name, goal in goals.items() if name in r and r[name] < goal]


def markdown(result: dict) -> str:
    """The table ``kernels/README.md`` shows."""
    lines = [
        "| op | E | K | N | T | routing | FP8 TFLOP/s | × our bf16 | × cuBLASLt | "
        "× `_scaled_grouped_mm` | floor share | best tuning variant |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        r, missed = ratios(row), misses(row)

        def cell(name: str, r: dict[str, float] = r, missed: list[str] = missed) -> str:
            if name not in r:
                return "–"
            return f"{r[name]:.2f}" + (" (miss)" if name in missed else "")

        sweeps = {
            k[6:-3]: v for k, v in row.items() if k.startswith("sweep:") and k.endswith("_ms")
        }
        best = min(sweeps, key=sweeps.__getitem__) if sweeps else None
        sweep = f"{row['fp8_ms'] / sweeps[best]:.2f}× ({best[4:]})" if best else "–"
        floor = cell("floor") if row["op"] == "wgrad_fp32" and row["E"] >= 64 else "–"
        lines.append(
            f"| {row['op']} | {row['E']} | {row['K']} | {row['N']} | {row['T']} | "
            f"{row['splits']} | {row['fp8_tflops']:.0f} | {cell('bf16')} | {cell('cublaslt')} | "
            f"{cell('rowwise')} | {floor} | {sweep} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """TFLOP/s of ours (FP8, bf16) and the baselines, one panel per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        "ours FP8": "fp8_tflops",
        "ours bf16": "bf16_tflops",
        "cuBLASLt blockwise (dense / per-expert loop + add)": None,
        "_scaled_grouped_mm rowwise": "scaled_grouped_rowwise_tflops",
    }
    ops = ["fprop", "dgrad", "wgrad_fp32"]
    fig, axes = plt.subplots(len(ops), 1, figsize=(16, 11), squeeze=False)
    for ax, op in zip(axes[:, 0], ops, strict=True):
        rows = [r for r in result["rows"] if r["op"] == op]
        width = 0.8 / len(series)
        for j, (label, key) in enumerate(series.items()):
            if key is None:
                key = "cublaslt_dense_tflops" if op != "wgrad_fp32" else "cublaslt_loop_add_tflops"
            values = [r.get(key, 0.0) for r in rows]
            ax.bar([i + j * width for i in range(len(rows))], values, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        ax.set_xticklabels(
            [f"E{r['E']} {r['N']}x{r['K']}\n{r['splits']}" for r in rows], fontsize=6
        )
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{op} (FP8 blockwise, H200)")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    result = json.loads(args.json.read_text())
    print(markdown(result))
    if args.png is not None:
        plot(result, args.png)


if __name__ == "__main__":
    main()
