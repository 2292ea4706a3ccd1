"""Test side of the multi-rank launcher: start W worker processes, collect each rank's results.

:func:`launch` runs a worker script (which calls
:func:`groupgrad_testsupport.worker.run_worker`) as ``world_size`` processes
that join one process group through a file store, waits for them, and returns
what every rank returned for every scenario. The first rank that fails (or a
timeout) kills the others at once, and the error shows every rank's exit and
log tail. :class:`Launches` launches each world size of a test module once.

What each worker process gets:

* ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (torchrun's
  names, which frameworks read) and ``GROUPGRAD_TESTSUPPORT_LAUNCH``, the
  path of the launch's JSON spec (backend, device, store, scenarios).
* ``OMP_NUM_THREADS=1`` (W processes share a few cores),
  ``PYTHONUNBUFFERED=1`` and ``PYTHONFAULTHANDLER=1`` (a crash leaves every
  thread's Python stack in the log), this folder's parent on ``PYTHONPATH``
  (so the worker imports ``groupgrad_testsupport``); the worker script's own
  folder is ``sys.path[0]``, so it imports its siblings by name.
* On ``device="cpu"``: ``CUDA_VISIBLE_DEVICES=""`` (no rank touches a GPU).
  On ``device="cuda"``: the test's ``CUDA_VISIBLE_DEVICES``; rank ``r`` uses
  ``cuda:r``; ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` so a worker may call
  ``torch.use_deterministic_algorithms(True)``.
* Then the caller's ``env``, which overrides all of the above.
* Its working directory is ``workdir``; its output goes to ``workdir/rank<R>.log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from groupgrad_testsupport import results

if TYPE_CHECKING:  # pytest only where the tests run: the support imports without it
    import pytest

LAUNCH_ENV = "GROUPGRAD_TESTSUPPORT_LAUNCH"
SUPPORT_PATH = Path(__file__).resolve().parent.parent  # the folder that holds this package
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class LaunchError(AssertionError):
    """A rank failed, timed out or left no result; the message has every rank's log tail."""


