"""Timing and ceilings for the grouped-GEMM benchmark (``bench_kernels.py``).

CUDA events around each call, warm-up first, median over many calls, and the
inputs rotated between calls so that no call finds its operands in L2.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch


def median_ms(fn: Callable[[int], object], n_sets: int, reps: int, warmup: int = 3) -> float:
    """Median time (ms) of ``fn(i)``, ``i`` cycling over ``n_sets`` input sets."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(i % n_sets)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def median_ms_cpu(fn: Callable[[int], object], n_sets: int, reps: int, warmup: int) -> float:
    """Median wall time (ms, ``perf_counter``) of ``fn(i)``, ``i`` cycling over ``n_sets``: the CPU runs."""
    for i in range(warmup):
        fn(i % n_sets)
    samples = []
    for i in range(reps):
        start = time.perf_counter()
        fn(i % n_sets)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def interleaved_ms(
    fns: Mapping[str, Callable[[int], object]],
    n_sets: int,
    rounds: int,
    per_round: int,
    warmup: int = 2,
) -> dict[str, float]:
    """Median time (ms) of each function, measured in interleaved rounds.

    Every round times each function ``per_round`` times (individual event pairs),
    starting at a different function each round, so that slow drifts of the GPU
    (clocks under sustained power draw, temperature) spread over all functions
    instead of favouring whichever runs first.
    """
    names = list(fns)
    for name in names:
        for i in range(warmup):
            fns[name](i % n_sets)
    torch.cuda.synchronize()
    samples: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {n: [] for n in names}
    call = 0
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            for _ in range(per_round):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name](call % n_sets)
                end.record()
                samples[name].append((start, end))
                call += 1
        torch.cuda.synchronize()
    return {n: statistics.median(s.elapsed_time(e) for s, e in samples[n]) for n in names}


