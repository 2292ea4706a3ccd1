"""Worker side of the multi-rank launcher: one rank of a :func:`~groupgrad_testsupport.launch`.

A worker script ends with ``run_worker(run_scenario)``; :func:`run_worker`
joins the process group, calls ``run_scenario(scenario, rank)`` for every
scenario of the launch and saves what it returns (see :mod:`.results`), with
a barrier after each (one scenario's collectives never overlap the next's),
then shuts the rank down in an order that cannot crash at exit:

1. the last scenario's barrier: every rank has finished every collective, so
   no rank tears its connections down while a peer still talks to it;
2. ``dist.destroy_process_group()``;
3. flush the output and leave with ``os._exit`` (as ``multiprocessing``'s
   children do), skipping interpreter finalization.

Why 3: ``destroy_process_group()`` joins gloo's worker threads only if nothing
else still references the group, and PyTorch itself may: a module imported
lazily after ``init_process_group`` (``torch.distributed.nn.functional``,
pulled in by the first ``torch._dynamo`` import, for instance on a custom
op's first autograd call) keeps ``group.WORLD`` in its functions' default
arguments. Gloo's threads then live on into interpreter finalization, and one
that frees a finished collective's tensors there needs the GIL, which
finalization no longer hands out: ``PyThread_exit_thread`` unwinds that C++
thread through a ``noexcept`` destructor and the rank dies with ``terminate
called without an active exception`` (SIGABRT) after all its work was done.
With ``os._exit`` no thread outlives the process into finalization.

A scenario that raises prints its traceback and exits 1 at once (the launcher
then kills the other ranks); nothing after it runs.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from groupgrad_testsupport import results
from groupgrad_testsupport.launcher import LAUNCH_ENV, result_path


@dataclass(frozen=True)
class Rank:
    """What a worker process knows about its place in the launch.

    Attributes:
        rank: This process's rank (``RANK``).
        world_size: Number of ranks (``WORLD_SIZE``).
        backend: The process group's backend (``"gloo"`` or ``"nccl"``).
        device: ``cpu``, or ``cuda:<rank>`` on a CUDA launch.
        workdir: The launch's folder (also the worker's working directory).
        store: The file store the process group rendezvouses through.
        scenarios: Every scenario of the launch, in order.
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    workdir: Path
    store: Path
    scenarios: tuple[dict[str, Any], ...]

    @classmethod
    def from_env(cls) -> Rank:
        """This process's :class:`Rank`, from the environment :func:`launch` set."""
        if LAUNCH_ENV not in os.environ:
            raise RuntimeError(
                f"{LAUNCH_ENV} is not set: run this worker through "
                "groupgrad_testsupport.launch(), not by hand"
            )
        spec_path = Path(os.environ[LAUNCH_ENV])
        spec = json.loads(spec_path.read_text())
        rank = int(os.environ["RANK"])
        device = torch.device("cuda", rank) if spec["device"] == "cuda" else torch.device("cpu")
        return cls(
            rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            backend=spec["backend"],
            device=device,
            workdir=spec_path.parent,
            store=Path(spec["store"]),
            scenarios=tuple(spec["scenarios"]),
        )


def _exit(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(
    run_scenario: Callable[[dict[str, Any], Rank], Any],
    *,
    setup: Callable[[Rank], None] | None = None,
) -> NoReturn:
    """Be one rank of the launch: run every scenario, save the results, exit.

    Args:
        run_scenario: Called as ``run_scenario(scenario, rank)`` for each
            scenario (the JSON mapping the test passed to ``launch``); returns
            this rank's result, plain data and tensors (:mod:`.results`).
        setup: Called once with the :class:`Rank` before the process group
            is created (install a test shim, set deterministic algorithms).

    Never returns: the process exits 0 after the last scenario and a clean
    shutdown (module docstring), or 1 after printing the traceback of the
    first exception.
    """
    rank = Rank.from_env()
    name = "(setup)"
    try:
        if setup is not None:
            setup(rank)
        if rank.device.type == "cuda":
            torch.cuda.set_device(rank.device)
        dist.init_process_group(
            rank.backend,
            init_method=f"file://{rank.store}",
            rank=rank.rank,
            world_size=rank.world_size,
        )
        for scenario in rank.scenarios:
            name = scenario["name"]
            result = run_scenario(scenario, rank)
            results.dump(result, result_path(rank.workdir, name, rank.rank))
            dist.barrier()
        name = "(shutdown)"
        dist.destroy_process_group()
    except BaseException:
        print(f"rank {rank.rank}: scenario {name} failed", file=sys.stderr)
        traceback.print_exc()
        _exit(1)
    _exit(0)
