"""Where the host (CPU) time of one grouped GEMM call and one GroupedMLP step goes (CUDA).

Each layer of a call (``groupgrad.kernels.tuning.host_stages``: validation,
support check, plan, the raw C++ entry point, the CUTLASS backend, the CUDA
kernel of the custom op called directly, the custom op, the public function)
is timed as CPU time per call over calls enqueued back to back
(``perf_counter``, no sync inside the loop), for the E = 128 MoE config
(K = 2048, N = 1536, T = 32768): fprop with packed weights, wgrad into a
packed fp32 ``main_grad`` and into E separate ones, beside ``torch._grouped_mm``
on the same fprop operands (one C++ op: a yardstick of the host's speed). Then ``cProfile`` of
GroupedMLP steps, packed and per-expert parameters. Diagnostic only:
``python benchmarks/host_profile.py``.

Legend: ``T`` tokens, ``E`` experts, ``K`` in_features, ``N`` out_features.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernels_timing as kt

from groupgrad.kernels import swiglu_probs, swiglu_probs_backward, tuning
from groupgrad.modules import GroupedMLP


def host_us(fn: Callable[[], object], calls: int) -> float:
    """CPU µs per call of ``fn`` (``kernels_timing.host_us`` on one input set)."""
    return kt.host_us(lambda _set: fn(), n_sets=1, calls=calls)


def gemm_stages() -> None:
    E, K, N, T = 128, 2048, 1536, 32768
    dev = "cuda"
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
    splits = torch.full((E,), T // E, device=dev, dtype=torch.int64)
    mg_packed = torch.zeros(E, N, K, device=dev)
    mg_list = [torch.zeros(N, K, device=dev) for _ in range(E)]
    calls = {
        "fprop": tuning.host_stages("fprop", x, w, splits, y),
        "wgrad packed": tuning.host_stages("wgrad", dy, x, splits, mg_packed, accumulate=True),
        "wgrad list": tuning.host_stages("wgrad", dy, x, splits, mg_list, accumulate=True),
    }
    stages: dict[str, Callable[[], object]] = {
        f"{call} {stage}": fn for call, by_stage in calls.items() for stage, fn in by_stage.items()
    }
    stages["get_device_capability"] = lambda: torch.cuda.get_device_capability(x.device)
    stages["empty (caching allocator)"] = lambda: torch.empty(1024, device=dev, dtype=torch.uint8)
    offs = torch.cumsum(splits, 0).to(torch.int32)  # yardstick: one C++ op, one grouped GEMM
    stages["torch._grouped_mm fprop"] = lambda: torch._grouped_mm(
        x, w.transpose(1, 2), offs=offs, out_dtype=torch.bfloat16
    )
    h = torch.randn(T, 2 * 768, device=dev, dtype=torch.bfloat16)
    da = torch.randn(T, 768, device=dev, dtype=torch.bfloat16)
    probs = torch.rand(T, device=dev)
    stages["swiglu fwd (triton)"] = lambda: swiglu_probs(h, probs)
    stages["swiglu bwd (triton)"] = lambda: swiglu_probs_backward(da, h, probs)
    for name, fn in stages.items():
        print(f"{name:40s} {host_us(fn, 50):9.1f} us", flush=True)


def mlp_profile(single: bool) -> None:
    E, H, F, T = 128, 2048, 768, 32768
    dev = "cuda"
    mlp = GroupedMLP(
        E,
        H,
        F,
        dtype=torch.bfloat16,
        device=dev,
        single_grouped_weight=single,
        accumulate_into_main_grad=True,
    )
    params = list(mlp.parameters())
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
        p.grad_added_to_main_grad = False
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device=dev, requires_grad=True)
    dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    splits = torch.full((E,), T // E, device=dev, dtype=torch.int64)

    def step() -> None:
        y = mlp(x, splits, probs)
        y.backward(dy)
        x.grad = probs.grad = None
        for p in params:
            p.grad = None

    print(f"\nGroupedMLP step, single_grouped_weight={single}: host {host_us(step, 10):.0f} us")
    profiler = cProfile.Profile()
    step()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(10):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("host_profile.py needs a CUDA GPU")
    tuning.build()
    gemm_stages()
    mlp_profile(True)
    mlp_profile(False)


if __name__ == "__main__":
    main()
