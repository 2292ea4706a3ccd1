"""Where a skewed wgrad into fp32 ``main_grad`` spends its time: all experts, then each kind alone.

For the FLOP-bound wgrad-into-fp32 cells of ``bench_kernels.py`` (configs 0, 1
and 3, every split kind), an expert is *memory-bound* when reading and
writing its fp32 ``main_grad`` at the copy rate takes longer than its FLOPs
at the dense rate (fewer than ``4 · dense / copy`` tokens, from the ceilings
measured first in the same run) and *FLOP-bound* otherwise. Ours (the public
``grouped_wgrad``, accumulating into each expert's own fp32 ``main_grad``) is
timed, interleaved in one run, on all experts, on the FLOP-bound experts
alone and on the memory-bound experts alone (the other experts' rows
removed and their token counts 0: an accumulating wgrad leaves an expert
without tokens untouched). When the whole takes the sum of its parts, the
two kinds run one after the other; when it takes the longer part, side by
side. Each part's floor is printed beside it.

Usage: ``python benchmarks/wgrad_phases.py [--out DIR]`` (writes
``wgrad_phases_<gpu>.json`` there).

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernels_timing as kt
from bench_kernels import CONFIGS

from groupgrad.kernels import grouped_wgrad

FLOP_BOUND_CONFIGS = (0, 1, 3)


def part(
    dy: torch.Tensor,
    x: torch.Tensor,
    splits: list[int],
    keep: list[bool],
    main_grads: list[torch.Tensor],
) -> Callable[[int], object] | None:
    """Ours on the kept experts only (``None`` when none of them has tokens)."""
    starts = [sum(splits[:e]) for e in range(len(splits))]
    rows = [
        torch.arange(s, s + n, device="cuda")
        for s, n, k in zip(starts, splits, keep, strict=True)
        if k
    ]
    kept = [n if k else 0 for n, k in zip(splits, keep, strict=True)]
    if sum(kept) == 0:
        return None
    index = torch.cat(rows)
    dy_kept, x_kept = dy[index].contiguous(), x[index].contiguous()
    splits_dev = torch.tensor(kept, device="cuda")
    return lambda _i: grouped_wgrad(dy_kept, x_kept, splits_dev, out=main_grads, accumulate=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON result")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("wgrad_phases.py needs a CUDA GPU")
    copy_gbs, dense_tflops = kt.copy_bandwidth_gbs(), kt.dense_bf16_tflops()
    threshold = 4 * dense_tflops * 1e12 / (copy_gbs * 1e9)
    print(f"ceilings: copy {copy_gbs:.0f} GB/s, dense {dense_tflops:.0f} TFLOP/s; "
          f"memory-bound below {threshold:.0f} tokens per expert", flush=True)  # fmt: skip
    rows = []
    for config in FLOP_BOUND_CONFIGS:
        E, K, N, T = CONFIGS[config]
        gen = torch.Generator(device="cuda").manual_seed(config)
        x = torch.randn(T, K, device="cuda", generator=gen, dtype=torch.bfloat16)
        dy = torch.randn(T, N, device="cuda", generator=gen, dtype=torch.bfloat16)
        main_grads = [torch.zeros(N, K, device="cuda") for _ in range(E)]
        for kind in kt.SPLIT_KINDS:
            splits = kt.splits_for(kind, T, E, seed=config)
            flop_bound = [n >= threshold for n in splits]
            memory_bound = [0 < n < threshold for n in splits]
            fns = {
                "all": part(dy, x, splits, [True] * E, main_grads),
                "flop_bound": part(dy, x, splits, flop_bound, main_grads),
                "memory_bound": part(dy, x, splits, memory_bound, main_grads),
            }
            present = {name: fn for name, fn in fns.items() if fn is not None}
            times = kt.interleaved_ms(present, 1, rounds=args.rounds, per_round=3)
            floors = {
                name: 1e3
                * max(
                    2.0
                    * N
                    * K
                    * sum(n for n, k in zip(splits, keep, strict=True) if k)
                    / (dense_tflops * 1e12),
                    8.0
                    * N
                    * K
                    * sum(1 for n, k in zip(splits, keep, strict=True) if k and n)
                    / (copy_gbs * 1e9),
                )
                for name, keep in (
                    ("all", [True] * E),
                    ("flop_bound", flop_bound),
                    ("memory_bound", memory_bound),
                )
            }
            parts = [times.get("flop_bound", 0.0), times.get("memory_bound", 0.0)]
            row = {
                "case": f"E={E} K={K} N={N} T={T} {kind}",
                "memory_bound_experts": sum(memory_bound),
                "empty_experts": splits.count(0),
                "times_ms": times,
                "floors_ms": floors,
                "sum_of_parts_ms": sum(parts),
                "longer_part_ms": max(parts),
            }
            rows.append(row)
            print(
                f"{row['case']:40s} memory-bound experts {sum(memory_bound):2d}: all "
                f"{times['all']:.3f} ms (floor {floors['all']:.3f}); FLOP-bound alone "
                f"{parts[0]:.3f} (floor {floors['flop_bound']:.3f}); memory-bound alone "
                f"{parts[1]:.3f} (floor {floors['memory_bound']:.3f}); sum {sum(parts):.3f}",
                flush=True,
            )
        del main_grads, x, dy
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "_")
        result = {"gpu": torch.cuda.get_device_name(), "copy_gbs": copy_gbs,
                  "dense_bf16_tflops": dense_tflops, "threshold_tokens": threshold, "rows": rows}  # fmt: skip
        (args.out / f"wgrad_phases_{gpu}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
