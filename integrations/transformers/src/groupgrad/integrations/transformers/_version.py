"""Which ``transformers`` releases this integration supports, checked before it registers."""

from __future__ import annotations

import functools

from packaging.version import Version

import transformers

__all__ = [
    "EXPERT_PARALLEL_SINCE",
    "SUPPORTED_TRANSFORMERS",
    "check_expert_parallel_support",
    "check_transformers_version",
]

SUPPORTED_TRANSFORMERS = (Version("5.17"), Version("5.25"))
"""``[low, high)``: the ``transformers`` releases tested (5.17 through 5.24)."""


def check_transformers_version(installed: str | None = None) -> None:
    """Raise unless ``transformers`` (or ``installed``, a version string) is a supported release.

    The experts-implementation registry, the experts modules' attributes
    (``has_gate``, ``is_concatenated``, ``is_transposed``, ``has_bias``) and
    the packed ``gate_up_proj`` / ``down_proj`` layout this integration relies
    on are those of the releases in :data:`SUPPORTED_TRANSFORMERS`.

    Raises:
        RuntimeError: The version is outside ``[5.17, 5.25)`` (pre-releases
            of 5.25 included).
    """
    text = transformers.__version__ if installed is None else installed
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= Version(Version(text).base_version) < high:
        raise RuntimeError(
            f"groupgrad.integrations.transformers supports transformers >= {low}, < {high} "
            f"(5.17 through 5.24), but transformers {text} is installed; install a supported "
            f'release, e.g. pip install "transformers>={low},<{high}"'
        )


EXPERT_PARALLEL_SINCE = Version("5.23")
"""The first release whose expert parallelism groupgrad runs: ``DistributedConfig(ep_size=...,
ep_implementation=...)`` with its ``all_to_all`` and ``all_reduce`` implementations."""


def check_expert_parallel_support(installed: str | None = None) -> None:
    """Raise unless ``transformers`` (or ``installed``) runs expert parallelism as groupgrad expects.

    From 5.23 an expert-parallel experts module receives local expert ids,
    ``num_experts`` local experts and ``num_experts`` as the sentinel of a
    route to another rank; earlier releases dispatched tokens differently.

    Raises:
        RuntimeError: The version is older than :data:`EXPERT_PARALLEL_SINCE`.
    """
    text = transformers.__version__ if installed is None else installed
    if not _runs_expert_parallel(text):
        raise RuntimeError(
            f"groupgrad's experts run expert-parallel (DistributedConfig(ep_size=...)) on "
            f"transformers >= {EXPERT_PARALLEL_SINCE}, but transformers {text} is installed; "
            f'install transformers>={EXPERT_PARALLEL_SINCE} or use experts_implementation="grouped_mm"'
        )


@functools.cache
def _runs_expert_parallel(version: str) -> bool:
    """Whether ``version`` is at least :data:`EXPERT_PARALLEL_SINCE` (parsed once per string:
    every expert-parallel forward asks)."""
    return Version(Version(version).base_version) >= EXPERT_PARALLEL_SINCE