def host_us(fn: Callable[[int], object], n_sets: int, calls: int = 20, batches: int = 5) -> float:
    """CPU time per call (µs) of ``fn``: the median over ``batches`` batches of ``calls``
    calls enqueued back to back, no sync inside a batch.

    The GPU runs behind, so this is what each call costs the host (validation,
    dispatch, launches). When it exceeds the GPU time of a call, the host is
    the bottleneck of back-to-back calls. The median of several batches keeps
    one slow batch (a garbage collection, another process on the host) out.
    """
    fn(0)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(batches):
        start = time.perf_counter()
        for i in range(calls):
            fn(i % n_sets)
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def host_us_rounds(
    fns: dict[str, Callable[[int], object]], n_sets: int, calls: int = 50, rounds: int = 9
) -> dict[str, list[float]]:
    """:func:`host_us`'s batches for several functions, interleaved: each round times one
    batch of ``calls`` calls of every function in turn (rotating who goes first), so a host
    that changes speed between rounds (another process, a frequency step) moves all of them
    alike, and a ratio of two functions is best read per round. Returns each function's
    per-round µs per call."""
    names = list(fns)
    for name in names:
        fns[name](0)
    torch.cuda.synchronize()
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            start = time.perf_counter()
            for i in range(calls):
                fns[name](i % n_sets)
            per_round[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return per_round


def peak_bytes(fn: Callable[[int], object], n_sets: int) -> int:
    """Peak CUDA memory one call of ``fn`` allocates beyond what was allocated before it.

    ``fn(0)`` runs first (caches and lazy buffers settle), then ``fn(1 % n_sets)``
    is measured.
    """
    fn(0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(1 % n_sets)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def copy_bandwidth_gbs(gib: float = 4.0, reps: int = 20) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written (GB/s)."""
    n = int(gib * 2**30) // 4
    src = [torch.rand(n, device="cuda") for _ in range(2)]
    dst = torch.empty(n, device="cuda")
    ms = median_ms(lambda i: dst.copy_(src[i]), 2, reps)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def dense_bf16_tflops(size: int = 8192, reps: int = 20) -> float:
    """cuBLAS bf16 matrix product rate on random data (TFLOP/s)."""
    a = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    b = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    c = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda i: torch.mm(a[i], b[i], out=c), 2, reps)
    return 2 * size**3 / (ms * 1e-3) / 1e12


SPLIT_KINDS = ("uniform", "mild", "heavy")
"""The routing distributions every config is timed on (see :func:`splits_for`)."""


def mild_splits(T: int, E: int, seed: int) -> list[int]:
    """Mild skew: log-normal expert loads (sigma 1), some experts near empty; sums to ``T``."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.randn(E, generator=gen))
    counts = torch.floor(weights / weights.sum() * T).long()
    counts[torch.argmax(counts)] += T - int(counts.sum())
    return counts.tolist()


def heavy_splits(T: int, E: int, seed: int) -> list[int]:
    """Heavy skew, as real MoE routing drifts: empty experts and one expert with up to T/2.

    Drawn with a fixed seed: a fraction ``f ~ U(0.1, 0.3)`` of the experts (at
    least one, chosen at random) gets no tokens; each other expert gets a
    share proportional to ``g**2`` with ``g ~ Exp(1)`` (exponential shares
    with a heavier tail); the largest share is capped at one half, its excess
    spread over the others in proportion to their shares; counts are floored
    and the remainder goes to the largest expert. Sums to ``T``.
    """
    gen = torch.Generator().manual_seed(seed)
    empty = max(1, round(float(0.1 + 0.2 * torch.rand(1, generator=gen)) * E)) if E > 1 else 0
    order = torch.randperm(E, generator=gen)
    shares = torch.empty(E, dtype=torch.float64).exponential_(generator=gen) ** 2
    shares[order[:empty]] = 0.0
    shares /= shares.sum()
    top = int(torch.argmax(shares))
    if shares[top] > 0.5:
        excess, shares[top] = float(shares[top]) - 0.5, 0.5
        others = shares.clone()
        others[top] = 0.0
        shares += excess * others / others.sum()
    counts = torch.floor(shares * T).long()
    counts[top] += T - int(counts.sum())
    return counts.tolist()


def uniform_splits(T: int, E: int) -> list[int]:
    base, extra = divmod(T, E)
    return [base + (1 if e < extra else 0) for e in range(E)]


def splits_for(kind: str, T: int, E: int, seed: int) -> list[int]:
    """Token counts of one of :data:`SPLIT_KINDS`, fixed by ``seed``."""
    if kind == "uniform":
        return uniform_splits(T, E)
    if kind == "mild":
        return mild_splits(T, E, seed)
    if kind == "heavy":
        return heavy_splits(T, E, seed)
    raise ValueError(f"split kind is {kind!r}, expected one of {SPLIT_KINDS}")


def rel_error(
    ours: torch.Tensor | Sequence[torch.Tensor], ref: torch.Tensor | Sequence[torch.Tensor]
) -> float:
    """‖ours − ref‖ / ‖ref‖ in fp64 over all groups; NaN anywhere gives inf."""
    ours_list = [ours] if isinstance(ours, torch.Tensor) else list(ours)
    ref_list = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    num = den = 0.0
    for o, r in zip(ours_list, ref_list, strict=True):
        if not torch.isfinite(o).all():
            return float("inf")
        num += float((o.double() - r.double()).norm() ** 2)
        den += float(r.double().norm() ** 2)
    return (num / max(den, 1e-300)) ** 0.5


def fp32_addmm_loop_kind() -> str:
    """How this torch writes a bf16 x bf16 product into an fp32 buffer with beta = 1.

    ``addmm_out_dtype``: ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` (one
    cuBLAS call, torch >= 2.9); else ``mm_out_dtype_add``: ``c.add_(torch.mm(a, b,
    out_dtype=torch.float32))``; else ``fp32_addmm``: ``c.addmm_(a.float(), b.float())``.
    """
    a = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(32, 48, device="cuda", dtype=torch.bfloat16)
    want = a.float() @ b.float() + 1
    for kind in ("addmm_out_dtype", "mm_out_dtype_add"):
        c = torch.ones(64, 48, device="cuda")
        try:
            fp32_accumulate(kind, c, a, b)
        except (TypeError, RuntimeError):
            continue
        if torch.allclose(c, want, rtol=1e-4, atol=1e-4):
            return kind
    return "fp32_addmm"


def fp32_accumulate(kind: str, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if kind == "addmm_out_dtype":
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    elif kind == "mm_out_dtype_add":
        c.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        c.addmm_(a.float(), b.float())
