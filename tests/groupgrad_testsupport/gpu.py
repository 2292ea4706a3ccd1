"""The ``gpu`` marker: tests that need CUDA devices skip, with a reason, where there are too few.

One marker for every package's tests (declared in the root ``pyproject.toml``)::

    pytestmark = pytest.mark.gpu                  # a module of single-GPU tests
    @pytest.mark.gpu(2)                           # needs two CUDA devices (an NCCL group)
    @pytest.mark.gpu(capability=(9, 0))           # needs a device of compute capability 9.0

The root ``conftest.py`` hands the selected tests to :func:`mark_unavailable`,
which adds a ``skip`` marker to each whose closest ``gpu`` marker (a test's own
over its module's) asks for more than this machine has. Selection stays
pytest's: ``-m gpu`` runs them, ``-m "not gpu"`` (the CPU suite) leaves them
out. A skipped test is not a passing test, so the reason always says what was
needed and what was found, and ``-ra`` lists it under the test's own file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pytest only where the tests run: the support imports without it
    import pytest


@dataclass(frozen=True)
class GpuNeed:
    """What a ``gpu`` marker asks for.

    Attributes:
        count: CUDA devices the test uses (``cuda:0`` .. ``cuda:count-1``).
        capability: ``(major, minor)`` compute capability every one of them
            must have (e.g. ``(9, 0)`` for sm_90a kernels), or ``None`` for any.
    """

    count: int = 1
    capability: tuple[int, int] | None = None

    @classmethod
    def of(cls, marker: pytest.Mark) -> GpuNeed:
        """Parse ``gpu``, ``gpu(n)``, ``gpu(count=n)`` and ``gpu(..., capability=(major, minor))``."""
        unknown = set(marker.kwargs) - {"count", "capability"}
        if len(marker.args) > 1 or unknown or (marker.args and "count" in marker.kwargs):
            raise TypeError(
                f"gpu marker takes gpu(count=1, capability=None), got args {marker.args} and "
                f"kwargs {marker.kwargs}"
            )
        count = marker.args[0] if marker.args else marker.kwargs.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise TypeError(f"gpu marker count is {count!r}, expected a positive int")
        capability = marker.kwargs.get("capability")
        if capability is not None:
            capability = tuple(capability)
            if len(capability) != 2 or not all(isinstance(v, int) for v in capability):
                raise TypeError(f"gpu marker capability is {capability!r}, expected (major, minor)")
        return cls(count, capability)


@functools.cache
def cuda_device_count() -> tuple[int, str]:
    """Visible CUDA devices, and why there are none where there are none.

    Does not initialise CUDA (``torch.cuda.device_count`` asks NVML or the
    driver without creating a context).
    """
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return 0, f"torch {torch.__version__} is a CPU-only build"
    count = torch.cuda.device_count()
    if count:
        return count, ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return 0, "CUDA_VISIBLE_DEVICES is empty"
    return 0, f"torch {torch.__version__} sees no CUDA device"


@functools.cache
def unmet_reason(need: GpuNeed) -> str | None:
    """Why ``need`` cannot be met on this machine, or ``None`` when it can."""
    count, why_none = cuda_device_count()
    if count < need.count:
        plural = "s" if need.count > 1 else ""
        found = f"found {count}" + (f" ({why_none})" if why_none else "")
        return f"needs {need.count} CUDA device{plural}, {found}"
    if need.capability is None:
        return None
    import torch

    wrong = []
    for index in range(need.count):
        capability = torch.cuda.get_device_capability(index)
        if tuple(capability) != need.capability:
            name = torch.cuda.get_device_name(index)
            wrong.append(f"cuda:{index} {name} is {capability[0]}.{capability[1]}")
    if not wrong:
        return None
    major, minor = need.capability
    return f"needs CUDA compute capability {major}.{minor}; " + ", ".join(wrong)


def mark_unavailable(items: Iterable[pytest.Item]) -> None:
    """Add a ``skip`` marker, with the reason, to each item whose ``gpu`` marker cannot be met."""
    import pytest

    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        try:
            need = GpuNeed.of(marker)
        except TypeError as error:
            raise pytest.UsageError(f"{item.nodeid}: {error}") from None
        reason = unmet_reason(need)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def cuda_peak_growth(run: Callable[[], object]) -> int:
    """Bytes by which ``run()``'s peak CUDA allocation exceeds what was allocated before it.

    Synchronizes before and after, and resets the peak statistics first, so
    the number is ``run``'s own (for "backward allocates nothing weight-sized"
    tests: call the step once as a warm-up before measuring).
    """
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
