"""Where the host (CPU) time of one grouped GEMM call and one GroupedMLP step goes (CUDA).

Each stage is timed as CPU time per call over calls enqueued back to back
(``perf_counter``, no sync inside the loop), for the E = 128 MoE config
(K = 2048, N = 1536, T = 32768): validation, the CUDA kernel of the custom op
called directly, the CUTLASS backend with a fixed plan, the raw C++ entry
point, and the public function. Then ``cProfile`` of GroupedMLP steps, packed
and per-expert parameters. Diagnostic only: ``python benchmarks/host_profile.py``.

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

from groupgrad.kernels import _cutlass, _dispatch, _validate, grouped_fprop, grouped_wgrad
from groupgrad.modules import GroupedMLP
from groupgrad.modules._swiglu import swiglu_probs, swiglu_probs_backward


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
    plan = _cutlass.plan_for("fprop", torch.bfloat16, torch.bfloat16, T, E, N, K)
    ext = _cutlass._extension(plan.variant)
    wplan = _cutlass.plan_for("wgrad", torch.bfloat16, torch.float32, T, E, N, K, True)
    stages: dict[str, Callable[[], object]] = {
        "fprop validate": lambda: _validate.grouped_call("fprop", x, w, splits, y),
        "fprop layout_reason": lambda: _dispatch.layout_reason("fprop", x, [w], y),
        "fprop unsupported_reason": lambda: _cutlass.unsupported_reason("fprop", x, [w], y),
        "fprop raw C++": lambda: ext.fprop(x, [w], splits, y, plan.variant, False, 1),
        "fprop backend (plan_for + C++)": lambda: _cutlass.fprop(x, [w], splits, y),
        "fprop op kernel direct": lambda: _dispatch.fprop_on_device(x, [w], splits, y),
        "fprop custom op": lambda: torch.ops.groupgrad.grouped_fprop(x, [w], splits, y),
        "fprop public": lambda: grouped_fprop(x, w, splits, out=y),
        "wgrad packed raw C++": lambda: _cutlass._extension(wplan.variant).wgrad(
            dy, x, splits, [mg_packed], True, wplan.variant, False, 1
        ),
        "wgrad packed public": lambda: grouped_wgrad(dy, x, splits, out=mg_packed, accumulate=True),
        "wgrad list validate": lambda: _validate.wgrad_call(dy, x, splits, mg_list, None, True),
        "wgrad list unsupported_reason": lambda: _cutlass.unsupported_reason(
            "wgrad", dy, x, mg_list
        ),
        "wgrad list raw C++": lambda: _cutlass._extension(wplan.variant).wgrad(
            dy, x, splits, mg_list, True, wplan.variant, False, 1
        ),
        "wgrad list public": lambda: grouped_wgrad(dy, x, splits, out=mg_list, accumulate=True),
        "get_device_capability": lambda: torch.cuda.get_device_capability(x.device),
        "empty (caching allocator)": lambda: torch.empty(1024, device=dev, dtype=torch.uint8),
    }
    h = torch.randn(T, 2 * 768, device=dev, dtype=torch.bfloat16)
    da = torch.randn(T, 768, device=dev, dtype=torch.bfloat16)
    probs = torch.rand(T, device=dev)
    stages["swiglu fwd (triton)"] = lambda: swiglu_probs(h, probs)
    stages["swiglu bwd (triton)"] = lambda: swiglu_probs_backward(da, h, probs)
    for name, fn in stages.items():
        print(f"{name:36s} {host_us(fn, 50):9.1f} us", flush=True)


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
    _cutlass.build()
    gemm_stages()
    mlp_profile(True)
    mlp_profile(False)


if __name__ == "__main__":
    main()
