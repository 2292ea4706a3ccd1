"""What is alive at the peak of one experts forward + backward (CUDA memory snapshot).

For each implementation of ``bench_hf_moe.py`` (``groupgrad``,
``groupgrad_unrouted``, ``grouped_mm``), one forward + backward of the
Qwen3-30B-A3B-sized experts runs under ``torch.cuda.memory``'s allocation
history; the history is replayed to find the moment of the peak, and every
allocation alive then (made during the step) is listed with the line of
groupgrad, transformers or PyTorch autograd code that made it. Sizes in MiB.

Usage (a GPU; the CUTLASS kernels prebuilt): ``python benchmarks/memory_peak.py
--tokens 4096 --grad bf16_grad [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_hf_moe as bench

OURS = ("groupgrad", "transformers", "torch/autograd", "torch/utils/checkpoint")


def _origin(frames: list[dict]) -> str:
    """The innermost frame of groupgrad, transformers or autograd code: ``file:line function``."""
    for frame in frames:
        name = frame["filename"]
        if any(part in name for part in OURS) and "memory_peak" not in name:
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{frame['line']} {frame['name']}"
    return "(other)"


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replay one device's allocation events: the peak growth and the allocations alive then."""
    live: dict[int, dict] = {}
    current = best = 0
    at_best: list[dict] = []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        if current > best:
            best, at_best = current, list(live.values())
    return best, at_best


def snapshot_step(impl: str, tokens: int, grad: str) -> dict:
    """One recorded forward + backward of ``impl``; the allocations alive at its peak."""
    shape = bench.Shape(**{**asdict(bench.QWEN3_30B_A3B), "T": tokens})
    device = torch.device("cuda")
    model = bench.qwen3_moe(shape, device, torch.bfloat16)
    model.set_experts_implementation(impl)
    experts = model.model.layers[0].mlp.experts
    bench.set_grad_dtype(experts, bench.GRAD_DTYPES[grad])
    index, weights, _ = bench.skewed_routing(shape, 0, device)
    generator = torch.Generator().manual_seed(1)
    hidden = (0.5 * torch.randn(tokens, shape.H, generator=generator)).to(device, torch.bfloat16)
    dy = torch.randn(tokens, shape.H, generator=generator).to(device, torch.bfloat16)

    def step() -> None:
        x = hidden.detach().requires_grad_(True)
        experts(x, index, weights.to(torch.bfloat16).requires_grad_(True)).backward(dy)

    step()  # warm-up: lazy buffers and caches settle
    bench.clear_grads(experts)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    bench.clear_grads(experts)
    peak, alive = live_at_peak(snapshot["device_traces"][device.index or 0])
    by_origin: Counter[tuple[str, int]] = Counter()
    for event in alive:
        by_origin[(_origin(event.get("frames", [])), event["size"])] += 1
    return {
        "impl": impl,
        "tokens": tokens,
        "grad": grad,
        "peak_MiB": peak / 2**20,
        "alive": [
            {"origin": origin, "MiB": size / 2**20, "count": count}
            for (origin, size), count in sorted(by_origin.items(), key=lambda kv: -kv[0][1] * kv[1])
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--grad", choices=tuple(bench.GRAD_DTYPES), default="bf16_grad")
    parser.add_argument(
        "--impls", nargs="+", default=["groupgrad", "groupgrad_unrouted", "grouped_mm"]
    )
    parser.add_argument("--out", type=Path, default=None, help="write memory_peak.json here")
    args = parser.parse_args()
    results = [snapshot_step(impl, args.tokens, args.grad) for impl in args.impls]
    for result in results:
        print(
            f"\n{result['impl']} (T={result['tokens']}, {result['grad']}): peak growth "
            f"{result['peak_MiB']:.0f} MiB; alive at the peak (>= 1 MiB):"
        )
        for row in result["alive"]:
            if row["MiB"] * row["count"] >= 1:
                print(f"  {row['count']:>2} x {row['MiB']:8.1f} MiB  {row['origin']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory_peak.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
