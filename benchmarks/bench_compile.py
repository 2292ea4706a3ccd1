"""Benchmark a ``torch.compile``d GroupedMLP training step against the same step in eager.

For each config (E, H, F, T) and split distribution (uniform, mild, heavy),
in one process on the same random bf16 inputs (two sets, rotated): a
``GroupedMLP(..., single_grouped_weight=True)`` step — forward, backward,
``zero_grad`` — on bf16 weights with ``grad_dtype = float32`` (the route
``torch.compile`` used to round) and, separately, with fp32 ``main_grad``;
eager, ``torch.compile(model)`` and ``torch.compile(model, fullgraph=True)``,
timed interleaved (CUDA events, median). ``splits`` is a device tensor, as
the README asks under compile. Reported per cell: each time, compiled /
eager (target <= 1.05), and how many graphs Dynamo compiled over all the
steps (a recompilation per step would show). ``--out DIR`` writes
``compile_<gpu>.json`` and a PNG.

Usage (H200): ``python benchmarks/bench_compile.py --out benchmarks/results``;
``--quick`` for a small smoke run.

Legend: ``T`` tokens, ``E`` experts, ``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernels_timing as kt
import results_files

from groupgrad.modules import GroupedMLP

CONFIGS = [  # (E, H, F, T): Qwen3-30B-A3B-like many small experts, Mixtral-like few large ones
    (128, 2048, 768, 32768),
    (8, 4096, 14336, 16384),
]
QUICK = [(16, 512, 256, 4096)]
ROUTES = ("grad_dtype", "main_grad")


def _model(E: int, H: int, F: int, route: str) -> GroupedMLP:
    torch.manual_seed(0)
    model = GroupedMLP(
        E,
        H,
        F,
        dtype=torch.bfloat16,
        device="cuda",
        single_grouped_weight=True,
        accumulate_into_main_grad=route == "main_grad",
    )
    for p in model.parameters():
        if route == "main_grad":
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        else:
            p.grad_dtype = torch.float32
    return model


def _step(model: GroupedMLP, forward: Callable, inputs: list[tuple]) -> Callable[[int], None]:
    def run(i: int) -> None:
        x, splits, probs = inputs[i]
        forward(x, splits, probs).float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    return run


def cell(E: int, H: int, F: int, T: int, kind: str, route: str, rounds: int) -> dict:
    """One config × distribution × route: eager and both compiled steps, timed interleaved."""
    inputs = []
    for seed in range(2):
        counts = torch.tensor(kt.splits_for(kind, T, E, seed), device="cuda")
        x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        inputs.append((x, counts, torch.rand(T, device="cuda")))
    eager = _model(E, H, F, route)
    compiled = _model(E, H, F, route)
    fullgraph = _model(E, H, F, route)
    torch._dynamo.reset()
    before = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    steps = {
        "eager": _step(eager, eager, inputs),
        "compiled": _step(compiled, torch.compile(compiled), inputs),
        "fullgraph": _step(fullgraph, torch.compile(fullgraph, fullgraph=True), inputs),
    }
    ms = kt.interleaved_ms(steps, n_sets=2, rounds=rounds, per_round=5, warmup=3)
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - before
    flops = 18 * T * H * F
    return {
        "E": E,
        "H": H,
        "F": F,
        "T": T,
        "splits": kind,
        "route": route,
        "ms": ms,
        "compiled_over_eager": ms["compiled"] / ms["eager"],
        "fullgraph_over_eager": ms["fullgraph"] / ms["eager"],
        "tflops": {name: flops / (t * 1e9) for name, t in ms.items()},
        "graphs_compiled": graphs,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["cells"]
    labels = [f"E={r['E']} {r['splits']}\n{r['route']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["compiled_over_eager"] for r in rows], 0.4, label="compiled")
    ax.bar([x + 0.2 for x in xs], [r["fullgraph_over_eager"] for r in rows], 0.4, label="fullgraph")
    ax.axhline(1.05, color="red", linestyle="--", label="target 1.05")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("step time / eager")
    ax.set_title(f"torch.compile GroupedMLP step vs eager ({result['gpu']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--splits", default="uniform,heavy")
    options = parser.parse_args()
    configs = QUICK if options.quick else CONFIGS
    cells = []
    for E, H, F, T in configs:
        for kind in options.splits.split(","):
            for route in ROUTES:
                row = cell(E, H, F, T, kind, route, options.rounds)
                cells.append(row)
                print(
                    f"E={E:4d} H={H} F={F} T={T} {kind:8s} {route:10s} "
                    f"eager {row['ms']['eager']:.3f} ms  compiled {row['compiled_over_eager']:.3f}x  "
                    f"fullgraph {row['fullgraph_over_eager']:.3f}x  graphs {row['graphs_compiled']}",
                    flush=True,
                )
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "cells": cells,
    }
    if options.out is not None:
        results_files.write_results(
            options.out, results_files.gpu_stem("compile_", result["gpu"]), result, plot
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
