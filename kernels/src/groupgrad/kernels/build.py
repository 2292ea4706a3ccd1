"""Prebuild the CUTLASS kernels: ``python -m groupgrad.kernels.build``.

Compiles every kernel variant (one translation unit each, in parallel through
ninja; ``MAX_JOBS`` caps the parallelism) into the build cache, or finds them
there, and prints the wall time. Later GPU calls load the cached build instead
of compiling on first use. Needs nvcc, ninja and the ``nvidia-cutlass``
headers, and a CUDA build of PyTorch to load the result (no GPU needed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from groupgrad.kernels import _cutlass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m groupgrad.kernels.build", description=__doc__)
    parser.add_argument(
        "--cache-dir",
        default=None,
        help=f"build cache root (default: ${_cutlass.CACHE_ENV}, else ~/.cache/groupgrad/kernels)",
    )
    parser.add_argument(
        "--set",
        dest="variant_set",
        choices=sorted(_cutlass.VARIANT_SETS),
        default="default",
        help="which variant set to build (tuning: the benchmark's extra configurations)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    module, _, compiled = _cutlass.build(
        args.cache_dir, variant_set=args.variant_set, verbose=args.verbose
    )
    seconds = time.perf_counter() - start
    count = len(module.variants())
    where = _cutlass.build_directory(args.cache_dir, variant_set=args.variant_set)
    verb = "compiled" if compiled else "found cached"
    jobs = os.environ.get("MAX_JOBS", "ninja's default")
    print(
        f"groupgrad.kernels: {verb} {count} CUTLASS kernel variants in {seconds:.1f} s "
        f"(MAX_JOBS={jobs}) at {where}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