def torchrun(nproc: int) -> list[str]:
    """The command that starts a script as ``nproc`` local ranks under ``torch.distributed.run``.

    For tests that run an example or benchmark as a user does (``--standalone``);
    append the script and its arguments.
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
    ]


def run_command(
    args: Sequence[str], *, timeout: float, **options: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True, timeout=...)``, killing a whole tree.

    The command runs in a process group of its own; on a timeout (or any
    other way out, an interrupt included) the whole group is killed — the
    ranks ``torchrun`` started with it, which ``subprocess.run`` would leave
    running — before ``subprocess.TimeoutExpired`` is raised.

    Args:
        args: The command.
        timeout: Seconds it may run.
        **options: Further ``subprocess.Popen`` options (``env``, ``cwd``).
    """
    proc = subprocess.Popen(
        list(args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **options,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still there (a rank outliving its parent)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def result_path(workdir: Path, scenario: str, rank: int) -> Path:
    """Where rank ``rank`` leaves scenario ``scenario``'s result (see :mod:`.results`)."""
    return workdir / "results" / f"{scenario}.rank{rank}.json"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _check_scenarios(scenarios: Sequence[Mapping[str, Any]]) -> None:
    names = [s.get("name") for s in scenarios]
    bad = [n for n in names if not isinstance(n, str) or not _NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"scenario names {bad} must be strings of letters, digits, '_', '-', '.'")
    repeated = sorted({str(n) for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"scenario names repeat: {repeated}")


def launch(
    worker: Path | str,
    scenarios: Sequence[Mapping[str, Any]],
    *,
    world_size: int,
    workdir: Path,
    device: str = "cpu",
    backend: str | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    tail_chars: int = 4000,
) -> dict[str, list[Any]]:
    """Run ``worker`` as ``world_size`` ranks over ``scenarios``; return each scenario's results.

    Args:
        worker: A Python script that calls :func:`~groupgrad_testsupport.worker.run_worker`.
        scenarios: JSON-able mappings, each with a unique ``"name"`` (letters,
            digits, ``_-.``); every rank runs all of them, in order.
        world_size: Number of ranks (processes).
        workdir: An empty folder for the store, the logs and the results
            (``tmp_path`` or ``tmp_path_factory.mktemp(...)``).
        device: ``"cpu"`` or ``"cuda"`` (rank ``r`` on ``cuda:r``).
        backend: The process group's backend; default ``gloo`` on CPU, ``nccl`` on CUDA.
        timeout_s: Wall-clock limit for the whole launch.
        env: Extra environment for the workers (overrides the defaults above).
        tail_chars: How much of each rank's log a failure message shows.

    Returns:
        ``{scenario name: [rank 0's result, rank 1's result, ...]}``, decoded by
        :func:`groupgrad_testsupport.results.load`.

    Raises:
        LaunchError: A rank exited non-zero (the others are then killed), the
            launch ran past ``timeout_s``, or a rank left no result.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device is {device!r}, expected 'cpu' or 'cuda'")
    if world_size < 1:
        raise ValueError(f"world_size is {world_size}, expected at least 1")
    _check_scenarios(scenarios)
    worker = Path(worker).resolve()
    workdir = workdir.resolve()
    (workdir / "results").mkdir(parents=True, exist_ok=True)
    store = workdir / "store"
    stale = [store] + [
        result_path(workdir, s["name"], rank) for s in scenarios for rank in range(world_size)
    ]
    for path in stale:  # an earlier launch's store would be reused, its results read
        path.unlink(missing_ok=True)
    spec = {
        "backend": backend or ("gloo" if device == "cpu" else "nccl"),
        "device": device,
        "store": str(store),
        "scenarios": list(scenarios),
    }
    spec_path = workdir / "launch.json"
    spec_path.write_text(json.dumps(spec, indent=1))

    base = dict(os.environ)
    python_path = [str(SUPPORT_PATH), *filter(None, [base.get("PYTHONPATH")])]
    base.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join(python_path),
            LAUNCH_ENV: str(spec_path),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    if device == "cpu":
        base["CUDA_VISIBLE_DEVICES"] = ""
    else:
        base["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    base.update(env or {})

    logs = [workdir / f"rank{rank}.log" for rank in range(world_size)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, log_path in enumerate(logs):
            with log_path.open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(worker)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        cwd=workdir,
                        start_new_session=True,  # its own process group: killed with its children
                    )
                )
        failure = _wait(procs, timeout_s)
    finally:
        _kill(procs)

    def report(headline: str) -> LaunchError:
        parts = [f"{headline} ({worker.name}, {world_size} ranks, logs in {workdir})"]
        for rank, (proc, log_path) in enumerate(zip(procs, logs, strict=True)):
            tail = log_path.read_text(errors="replace")[-tail_chars:] if log_path.exists() else ""
            parts.append(f"--- rank {rank} ({_exit_text(proc.returncode)}) ---\n{tail}")
        return LaunchError("\n".join(parts))

    if failure is not None:
        raise report(failure)
    found: dict[str, list[Any]] = {}
    for scenario in scenarios:
        name = scenario["name"]
        paths = [result_path(workdir, name, rank) for rank in range(world_size)]
        missing = [rank for rank, path in enumerate(paths) if not path.exists()]
        if missing:
            raise report(f"scenario {name!r} left no result on ranks {missing}")
        found[name] = [results.load(path) for path in paths]
    return found


def _wait(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> str | None:
    """Wait for every rank; a description of the first failure, or ``None`` if all exited 0."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            first = ", ".join(f"rank {r} {_exit_text(codes[r])}" for r in failed)
            running = [rank for rank, code in enumerate(codes) if code is None]
            killed = f"; killed ranks {running}" if running else ""
            return f"worker ranks failed: {first}{killed}"
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() > deadline:
            running = [rank for rank, code in enumerate(codes) if code is None]
            return f"worker ranks {running} still running after {timeout_s:g} s; killed them"
        time.sleep(0.02)


def _kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill every rank still running and what any rank started (its process group); reap them."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


class Launches:
    """Launch each world size at most once, at the first test that asks for it.

    Typical use is a module-scoped fixture, so every test of the module reads
    the results of one launch per world size::

        @pytest.fixture(scope="module")
        def runs(tmp_path_factory):
            return Launches(tmp_path_factory, WORKER, {2: TWO_RANKS, 4: FOUR_RANKS})

        def test_something(runs):
            ranks = runs(2)["scenario-name"]  # one result per rank

    A failed launch fails the test that started it with the full report, and
    every later test that asks for the same world size with the same report.
    """

    def __init__(
        self,
        tmp_path_factory: pytest.TempPathFactory,
        worker: Path | str,
        scenarios: Mapping[int, Sequence[Mapping[str, Any]]],
        **options: Any,
    ) -> None:
        """``scenarios`` maps a world size to its scenarios; ``options`` go to :func:`launch`."""
        self._factory = tmp_path_factory
        self._worker = worker
        self._scenarios = scenarios
        self._options = options
        self._done: dict[int, dict[str, list[Any]]] = {}
        self._failed: dict[int, str] = {}

    def __call__(self, world_size: int) -> dict[str, list[Any]]:
        """The results of the ``world_size`` launch (``{scenario name: [per-rank result]}``)."""
        if world_size in self._failed:
            import pytest

            pytest.fail(f"the {world_size}-rank launch failed earlier:\n{self._failed[world_size]}")
        if world_size not in self._done:
            try:
                self._done[world_size] = launch(
                    self._worker,
                    self._scenarios[world_size],
                    world_size=world_size,
                    workdir=self._factory.mktemp(f"ranks{world_size}"),
                    **self._options,
                )
            except LaunchError as error:
                self._failed[world_size] = str(error)
                raise
        return self._done[world_size]
