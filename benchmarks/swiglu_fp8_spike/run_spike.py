"""Spike driver: the FP8 SwiGLU backward in one CUDA kernel against Triton's two and the reference.

Run on the GPU machine from the repository root (the packages on ``PYTHONPATH``)::

    python3 benchmarks/swiglu_fp8_spike/run_spike.py

It builds the kernel twice (``__launch_bounds__`` minimum 1 and 2 CTAs per SM)
with ``torch.utils.cpp_extension.load``, then checks every output against
``_swiglu_fp8_triton.backward_triton`` and ``_swiglu_fp8.backward_ref`` with the
GPU test's tolerance (``kernels/tests/test_gpu_swiglu_fp8.py``: bytes ≥ 97 %
equal, scales equal or a factor 2 apart for ≤ 2 %, ``dprobs`` within 1 %),
on ragged, empty, skewed and 300-expert splits, bf16 and fp16, with and
without probs, each form alone, and malformed device splits (NaN token
scales; the rows form and ``dprobs`` as for good splits). Outputs are
allocated from memory filled with 0xFF first, so an unwritten byte fails.
Then it times the three (5 rounds × 10 calls queued behind a spin kernel,
medians of 3 interleaved repetitions) at E = 8, 32 (uniform, heavy) and 128,
against the 9 bytes per element of ``a`` the op must move.

Legend: ``T`` tokens, ``F`` ffn_hidden_size, ``E`` experts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import cpp_extension

from groupgrad.kernels import _fp8_ops, _swiglu_fp8
from groupgrad.kernels import _swiglu_fp8_triton as triton_kernels

HERE = Path(__file__).resolve().parent
FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-DSWB_NS=swb"]
SPLITS = [[4096], [1, 0, 127, 128, 129, 0, 3000, 7], [0, 0, 0, 5], [33] * 64, [7] * 150 + [0] * 150]
SHAPES = [
    ("E=8 T=16384 F=14336", [2048] * 8, 14336),
    ("E=32 T=65536 F=2048", [2048] * 32, 2048),
    ("E=32 heavy F=2048", [65536 - 31 * 256] + [256] * 31, 2048),
    ("E=128 T=32768 F=768", [256] * 128, 768),
]


def build() -> dict[str, object]:
    sources = [str(HERE / "binding.cpp"), str(HERE / "swiglu_backward_spike.cu")]
    return {
        f"cuda{blocks}": cpp_extension.load(
            f"gg_swiglu_spike_{blocks}",
            sources,
            extra_cuda_cflags=[*FLAGS, f"-DSWB_MIN_BLOCKS={blocks}"],
        )
        for blocks in (1, 2)
    }


def poison() -> None:
    free = torch.cuda.mem_get_info()[0]
    block = torch.empty(min(free // 4, 2**30), dtype=torch.uint8, device="cuda").fill_(0xFF)
    del block


def inputs(splits: list[int], F: int, dtype: torch.dtype, seed: int, probs: bool = True) -> list:
    """The op's arguments before its three flags: da, h's (1, 128) form, probs, offsets, NB, Tp."""
    T, E = sum(splits), len(splits)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, 2 * F, device="cuda", generator=gen)
    h *= torch.logspace(-2, 1, 2 * F, device="cuda")[
        torch.randperm(2 * F, device="cuda", generator=gen)
    ]
    da = torch.randn(T, F, device="cuda", generator=gen).to(dtype)
    p = torch.rand(T, device="cuda", generator=gen) if probs else None
    h_data, h_scales, _, _ = _swiglu_fp8.forward_ref(h.to(dtype), p)
    offsets = _fp8_ops.offsets_ref(torch.tensor(splits, device="cuda"), 16)
    return [da, h_data, h_scales, p, *offsets, -(-T // 128) + E, -(-(T + 15 * E) // 16) * 16]


def problems(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[str]:
    found = []
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.numel() == 0 and b.numel() == 0:
            continue
        if a.shape != b.shape:
            found.append(f"output {k}: shape {tuple(a.shape)}, expected {tuple(b.shape)}")
        elif k == 6:
            if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3, equal_nan=True):
                found.append(f"dprobs: max diff {(a.float() - b.float()).abs().max().item():.3g}")
        elif a.dtype == torch.float8_e4m3fn:
            bytes_a, bytes_b = a.view(torch.uint8), b.view(torch.uint8)
            equal = (bytes_a == bytes_b).float().mean().item()
            if equal < 0.97:
                found.append(f"output {k}: {equal:.4f} of the bytes equal")
            if (bytes_a == 0xFF).any() and not (bytes_b == 0xFF).any():
                found.append(f"output {k}: bytes left unwritten")
        else:
            same = (a == b) | (a.isnan() & b.isnan())
            ratio = a / b
            if not (same | (ratio == 2) | (ratio == 0.5)).all():
                found.append(f"output {k}: a scale off by more than 2x")
            if same.float().mean().item() < 0.98:
                found.append(f"output {k}: {same.float().mean().item():.4f} of the scales equal")
    return found


def check(exts: dict[str, object]) -> int:
    failures = 0

    def say(name: str, found: list[str]) -> None:
        nonlocal failures
        failures += bool(found)
        print("ok  " if not found else "FAIL", name, "; ".join(found), flush=True)

    for version, ext in exts.items():
        for splits in SPLITS:
            for dtype in (torch.bfloat16, torch.float16):
                for probs in (True, False):
                    args = inputs(splits, 384, dtype, seed=len(splits), probs=probs)
                    poison()
                    got = ext.backward(*args, True, True, True)
                    name = f"{version} E={len(splits)} {dtype} probs={probs}"
                    say(
                        name + " vs triton",
                        problems(got, triton_kernels.backward_triton(*args, True, True, True)),
                    )
                    say(name + " vs reference", problems(got, _swiglu_fp8.backward_ref(*args, True, True, True)))  # fmt: skip
        for asked in [(True, False, False), (False, True, False), (False, False, True)]:
            args = inputs([100, 0, 300], 256, torch.bfloat16, seed=9)
            poison()
            got = ext.backward(*args, *asked)
            say(f"{version} asked {asked}", problems(got, _swiglu_fp8.backward_ref(*args, *asked)))
        good = inputs([500, 500], 256, torch.bfloat16, seed=13)
        for bad in ([1400, 0, 500], [1050, -50, 0], [3, 5, -1, 993]):
            args = list(good)
            args[4:7] = _fp8_ops.offsets_ref(torch.tensor(bad, device="cuda"), 16)
            args[7], args[8] = -(-1000 // 128) + len(bad), -(-(1000 + 15 * len(bad)) // 16) * 16
            got, base = ext.backward(*args, True, True, True), ext.backward(*good, True, True, True)
            torch.cuda.synchronize()
            found = (
                [] if got[3].isnan().all() and got[5].isnan().all() else ["token scales not NaN"]
            )
            if not torch.equal(got[0].view(torch.uint8), base[0].view(torch.uint8)):
                found.append("rows form differs")
            if not (torch.equal(got[1], base[1]) and torch.equal(got[6], base[6])):
                found.append("row scales or dprobs differ")
            say(f"{version} malformed {bad}", found)
    return failures


def gpu_ms(fn: Callable[[], object], calls: int = 10, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(50_000_000)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def timing(exts: dict[str, object]) -> None:
    src, dst = torch.empty(2**28, device="cuda"), torch.empty(2**28, device="cuda")
    copy = 2 * src.numel() * 4 / (gpu_ms(lambda: dst.copy_(src)) / 1e3)
    print(f"copy {copy / 1e12:.2f} TB/s", flush=True)
    for name, splits, F in SHAPES:
        args = inputs(splits, F, torch.bfloat16, seed=1)
        moved = sum(splits) * F * 9
        calls = {
            "triton": lambda args=args: triton_kernels.backward_triton(*args, True, True, True)
        }
        for version, ext in exts.items():
            calls[version] = lambda ext=ext, args=args: ext.backward(*args, True, True, True)
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(3):
            for k, fn in calls.items():
                times[k].append(gpu_ms(fn))
        cells = []
        for k, ts in times.items():
            ms = statistics.median(ts)
            cells.append(f"{k} {ms:.3f} ms {moved / (ms / 1e3) / copy:.2f}x copy")
        print(f"{name:22s} " + "  ".join(cells), flush=True)


def main() -> int:
    start = time.time()
    exts = build()
    print(f"built in {time.time() - start:.0f} s", flush=True)
    failures = check(exts)
    print("failures", failures, flush=True)
    timing(exts)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
