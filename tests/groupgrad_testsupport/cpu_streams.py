"""CUDA streams and events that do nothing, for the test-only CPU shims of the Megatron suites.

Megatron-Core and Megatron-FSDP create side streams and events and run
collectives under ``torch.cuda.stream(...)``. On a CPU everything runs in
program order, so a stream that does nothing (and a context that does
nothing) is exact. :func:`stub_streams` installs them; each suite's
``cpu_shim.py`` calls it from its ``install()``, never library code.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


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


def stub_streams() -> None:
    """Patch ``torch.cuda``'s ``Stream``, ``Event``, ``stream``, ``current_stream``,
    ``synchronize`` and ``empty_cache`` to do nothing."""
    torch.cuda.Stream = Stream  # type: ignore[misc,assignment]
    torch.cuda.Event = Event  # type: ignore[misc,assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_stream = lambda device=None: Stream()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
