"""FP8 quantizers' bandwidth on the GPU: bytes moved per second against the run's copy rate.

Target (the FP8 kernels issue): (bytes read + written, scales included) / time
>= 0.70 x the copy rate for tensors of >= 16k rows, both forms counting one
read of the source (on CUDA two kernels write them, each reading it, since
DEVICE_RUNS 114); both forms also at T = 65536, C = 7168, E = 32. Also the
FP8 SwiGLU backward (``swiglu_probs_backward_fp8``, every form asked: about
9 bytes per element of ``a``), at the fused MLP's E = 8 and E = 32 shapes,
its inputs and outputs each counted once. Prints each
case's share of the copy rate and writes JSON with ``--json``; also the time
per call of 128 one-expert weights packed, as views of one buffer
and in allocations apart (:func:`weight_lists`).

Two times per case: ``gpu_ms``, the GPU's own time per call (calls queued
behind a spin kernel, so the host's issue time overlaps the GPU's work — the
bandwidth figure uses it), and ``idle_ms``, one call issued from an idle GPU
until it is done (host and GPU in series; what a call costs when nothing else
hides its host time). Before DEVICE_RUNS 85 only the second was measured, and
called the bandwidth: at these sizes it is mostly the host's time.
Usage: ``python benchmarks/bench_fp8_quant.py [--json PATH]``.

Legend: ``T`` tokens, ``C`` channels, ``E`` experts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from groupgrad.kernels import quantize_fp8, swiglu_probs_backward_fp8, swiglu_probs_fp8


def _idle_seconds(fn: Callable[[], object], repeats: int = 50) -> float:
    """Median seconds of one call issued from an idle GPU until done (CUDA events)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _gpu_seconds(fn: Callable[[], object], calls: int = 20, rounds: int = 5) -> float:
    """Median GPU seconds per call: ``calls`` calls queued behind a ~50 ms spin kernel, so
    the host has issued them all before the first one runs (its time hidden)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _both_forms(x: torch.Tensor, splits: torch.Tensor) -> tuple[Callable[[], object], int]:
    """The call quantizing ``x`` into both forms, and its bytes (``x`` counted once)."""
    both = quantize_fp8(x, block=((1, 128), (128, 1)), splits=splits)
    moved = _nbytes(x, *(t for q in both for t in (q.data, q.scales)))
    return lambda: quantize_fp8(x, block=((1, 128), (128, 1)), splits=splits), moved


def _swiglu_backward(E: int, T: int, F: int) -> tuple[Callable[[], object], int]:
    """The FP8 SwiGLU backward of ``E`` equal experts writing every form, and its bytes."""
    h = torch.randn(T, 2 * F, device="cuda").bfloat16()
    da = torch.randn(T, F, device="cuda").bfloat16()
    probs = torch.rand(T, device="cuda")
    h_rows, _ = swiglu_probs_fp8(h, probs)
    splits = torch.full((E,), T // E, device="cuda")

    def call() -> tuple:
        return swiglu_probs_backward_fp8(da, h_rows, probs, splits=splits)

    dh, dh_tokens, dprobs, a_tokens = call()
    forms = (t for q in (dh, dh_tokens, a_tokens) if q is not None for t in (q.data, q.scales))
    assert dprobs is not None
    return call, _nbytes(da, h_rows.data, h_rows.scales, probs, dprobs, *forms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    T, C, E = 16384, 4096, 8
    x = torch.randn(T, C, device="cuda").bfloat16()
    w = torch.randn(E, 2048, 4096, device="cuda").bfloat16()
    splits = torch.full((E,), T // E, device="cuda")
    src, dst = torch.empty(2**28, device="cuda"), torch.empty(2**28, device="cuda")
    copy = 2 * _nbytes(src) / _gpu_seconds(lambda: dst.copy_(src))
    rows = quantize_fp8(x, block=(1, 128))
    weights = quantize_fp8(w, block=(128, 128))
    big_x = torch.randn(65536, 7168, device="cuda").bfloat16()
    big_splits = torch.full((32,), 65536 // 32, device="cuda")
    cases = {
        "rows": (lambda: quantize_fp8(x, block=(1, 128)), _nbytes(x, rows.data, rows.scales)),
        "rows+segments": _both_forms(x, splits),
        "rows+segments T=65536 C=7168 E=32": _both_forms(big_x, big_splits),
        "weights": (
            lambda: quantize_fp8(w, block=(128, 128)),
            _nbytes(w, weights.data, weights.data_t, weights.scales),
        ),
        "swiglu backward E=8 T=16384 F=14336": _swiglu_backward(8, 16384, 14336),
        "swiglu backward E=32 T=65536 F=2048": _swiglu_backward(32, 65536, 2048),
    }
    report = {}
    print(f"copy rate {copy / 1e12:.2f} TB/s; T={T} C={C} E={E}, weights ({E}, 2048, 4096)")
    for name, (fn, moved) in cases.items():
        seconds, idle = _gpu_seconds(fn), _idle_seconds(fn)
        report[name] = {
            "gpu_ms": seconds * 1e3,
            "idle_ms": idle * 1e3,
            "share_of_copy": moved / seconds / copy,
        }
        print(
            f"{name:34s} GPU {seconds * 1e3:8.3f} ms  {report[name]['share_of_copy']:.2f} x copy"
            f"  (from an idle GPU: {idle * 1e3:.3f} ms)"
        )
    report["weight_lists"] = weight_lists()
    if args.json is not None:
        args.json.write_text(json.dumps({"copy_TBps": copy / 1e12, **report}, indent=1))
    return 0


def weight_lists(E: int = 128, shapes: tuple[tuple[int, int], ...] = ((1536, 2048), (2048, 768))):
    """ms per call (issued from an idle GPU, until done) of E one-expert weights, by layout.

    ``packed``: one ``(E, N, K)`` tensor; ``views``: its ``E`` views (evenly
    spaced: one launch); ``apart``: each in an allocation of its own (one launch,
    through a table of their addresses). Qwen3-30B-A3B's experts are the default.
    """
    found: dict[str, float] = {}
    for N, K in shapes:
        w = torch.randn(E, N, K, device="cuda").bfloat16()
        apart = [
            torch.empty(N * K + 4096 * e, dtype=w.dtype, device="cuda")[: N * K].view(N, K).copy_(m)
            for e, m in enumerate(w)
        ]
        forms = {"packed": w, "views": list(w.unbind(0)), "apart": apart}
        for name, source in forms.items():
            ms = 1e3 * _idle_seconds(lambda s=source: quantize_fp8(s, block=(128, 128)), repeats=5)
            found[f"E={E} {N}x{K} {name}"] = ms
            print(f"weights E={E} ({N}, {K}) {name:7s} {ms:8.3f} ms")
    return found


if __name__ == "__main__":
    raise SystemExit(main())
