"""Spike driver: the FP8 SwiGLU backward in one CUDA kernel against Triton's two and the reference.

Run on the GPU machine from the repository root (the packages on ``PYTHONPATH``)::

    python3 benchmarks/swiglu_fp8_spike/run_spike.py

It builds the kernel twice (``__launch_bounds__`` minimum 1 and 2 CTAs per SM)
with ``torch.utils.cpp_extension.load``, then checks every output against
the public op (on the GPU Triton's two kernels) and its reference twin with the
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

from groupgrad.kernels import (
    Fp8Blocks,
    quantize_fp8_ref,
    swiglu_probs_backward_fp8,
    swiglu_probs_backward_fp8_ref,
    swiglu_probs_fp8_ref,
)

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
    csrc = HERE.parents[1] / "kernels" / "src" / "groupgrad" / "kernels" / "csrc"
    return {
        f"cuda{blocks}": cpp_extension.load(
            f"gg_swiglu_spike_{blocks}",
            sources,
            extra_cuda_cflags=[*FLAGS, f"-DSWB_MIN_BLOCKS={blocks}"],
            extra_include_paths=[str(csrc)],
        )
        for blocks in (1, 2)
    }


def poison() -> None:
    free = torch.cuda.mem_get_info()[0]
    block = torch.empty(min(free // 4, 2**30), dtype=torch.uint8, device="cuda").fill_(0xFF)
    del block


def inputs(splits: list[int], F: int, dtype: torch.dtype, seed: int, probs: bool = True) -> list:
    """``[da, h's (1, 128) form, probs, splits]``: the public op's arguments."""
    T = sum(splits)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, 2 * F, device="cuda", generator=gen)
    h *= torch.logspace(-2, 1, 2 * F, device="cuda")[
        torch.randperm(2 * F, device="cuda", generator=gen)
    ]
    da = torch.randn(T, F, device="cuda", generator=gen).to(dtype)
    p = torch.rand(T, device="cuda", generator=gen) if probs else None
    h_rows, _ = swiglu_probs_fp8_ref(h.to(dtype), p)
    return [da, h_rows, p, torch.tensor(splits, device="cuda")]


def spike(ext: object, args: list, asked: tuple[bool, bool, bool]) -> list[torch.Tensor]:
    """The spike kernel's seven outputs (``backward_triton``'s order) for the public arguments."""
    da, h_rows, p, splits = args
    cut = quantize_fp8_ref(da.new_zeros(da.shape[0], 128), block=(128, 1), splits=splits)
    offsets = (cut.row_offsets, cut.seg_offsets, cut.block_offsets)
    NB, Tp = cut.scales.shape[0], cut.data.shape[1]
    return ext.backward(da, h_rows.data, h_rows.scales.t(), p, *offsets, NB, Tp, *asked)


def flat(found: tuple, asked: tuple[bool, bool, bool]) -> list[torch.Tensor]:
    """The public op's results as the spike's seven outputs."""
    dh, dht, dprobs, at = found
    empty8 = torch.empty(0, dtype=torch.float8_e4m3fn, device="cuda")
    empty = torch.empty(0, device="cuda")

    def pair(q: Fp8Blocks | None, rows: bool) -> list[torch.Tensor]:
        if q is None:
            return [empty8, empty]
        return [q.data, q.scales.t() if rows else q.scales]

    return [
        *pair(dh, True),
        *pair(dht, False),
        *pair(at, False),
        empty if dprobs is None else dprobs,
    ]


def public(fn: Callable, args: list, asked: tuple[bool, bool, bool]) -> list[torch.Tensor]:
    da, h_rows, p, splits = args
    flags = dict(zip(("dh_rows", "dh_tokens", "a_tokens"), asked, strict=True))
    return flat(fn(da, h_rows, p, splits=splits, **flags), asked)


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

    every = (True, True, True)
    for version, ext in exts.items():
        for splits in SPLITS:
            for dtype in (torch.bfloat16, torch.float16):
                for probs in (True, False):
                    args = inputs(splits, 384, dtype, seed=len(splits), probs=probs)
                    poison()
                    got = spike(ext, args, every)
                    name = f"{version} E={len(splits)} {dtype} probs={probs}"
                    triton = public(swiglu_probs_backward_fp8, args, every)
                    say(name + " vs triton", problems(got, triton))
                    reference = public(swiglu_probs_backward_fp8_ref, args, every)
                    say(name + " vs reference", problems(got, reference))
        for asked in [(True, False, False), (False, True, False), (False, False, True)]:
            args = inputs([100, 0, 300], 256, torch.bfloat16, seed=9)
            poison()
            got = spike(ext, args, asked)
            say(
                f"{version} asked {asked}",
                problems(got, public(swiglu_probs_backward_fp8_ref, args, asked)),
            )
        good = inputs([500, 500], 256, torch.bfloat16, seed=13)
        for bad in ([1400, 0, 500], [1050, -50, 0], [3, 5, -1, 993]):
            args = [*good[:3], torch.tensor(bad, device="cuda")]
            got, base = spike(ext, args, every), spike(ext, good, every)
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
    every = (True, True, True)
    for name, splits, F in SHAPES:
        args = inputs(splits, F, torch.bfloat16, seed=1)
        moved = sum(splits) * F * 9
        calls = {"triton": lambda args=args: swiglu_probs_backward_fp8(
            *args[:3], splits=args[3], dh_rows=True, dh_tokens=True, a_tokens=True)}  # fmt: skip
        for version, ext in exts.items():
            calls[version] = lambda ext=ext, args=args: spike(ext, args, every)
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
