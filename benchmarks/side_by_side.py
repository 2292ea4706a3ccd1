"""Time the public API of two source trees side by side on one GPU: is a difference noise?

Each tree (a checkout's root: its ``packages/*/src``, ``kernels/src`` and
``integrations/*/src`` go on ``PYTHONPATH``) runs in its own process, in
alternating rounds (A B A B …), the same cells on the same seeded inputs:

* kernels: ``grouped_fprop`` and ``grouped_dgrad`` with packed weights,
  ``grouped_wgrad`` into a packed bf16 output and, accumulating, into ``E``
  separate fp32 ``main_grad`` buffers — the "ours" rows of
  ``bench_kernels.py`` for its first four configs — and the autograd route
  of ``E`` per-expert bf16 parameters whose ``grad_dtype`` is fp32 (the
  protocol's plan, the wgrad into its buffers, the plan's finish: what a
  per-expert layer's backward runs for its weights);
* MLP: ``GroupedMLP`` forward + backward with packed and with per-expert
  parameters, fp32 ``main_grad`` — the "ours" rows of ``bench_mlp.py`` for
  its first three configs;

each on uniform and mild-skew splits (``kernels_timing.splits_for``; the
committed tables' "skewed" rows are the same draws). Per cell it records the
GPU time (median of ``--reps`` calls, CUDA events) and the CPU time per call
(calls enqueued back to back). The two trees must share one compiled
CUTLASS build (same C++ sources), so only the Python layers differ.

Prints, per cell, each tree's median over rounds, the spread between rounds
of one tree (the noise) and the ratio B / A. ``--json`` writes every sample.
Usage: ``python benchmarks/side_by_side.py --trees NEW_ROOT OLD_ROOT --rounds 2``.

``--cpu`` times the host side of the autograd route on CPU tensors instead
(no GPU needed): ``E`` = 128 per-expert bf16 parameters whose ``grad_dtype``
is fp32, small matrices (``N = K = 16``, ``T = 256``) so that the reference
GEMM does not drown the host work; per cell the CPU time of the calling
thread (``time.thread_time``, so other processes on the machine count less)
per call, median of 5 batches of 20: the packed wgrad, the route (plan +
the same GEMM into ``plan.gemm_out`` + ``finish``), the plan and ``finish``
alone, and route minus packed from interleaved batches. The "ms" columns
are then CPU ms per call.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features,
``H`` hidden_size, ``F`` ffn_hidden_size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_timing as kt

import groupgrad.kernels
from groupgrad.kernels import grouped_dgrad, grouped_fprop, grouped_wgrad
from groupgrad.modules import GroupedMLP
from groupgrad.protocol import WeightGradPlan, plan_weight_grads

KERNEL_CONFIGS = [(8, 4096, 28672, 16384), (8, 7168, 4096, 32768), (128, 2048, 1536, 32768), (32, 2048, 7168, 65536)]  # fmt: skip
MLP_CONFIGS = [(8, 4096, 14336, 16384), (32, 7168, 2048, 65536), (128, 2048, 768, 32768)]
SPLIT_KINDS = ("uniform", "mild")
Cell = tuple[str, Callable[[int], object]]


def _source_path(root: Path) -> str:
    folders = [*root.glob("packages/*/src"), root / "kernels" / "src", *root.glob("integrations/*/src")]  # fmt: skip
    return os.pathsep.join(str(f) for f in folders if f.is_dir())


def _kernel_cells(E: int, K: int, N: int, T: int, kind: str, seed: int) -> list[Cell]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    splits = torch.tensor(kt.splits_for(kind, T, E, seed), device="cuda")
    x = [_randn(gen, T, K) for _ in range(2)]
    dy = [_randn(gen, T, N) for _ in range(2)]
    w = [_randn(gen, E, N, K) * 0.05 for _ in range(2)]
    y, dx = torch.empty_like(dy[0]), torch.empty_like(x[0])
    dw = torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16)
    main_grads = [torch.zeros(N, K, device="cuda") for _ in range(E)]
    tag = f"E={E} K={K} N={N} T={T} {kind}"

    params = [torch.nn.Parameter(torch.empty(N, K, device="cuda", dtype=torch.bfloat16)) for _ in range(E)]  # fmt: skip
    for p in params:
        p.grad_dtype = torch.float32

    def wgrad_fp32(i: int) -> None:
        grouped_wgrad(dy[i], x[i], splits, out=main_grads, accumulate=True)

    def wgrad_autograd_route(i: int) -> None:
        plan = plan_weight_grads(
            params,
            shape=(N, K),
            compute_dtype=torch.bfloat16,
            device=dy[i].device,
            wgrad_into_main_grad=False,
        )
        grouped_wgrad(dy[i], x[i], splits, out=plan.gemm_out)
        plan.finish()

    return [
        (f"fprop {tag}", lambda i: grouped_fprop(x[i], w[i], splits, out=y)),
        (f"dgrad {tag}", lambda i: grouped_dgrad(dy[i], w[i], splits, out=dx)),
        (f"wgrad_bf16 {tag}", lambda i: grouped_wgrad(dy[i], x[i], splits, out=dw)),
        (f"wgrad_fp32_acc {tag}", wgrad_fp32),
        (f"wgrad_autograd_route {tag}", wgrad_autograd_route),
    ]


def _mlp_cell(E: int, H: int, F: int, T: int, kind: str, packed: bool) -> Cell:
    gen = torch.Generator(device="cuda").manual_seed(T + E)
    splits = torch.tensor(kt.splits_for(kind, T, E, E), device="cuda")
    xs = [_randn(gen, T, H).requires_grad_() for _ in range(2)]
    probs = [torch.rand(T, device="cuda", generator=gen).requires_grad_() for _ in range(2)]
    dys = [_randn(gen, T, H) for _ in range(2)]
    mlp = GroupedMLP(
        E,
        H,
        F,
        dtype=torch.bfloat16,
        device="cuda",
        single_grouped_weight=packed,
        accumulate_into_main_grad=True,
    )
    for p in mlp.parameters():
        p.main_grad = torch.zeros(p.shape, device="cuda")
        p.grad_added_to_main_grad = False

    def step(i: int) -> None:
        mlp(xs[i], splits, probs[i]).backward(dys[i])
        for t in (xs[i], probs[i], *mlp.parameters()):
            t.grad = None

    return (f"{'mlp' if packed else 'mlp_per_expert'} E={E} H={H} F={F} T={T} {kind}", step)


def _cpu_cells(E: int = 128, N: int = 16, K: int = 16, T: int = 256) -> list[Cell]:
    """The autograd route's host work on CPU tensors (``--cpu``): packed wgrad, route, plan."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
    dy = torch.randn(T, N, generator=gen).to(torch.bfloat16)
    splits = torch.full((E,), T // E, dtype=torch.int64)
    dw = torch.empty(E, N, K)
    params = [torch.nn.Parameter(torch.empty(N, K, dtype=torch.bfloat16)) for _ in range(E)]
    for p in params:
        p.grad_dtype = torch.float32
    names = [f"weight{e}" for e in range(E)]

    def plan() -> WeightGradPlan:
        return plan_weight_grads(
            params,
            shape=(N, K),
            compute_dtype=torch.bfloat16,
            device=x.device,
            wgrad_into_main_grad=False,
            names=names,
        )

    def packed(_: int) -> None:
        grouped_wgrad(dy, x, splits, out=dw)

    def route(_: int) -> None:
        made = plan()
        grouped_wgrad(dy, x, splits, out=made.gemm_out, names=made.gemm_names)
        made.finish()

    def plan_and_finish(_: int) -> None:
        made = plan()
        _ = made.gemm_names  # what the route hands the GEMM
        made.finish()

    tag = f"E={E} K={K} N={N} T={T} cpu"
    return [
        (f"wgrad_fp32 packed {tag}", packed),
        (f"wgrad_autograd_route {tag}", route),
        (f"plan+finish {tag}", plan_and_finish),
    ]


def _thread_us(fn: Callable[[int], object], calls: int = 20, batches: int = 5) -> float:
    """CPU time of this thread per call (µs), median of ``batches`` batches of ``calls``."""
    fn(0)
    per_call = []
    for _ in range(batches):
        start = time.thread_time()
        for i in range(calls):
            fn(i)
        per_call.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(per_call)


def _cpu_worker() -> list[dict]:
    """``--cpu``: each cell's CPU µs per call, and route minus packed from interleaved batches."""
    rows = []
    cells = _cpu_cells()
    for name, fn in cells:
        us = _thread_us(fn)
        rows.append({"cell": name, "ms": us / 1e3, "host_us": us})
    (packed_name, packed), (_, route) = cells[0], cells[1]
    diffs = [_thread_us(route, batches=1) - _thread_us(packed, batches=1) for _ in range(5)]
    us = statistics.median(diffs)
    rows.append(
        {"cell": packed_name.replace("packed", "route minus packed"), "ms": us / 1e3, "host_us": us}
    )
    return rows


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)


