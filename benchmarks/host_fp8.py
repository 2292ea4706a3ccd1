"""Host (CPU) cost per call of the FP8 grouped GEMMs beside the bf16 ones, in one process.

Median µs per call over 11 rounds, each round one batch of 50 calls enqueued back to
back of every function in turn (``kernels_timing.host_us_rounds``), and each FP8 / bf16
ratio as the median of the rounds' ratios (the host's speed may drift); device
``splits``, E = 128 small experts (K = N = 256, 8 tokens each) so the GPU never waits
for the host's work to show: fprop, dgrad, wgrad into a packed fp32 ``main_grad`` and
into 128 listed fp32 ``main_grad``s, FP8 and bf16. Targets (FP8 kernels issue): FP8 ≤
1.15× the bf16 packed call; 128 listed fp32 ``main_grad``s ≤ 140 µs. Usage: ``python
benchmarks/host_fp8.py``.
"""

from __future__ import annotations

import json
import operator
import statistics

import kernels_timing as kt
import torch

from groupgrad.kernels import grouped_dgrad, grouped_fprop, grouped_wgrad, quantize_fp8


def main() -> None:
    E, K, N, per = 128, 256, 256, 8
    T = E * per
    splits = torch.full((E,), per, device="cuda")
    x, dy = torch.randn(T, K, device="cuda").bfloat16(), torch.randn(T, N, device="cuda").bfloat16()
    w = torch.randn(E, N, K, device="cuda").bfloat16()
    x_rows, x_seg = quantize_fp8(x, block=((1, 128), (128, 1)), splits=splits)
    dy_rows, dy_seg = quantize_fp8(dy, block=((1, 128), (128, 1)), splits=splits)
    w8 = quantize_fp8(w, block=(128, 128))
    packed = torch.zeros(E, N, K, device="cuda")
    listed = [torch.zeros(N, K, device="cuda") for _ in range(E)]
    calls = {
        "fprop bf16": lambda i: grouped_fprop(x, w, splits),
        "fprop fp8": lambda i: grouped_fprop(x_rows, w8, splits),
        "dgrad bf16": lambda i: grouped_dgrad(dy, w, splits),
        "dgrad fp8": lambda i: grouped_dgrad(dy_rows, w8, splits),
        "wgrad bf16 packed fp32": lambda i: grouped_wgrad(
            dy, x, splits, out=packed, accumulate=True
        ),
        "wgrad fp8 packed fp32": lambda i: grouped_wgrad(
            dy_seg, x_seg, splits, out=packed, accumulate=True
        ),
        "wgrad bf16 128 listed fp32": lambda i: grouped_wgrad(
            dy, x, splits, out=listed, accumulate=True
        ),
        "wgrad fp8 128 listed fp32": lambda i: grouped_wgrad(
            dy_seg, x_seg, splits, out=listed, accumulate=True
        ),
    }
    rounds = kt.host_us_rounds(calls, 1, calls=50, rounds=11)
    result = {name: statistics.median(us) for name, us in rounds.items()}
    for name, us in result.items():
        print(f"{name:30s} {us:7.1f} µs")
    for fp8 in [name for name in calls if " fp8" in name]:  # FP8 / bf16, median of the rounds'
        ratios = map(operator.truediv, rounds[fp8], rounds[fp8.replace(" fp8", " bf16")])
        key = f"{fp8} / bf16"
        result[key] = statistics.median(ratios)
        print(f"{key:30s} {result[key]:7.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
