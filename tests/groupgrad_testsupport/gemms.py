"""The kernels' public entry points as the kernel tests pick them: each beside its ``*_ref`` twin.

DESIGN.md: every kernel entry of ``groupgrad.kernels`` has a pure-PyTorch twin
named ``<entry>_ref`` with the same signature and semantics, and the tests
compare the two. :data:`KERNEL_ENTRIES` names the entries; :data:`GEMMS`
holds the three grouped GEMMs of each implementation, so a test runs every
case through both::

    @pytest.mark.parametrize("impl", list(GEMMS))  # "kernel", "ref"
    def test_something(impl: str) -> None:
        fprop, dgrad, wgrad = GEMMS[impl]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import groupgrad.kernels

# The public kernel entries DESIGN.md promises; each also has its ``*_ref`` twin.
KERNEL_ENTRIES = (
    "grouped_fprop",
    "grouped_dgrad",
    "grouped_wgrad",
    "swiglu_probs",
    "swiglu_probs_backward",
    "swiglu_probs_fp8",
    "swiglu_probs_backward_fp8",
    "quantize_fp8",
)

# Public names that are not kernels, so have no twin: a checked wgrad call run later, and
# the quantizers' result type.
OTHER_PUBLIC_NAMES = ("Fp8Blocks", "PreparedWgrad", "prepare_wgrad")


def public_kernel_names() -> list[str]:
    """What ``groupgrad.kernels.__all__`` must hold, sorted: every entry and its twin, and the rest."""
    twins = [name for entry in KERNEL_ENTRIES for name in (entry, f"{entry}_ref")]
    return sorted([*twins, *OTHER_PUBLIC_NAMES])


class Gemms(NamedTuple):
    """The three grouped GEMMs of one implementation, in DESIGN.md's argument order."""

    fprop: Callable[..., Any]
    dgrad: Callable[..., Any]
    wgrad: Callable[..., Any]


def _gemms(suffix: str) -> Gemms:
    return Gemms(*(getattr(groupgrad.kernels, f"grouped_{op}{suffix}") for op in Gemms._fields))


# "kernel": the public entries (the CUTLASS GEMMs on CUDA, the reference's custom
# ops elsewhere); "ref": their ``*_ref`` twins, which always run the reference.
GEMMS: dict[str, Gemms] = {"kernel": _gemms(""), "ref": _gemms("_ref")}
