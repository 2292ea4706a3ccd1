"""Host (CPU) cost per call of the FP8 grouped GEMMs beside the bf16 ones, in one process.

Median µs per call, calls enqueued back to back (``kernels_timing.host_us``),
device ``splits``, E = 128 small experts (K = N = 256, 8 tokens each) so the
GPU never waits for the host's work to show: fprop, dgrad, wgrad into a packed
fp32 ``main_grad`` and into 128 listed fp32 ``main_grad``s, FP8 and bf16.
Targets (FP8 kernels issue): FP8 ≤ 1.15× the bf16 packed call; 128 listed
fp32 ``main_grad``s ≤ 140 µs. Usage: ``python benchmarks/host_fp8.py``.
"""

from __future__ import annotations

import json

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
    result = {name: kt.host_us(fn, 1, calls=50, batches=9) for name, fn in calls.items()}
    for name, us in result.items():
        print(f"{name:30s} {us:7.1f} µs")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