def _worker(reps: int, only: str) -> list[dict]:
    """Time every cell (whose name holds ``only``) with whichever groupgrad ``PYTHONPATH`` provides."""
    print(f"groupgrad.kernels from {groupgrad.kernels.__file__}", file=sys.stderr)
    rows = []

    def measure(cells: list[Cell]) -> None:
        for name, fn in cells:
            if only not in name:
                continue
            ms = kt.median_ms(fn, 2, reps)
            rows.append({"cell": name, "ms": ms, "host_us": kt.host_us(fn, 2, calls=50)})
        torch.cuda.empty_cache()

    for seed, (E, K, N, T) in enumerate(KERNEL_CONFIGS):
        for kind in SPLIT_KINDS:
            measure(_kernel_cells(E, K, N, T, kind, seed))
    for E, H, F, T in MLP_CONFIGS:
        for kind in SPLIT_KINDS:
            for packed in (True, False):
                measure([_mlp_cell(E, H, F, T, kind, packed)])
    return rows


def _summary(samples: dict[str, list[list[dict]]], names: list[str]) -> None:
    first, *others = names
    header = f"{'cell':52s}" + "".join(
        f" {n + ' ms':>12s} {'spread':>7s} {'host µs':>8s}" for n in names
    )
    print(header + "".join(f" {o + '/' + first:>10s}" for o in others))
    cells = [row["cell"] for row in samples[first][0]]
    for index, cell in enumerate(cells):
        line, medians = f"{cell:52s}", {}
        for name in names:
            ms = [run[index]["ms"] for run in samples[name]]
            host = [run[index]["host_us"] for run in samples[name]]
            medians[name] = statistics.median(ms)
            spread = (max(ms) - min(ms)) / medians[name]
            line += f" {medians[name]:12.3f} {spread:7.1%} {statistics.median(host):8.0f}"
        print(line + "".join(f" {medians[o] / medians[first]:10.3f}" for o in others))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=Path, help="checkout roots; the first is A")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", default="", help="time only the cells whose name holds this")
    parser.add_argument("--cpu", action="store_true", help="time the autograd route on the CPU")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_cpu_worker() if args.cpu else _worker(args.reps, args.only)))
        return 0
    names = [str(t) for t in args.trees]
    samples: dict[str, list[list[dict]]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for tree, name in zip(args.trees, names, strict=True):
            inherited = os.environ.get("PYTHONPATH", "")  # e.g. wheels unpacked for the build
            path = os.pathsep.join(p for p in (_source_path(tree.resolve()), inherited) if p)
            env = {**os.environ, "PYTHONPATH": path}
            command = [sys.executable, __file__, "--worker", "--reps", str(args.reps)]
            command += ["--only", args.only] + (["--cpu"] if args.cpu else [])
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            samples[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            source = next((line for line in done.stderr.splitlines() if " from " in line), "")
            print(f"round {round_ + 1}: {name} done ({source})", flush=True)
    _summary(samples, names)
    if args.json is not None:
        args.json.write_text(json.dumps(samples, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
