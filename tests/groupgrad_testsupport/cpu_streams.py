"""CUDA streams and events that do nothing, for the test-only CPU shims of the Megatron suites.

Megatron-Core and Megatron-FSDP create side streams and events and run
collectives under ``torch.cuda.stream(...)``. On a CPU, with every collective
run to completion before the call returns, everything happens in program
order, so a stream that does nothing (and a context that does nothing) is
exact. :func:`stub_streams` installs them and makes the collectives
synchronous (:func:`collectives_in_program_order`); each suite's
``cpu_shim.py`` calls it from its ``install()``, never library code.

Why the collectives too: gloo runs an ``async_op=True`` collective on its own
thread, so with streams that do nothing nothing orders it before the code
that follows. On a GPU, Megatron-FSDP keeps a bucket alive until the stream
that gathers into it is done; here it could free or reuse a bucket that gloo
is still writing into. That is the likely cause of the one heap abort seen
in a CPU run (``malloc(): unaligned tcache chunk detected`` while waiting on
a parameter all-gather, zero1-unfixed scenario; not reproduced in 42 later
runs of that suite).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: The collectives Megatron issues with ``async_op``; each runs to completion when called.
SYNCHRONOUS_COLLECTIVES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "broadcast",
)


class Event:
    """A ``torch.cuda.Event`` that is always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Stream:
    """A ``torch.cuda.Stream`` whose waits and synchronizations do nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Event:
        return event if event is not None else Event()

    def synchronize(self) -> None:
        pass


class DoneWork:
    """What an ``async_op=True`` collective returns here: its work is already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _synchronous(collective: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def run(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        asked_async = bool(bound.arguments.get("async_op", False))
        bound.arguments["async_op"] = False
        result = collective(*bound.args, **bound.kwargs)
        return DoneWork() if asked_async else result

    return run


@contextlib.contextmanager
def _coalescing_in_order(
    group: Any = None, device: Any = None, async_ops: bool = False
) -> Iterator[Any]:
    with _ORIGINAL_COALESCING_MANAGER(group, device, async_ops=False) as manager:
        yield manager  # its wait() then has no work left to wait for


_ORIGINAL_COALESCING_MANAGER = c10d._coalescing_manager


def collectives_in_program_order(*importers: ModuleType) -> None:
    """Make :data:`SYNCHRONOUS_COLLECTIVES` and ``_coalescing_manager`` complete before returning.

    ``importers``: modules that imported ``_coalescing_manager`` by name (they
    get the synchronous one too).
    """
    for name in SYNCHRONOUS_COLLECTIVES:
        original = getattr(dist, name)
        if not getattr(original, "_groupgrad_synchronous", False):
            run = _synchronous(original)
            run._groupgrad_synchronous = True  # type: ignore[attr-defined]
            setattr(dist, name, run)
    for module in (dist, c10d, *importers):
        if hasattr(module, "_coalescing_manager"):
            module._coalescing_manager = _coalescing_in_order  # type: ignore[attr-defined]


def stub_streams() -> None:
    """Patch ``torch.cuda``'s ``Stream``, ``Event``, ``stream``, ``current_stream``,
    ``synchronize`` and ``empty_cache`` to do nothing, and make the collectives synchronous."""
    collectives_in_program_order()
    torch.cuda.Stream = Stream  # type: ignore[misc,assignment]
    torch.cuda.Event = Event  # type: ignore[misc,assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_stream = lambda device=None: Stream()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
